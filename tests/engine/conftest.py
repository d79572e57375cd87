"""Engine-patch tests need vLLM 0.26.0 importable on the CPU (see requirements/).

Without it they skip, except under PREFILL_GATE_REQUIRE_ENGINE=1 (scripts/test.sh and CI
set it), where a missing or broken vLLM fails the run instead of hiding these tests.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PREFILL_GATE_REQUIRE_ENGINE") == "1":
    import vllm  # noqa: F401  (fail loudly)
else:
    pytest.importorskip("vllm", reason="vLLM 0.26.0 not installed (requirements/engine-*.txt)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tests.engine.harness import model_dir

    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def pacing_env(monkeypatch):
    """Set PREFILL_GATE_PACING* for the schedulers a test builds."""

    def set_env(mode: str, **values) -> None:
        monkeypatch.setenv("PREFILL_GATE_PACING", mode)
        monkeypatch.setenv("PREFILL_GATE_PACING_LOG_INTERVAL_S", "0")
        for key, value in values.items():
            monkeypatch.setenv(f"PREFILL_GATE_PACING_{key.upper()}", str(value))

    return set_env


@pytest.fixture(autouse=True)
def _no_gc_watch_left():
    """register() watches the process's collections (`stalls`); a test's watch ends with it."""
    yield
    from prefill_gate.engine_patches import stalls

    stalls.uninstall()


@pytest.fixture(autouse=True)
def _no_warmup_wrapper_left():
    """register() with the GDN patch on wraps vLLM's Qwen warm-up (`warmup`); a test's wrapper
    ends with it, so the next test's register() starts from vLLM's own."""
    yield
    import sys

    module = sys.modules.get("vllm.model_executor.warmup.kernel_warmup")
    fn = getattr(module, "qwen_triton_warmup", None)
    while getattr(fn, "prefill_gate_warmup", False):
        fn = fn.__wrapped__
        module.qwen_triton_warmup = fn
