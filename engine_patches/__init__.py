"""vLLM 0.26.0 patches for prefill-gate, loaded as a vLLM general plugin.

    pip install "prefill-gate[engine]"   # registers the `vllm.general_plugins` entry point
    PREFILL_GATE_PACING=cap PREFILL_GATE_PACING_CAP_TOKENS=256 \\
      vllm serve MODEL --scheduler-cls engine_patches.pacing.PacedAsyncScheduler

`register()` runs in every vLLM process at start: it validates the PREFILL_GATE_PACING*
settings (a bad value stops vLLM with a message naming the variable) and logs what is
active. The scheduler classes themselves are chosen with `--scheduler-cls`; each patch
has an environment kill switch (PREFILL_GATE_PACING=off).
"""

from __future__ import annotations

import logging

# Under "vllm." so that vLLM's logging configuration (handler, format, level) covers it.
LOGGER = "vllm.prefill_gate"
logger = logging.getLogger(LOGGER)


def register() -> None:
    from engine_patches import _vllm  # the version check
    from engine_patches.config import PacingConfig

    config = PacingConfig.from_env()
    logger.info("prefill-gate engine_patches for vLLM %s: %s", _vllm.SUPPORTED_VLLM,
                config.describe())
