# The prefill-gate proxy: slim, non-root, one uvicorn worker (the gate's state lives in
# the process; run one proxy per set of upstreams).

# The wheel, with the relay's compiled core (prefill_gate/proxy/_relaycore.c), built where a compiler is;
# the image it runs in has none.
FROM python:3.12.8-slim-bookworm AS build
# Debian bookworm's compiler; the distribution pins its version.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY prefill_gate ./prefill_gate
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12.8-slim-bookworm

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gate
WORKDIR /opt/prefill-gate
COPY requirements/proxy.lock ./requirements/
RUN pip install --no-cache-dir -r requirements/proxy.lock
COPY --from=build /wheels /wheels
# The compiled core must be in the image (relay_core auto would quietly run Python without it).
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
 && python3 -c "import prefill_gate.proxy._relaycore" \
 && prefill-gate --help > /dev/null

USER 10001
ENV PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
ENTRYPOINT ["prefill-gate", "serve", "--host", "0.0.0.0", "--port", "8080"]
