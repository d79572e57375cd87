# vLLM 0.26.0 (the official image) with prefill-gate's engine patches (a vLLM general
# plugin) and its paged-attention kernel. Step pacing stays off until PREFILL_GATE_PACING says otherwise
# (docker-compose.yml passes it from .env) and --scheduler-cls selects the paced class.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/prefill-gate
COPY pyproject.toml setup.py README.md ./
COPY prefill_gate ./prefill_gate
# --no-deps: the image already has vLLM 0.26.0 and everything the patches import.
RUN pip install --no-cache-dir --no-deps . \
 && python3 -c "import prefill_gate.engine_patches._vllm"

ENV PREFILL_GATE_PACING=off
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
