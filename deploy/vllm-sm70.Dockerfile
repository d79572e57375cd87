# vLLM 0.26.0 for V100 (sm_70), built from source: the released wheels carry no sm_70
# kernels. CUDA 12.8 is the newest toolkit that still targets sm_70. fp16 only (V100
# has no bf16): serve with --dtype half. Plus prefill-gate's engine patches.
# Building takes hours and ~64 GB of RAM; MAX_JOBS bounds the parallel compiles.
FROM nvidia/cuda:12.8.1-devel-ubuntu22.04

ARG VLLM_VERSION=0.26.0
ARG TORCH_VERSION=2.11.0
ARG MAX_JOBS=8
ENV TORCH_CUDA_ARCH_LIST=7.0 MAX_JOBS=${MAX_JOBS} DEBIAN_FRONTEND=noninteractive

# Ubuntu's own Python (3.10) and build tools; the distribution pins their versions.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install --no-cache-dir setuptools==80.9.0 setuptools-scm==8.3.1 wheel==0.45.1 ninja==1.13.0 \
      cmake==3.31.6 packaging==25.0 jinja2==3.1.6
WORKDIR /src
RUN git clone --depth 1 --branch "v${VLLM_VERSION}" https://github.com/vllm-project/vllm.git . \
 && python3 use_existing_torch.py \
 && pip install --no-cache-dir -r requirements/build.txt \
 && pip install --no-cache-dir --no-build-isolation .

WORKDIR /opt/prefill-gate
COPY pyproject.toml setup.py README.md ./
COPY prefill_gate ./prefill_gate
RUN pip install --no-cache-dir --no-deps .

ENV PREFILL_GATE_PACING=off
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]
