# The prefill-gate proxy: slim, non-root, one uvicorn worker (the gate's state lives in
# the process; run one proxy per set of upstreams).
FROM python:3.12.8-slim-bookworm

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gate
WORKDIR /opt/prefill-gate
COPY requirements/proxy.lock ./requirements/
RUN pip install --no-cache-dir -r requirements/proxy.lock
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip install --no-cache-dir --no-deps . \
 && prefill-gate --help > /dev/null

USER 10001
ENV PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
ENTRYPOINT ["prefill-gate", "serve", "--host", "0.0.0.0", "--port", "8080"]
