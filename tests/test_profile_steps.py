"""bench/gpu/profile_steps.py: vLLM's torch-profiler trace, summarised per step."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_steps", ROOT / "bench/gpu/profile_steps.py")
profile_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_steps)


def ev(cat, name, ts, dur, tid=1, pid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def trace() -> list[dict]:
    """A decode step (one graph replay, 20 ms on the GPU) and a mixed step (the host 36 ms: a GDN
    core of 30 ms with 3 kernel launches inside it, one launch outside; the GPU busy 12 ms in two
    overlapping kernels and one apart), as kineto writes them (microseconds)."""
    decode = "execute_context_0(0)_generation_4(4)"
    mixed = "execute_context_1(300)_generation_4(4)"
    return [
        ev("user_annotation", decode, 0, 4_000),
        ev("cuda_runtime", "cudaGraphLaunch", 1_000, 50),
        ev("gpu_user_annotation", decode, 500, 20_000, tid=99),
        ev("kernel", "graph_kernel", 500, 20_000, tid=99),
        ev("user_annotation", mixed, 30_000, 36_000),
        ev("user_annotation", "gpu_model_runner: forward", 30_500, 33_000),
        ev("cpu_op", "vllm::qwen_gdn_attention_core", 31_000, 30_000),
        ev("cpu_op", "aten::copy_", 62_000, 1_000),
        ev("cuda_driver", "cuLaunchKernel", 32_000, 20),
        ev("cuda_driver", "cuLaunchKernel", 40_000, 20),
        ev("cuda_runtime", "cudaLaunchKernel", 50_000, 30),
        ev("cuda_runtime", "cudaLaunchKernel", 63_000, 30),
        ev("cuda_driver", "cuLaunchKernel", 70_000, 20),  # after the step: not its
        ev("gpu_user_annotation", mixed, 32_000, 40_000, tid=99),
        ev("kernel", "chunk_fwd", 32_000, 5_000, tid=99),
        ev("kernel", "gemm", 34_000, 5_000, tid=99),  # overlaps the one before: 7 ms together
        ev("kernel", "gemm", 60_000, 5_000, tid=99),
        ev("kernel", "later", 90_000, 5_000, tid=99),  # outside the step's GPU span
    ]


def test_a_step_s_host_time_gdn_share_launches_and_gpu_busy_time():
    summary = profile_steps.summarize(trace())
    decode, mixed = summary["steps"]
    assert decode["kind"] == "decode" and decode["graph_launches"] == 1 and decode["kernel_launches"] == 0
    assert decode["host_ms"] == 4.0 and decode["gpu_busy_ms"] == 20.0
    assert mixed["kind"] == "mixed" and mixed["prefill_tokens"] == 300 and mixed["decode_requests"] == 4
    assert mixed["host_ms"] == 36.0 and mixed["gdn_host_ms"] == 30.0
    assert mixed["outside_ops_ms"] == 5.0  # 36 less the GDN core's 30 and the copy's 1
    assert decode["outside_ops_ms"] == 4.0
    assert mixed["kernel_launches"] == 4 and mixed["launch_call_ms"] == pytest.approx(0.1)
    assert mixed["gpu_busy_ms"] == 12.0  # 7 ms of two overlapping kernels and 5 apart
    top = summary["mixed_top_ops"]
    assert [op["op"] for op in top] == ["[gpu_model_runner: forward]", "vllm::qwen_gdn_attention_core", "aten::copy_"]
    assert top[1]["host_ms_per_step"] == 30.0 and top[1]["calls_per_step"] == 1
    assert summary["decode_top_ops"] == []  # the decode step ran no operation, only its graph
    assert summary["by_kind"]["mixed"]["host_ms"] == 36.0 and summary["by_kind"]["prefill"] is None


def test_summarize_reads_a_gzipped_trace_and_says_when_it_has_no_steps(tmp_path, capsys):
    path = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace()}, f)
    out = tmp_path / "profile.json"
    assert profile_steps.main(["summarize", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mixed" in printed and "qwen_gdn_attention_core" in printed
    saved = json.loads(out.read_text())
    assert saved["bench"] == "profile_steps" and len(saved["steps"]) == 2 and "git_commit" in saved
    assert profile_steps.newest_trace(tmp_path) == path
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [ev("cpu_op", "aten::mm", 0, 10)]}))
    assert profile_steps.main(["summarize", str(empty)]) == 1
    assert "no annotated steps" in capsys.readouterr().err
