"""prefill_gate.engine_patches.routing.classify_rows: the per-row launch choice (pure)."""

from __future__ import annotations

import pytest

from prefill_gate.engine_patches.routing import classify_rows, mode_from_env, split_query_cap


def test_plain_decode_batch():
    assert classify_rows([1, 1, 1], [False] * 3, 0) == ["decode"] * 3


@pytest.mark.parametrize("k", range(1, 8))
def test_verify_rows_for_every_k(k):
    lens = list(range(1, k + 2))  # 1..1+k tokens: accepted drafts vary per request
    assert classify_rows(lens, [False] * len(lens), k) == ["decode"] + ["verify"] * k
    assert classify_rows([k + 2], [False], k) == ["prefill"]  # longer than 1 + k: not a verify row


def test_a_short_chunked_prefill_of_the_same_length_is_not_a_verify_row():
    assert classify_rows([4, 4], [False, True], 3) == ["verify", "prefill"]


def test_a_final_prefill_chunk_is_prefill():
    assert classify_rows([1, 2], [True, True], 3) == ["prefill", "prefill"]


def test_padding_rows_take_the_decode_launch():
    assert classify_rows([0, 0, 1], [False, False, False], 0) == ["decode"] * 3


def test_mixed_batch():
    assert classify_rows([1, 4, 300, 2, 1], [False, False, True, False, False], 3) == \
        ["decode", "verify", "prefill", "verify", "decode"]


def test_modes():
    lens, pre = [1, 3, 8, 9, 5], [False, False, True, False, True]
    assert classify_rows(lens, pre, 2, "auto") == ["decode", "verify", "prefill", "prefill", "prefill"]
    assert classify_rows(lens, pre, 2, "0") == ["decode", "prefill", "prefill", "prefill", "prefill"]
    assert classify_rows(lens, pre, 2, "1") == ["decode", "verify", "verify", "prefill", "verify"]


@pytest.mark.parametrize("args, message", [
    (([1], [False], 0, "on"), "PREFILL_GATE_SPEC_AS_DECODE='on'"),
    (([1, 2], [False], 0, "auto"), "2 query lengths for 1 prefill flags"),
    (([1], [False], -1, "auto"), "num_spec_tokens"),
    (([-1], [False], 0, "auto"), "negative query length"),
])
def test_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        classify_rows(*args)


def test_verify_rows_stop_at_the_split_path_limit():
    # k = 10: a 1 + 10-token verify row is longer than SPLIT_MAX_QUERY (8): 2-D
    assert classify_rows([8, 9, 11], [False] * 3, 10) == ["verify", "prefill", "prefill"]
    assert split_query_cap(10, "auto") == 8 and split_query_cap(3, "auto") == 4
    assert split_query_cap(3, "0") == 1 and split_query_cap(0, "1") == 8


def test_mode_from_env():
    assert mode_from_env({}) == "auto"
    assert mode_from_env({"PREFILL_GATE_SPEC_AS_DECODE": " 1 "}) == "1"
    with pytest.raises(ValueError, match="PREFILL_GATE_SPEC_AS_DECODE='maybe'"):
        mode_from_env({"PREFILL_GATE_SPEC_AS_DECODE": "maybe"})


def test_routing_loads_without_the_kernel():
    """The plugin imports routing in every vLLM process; Triton and torch load only where
    --attention-backend CUSTOM selects the kernel (prefill_gate/engine_patches/__init__.py)."""
    import subprocess
    import sys

    code = ("import sys, prefill_gate.engine_patches.routing; "
            "print(sorted(m for m in ('triton', 'torch', 'prefill_gate.kernels.paged_attention') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
