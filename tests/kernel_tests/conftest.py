"""Kernel tests run Triton's interpreter on the CPU (TRITON_INTERPRET=1, set before
Triton is imported) and its ahead-of-time compiler for sm_70/80/90; GPU tests are marked.
Without Triton they skip, except under PREFILL_GATE_REQUIRE_ENGINE=1 (scripts/test.sh)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # also set by tests/conftest.py, before vLLM imports Triton

if os.environ.get("PREFILL_GATE_REQUIRE_ENGINE") == "1":
    import triton  # noqa: F401  (fail loudly)
else:
    pytest.importorskip("triton", reason="Triton not installed (requirements/engine-cpu.txt)")
