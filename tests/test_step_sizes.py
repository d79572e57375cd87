"""bench/gpu/step_sizes.py: a step trace's mixed steps by the CUDA-graph size they were padded to."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("step_sizes", ROOT / "bench/gpu/step_sizes.py")
step_sizes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_sizes)


def trace(steps: list[tuple[int, int, float]], with_sizes: bool = True) -> list[dict]:
    """Lines for steps of (decode rows, prefill tokens, seconds) run back to back; a schedule
    call starts each, async-style (step i runs from call i+1 to call i+2)."""
    lines, t = [], 0.0
    for i, (rows, tokens, _) in enumerate(steps):
        line = {"t": t, "decode_rows": rows, "chunks": [[0, tokens]] if tokens else [], "predicted_s": 0.040}
        if with_sizes:
            line["graph_size"] = 256 if rows + tokens <= 256 else 320 if rows + tokens <= 320 else None
        lines.append(line)
        # the interval after call i+1 is step i's
        t += steps[i - 1][2] if i else 0.001
    return lines


def test_steps_group_by_size_with_the_async_lag(tmp_path, capsys):
    steps = [(1, 255, 0.040), (1, 255, 0.041), (1, 319, 0.055), (1, 255, 0.042), (4, 0, 0.020), (1, 255, 0.040),
             (1, 255, 0.9), (1, 255, 0.040), (1, 255, 0.040)]
    rows = step_sizes.by_size(trace(steps))
    # the last two steps end past the trace; the decode-only one is no mixed step
    assert [(r["graph_size"], r["steps"]) for r in rows] == [(256, 4), (320, 1)]
    assert rows[1]["median_ms"] == 55.0 and rows[1]["predicted_median_ms"] == 40.0
    assert rows[0]["max_ms"] == 42.0  # the 0.9 s interval is idle time, no step
    assert [r["steps"] for r in step_sizes.by_size(trace(steps), lag=0)] == [5, 1]  # --sync: one more ends in it
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in trace(steps)))
    assert step_sizes.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    assert "320" in capsys.readouterr().out
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["rows"][1]["graph_size"] == 320
    assert out["git_commit"] and "run_git_commit" not in out  # the analysis's commit; no run's JSON beside
    (tmp_path / "defaults.json").write_text(json.dumps({"git_commit": "abc123", "git_dirty": False}))
    assert step_sizes.main([str(path), "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["run_git_commit"], out["run_git_dirty"]) == ("abc123", False)


def test_old_traces_need_the_sizes(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    steps = [(1, 255, 0.040), (1, 319, 0.055), (1, 255, 0.040), (1, 255, 0.040)]
    path.write_text("\n".join(json.dumps(x) for x in trace(steps, with_sizes=False)))
    assert step_sizes.main([str(path)]) == 2 and "pass --sizes" in capsys.readouterr().err
    rows = step_sizes.by_size(trace(steps, with_sizes=False), sizes=[128, 256, 320, 512])
    assert [(r["graph_size"], r["steps"]) for r in rows] == [(256, 1), (320, 1)]
    assert step_sizes.main([str(tmp_path / "missing.jsonl")]) == 2


def test_host_time_from_launched(capsys, tmp_path):
    steps = [(1, 255, 0.040), (1, 255, 0.041), (1, 319, 0.055), (1, 255, 0.042), (1, 255, 0.040)]
    lines = trace(steps)
    for line, host in zip(lines, (0.030, 0.032, 0.050, 0.031, 0.030)):
        line["launched"] = line["t"] + host
    rows = step_sizes.by_size(lines)
    assert [(r["graph_size"], r["host_median_ms"]) for r in rows] == [(256, 31.0), (320, 50.0)]
    assert [r["host_median_ms"] for r in step_sizes.by_size(trace(steps))] == [None, None]  # older traces
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert step_sizes.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "host ms" in out and "50.0" in out


def test_host_time_during_a_part(tmp_path, capsys):
    """``--during steady``: the host time of the steps scheduled while the steady part ran its
    load (``defaults.json`` beside the trace), mixed and decode-only apart; steps outside it
    and steps without ``launched`` left out."""
    lines = []
    for i in range(40):
        unix = 1000.0 + i
        line = {"t": float(i), "unix": unix, "decode_rows": 4, "chunks": [[0, 200]] if i % 2 else [], "graph_size": 256}
        if i != 21:
            line["launched"] = line["t"] + (0.030 if i % 2 else 0.003) + (0.050 if i == 25 else 0.0)
        lines.append(line)
    path = tmp_path / "paced-trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert step_sizes.main([str(path), "--during", "steady"]) == 2  # no defaults.json beside it
    assert "no stack steady part" in capsys.readouterr().err
    part = {"mixed": {"t0_unix": 1010.0}, "shape": {"duration": 20.0}}
    (tmp_path / "defaults.json").write_text(json.dumps({"rows": {"stack": {"steady": part}}, "git_commit": "abc"}))
    assert step_sizes.main([str(path), "--during", "steady", "--json", str(tmp_path / "out.json")]) == 0
    during = json.loads((tmp_path / "out.json").read_text())["during"]
    # steps 10..30: mixed 11, 13, ..., 29 (10, step 21 without launched: 9), decode 10, 12, ..., 30 (11)
    assert during["mixed"]["steps"] == 9 and during["decode"]["steps"] == 11
    assert during["mixed"]["host_ms_p50"] == 30.0 and during["mixed"]["host_ms_max"] == 80.0
    assert during["decode"]["host_ms_max"] == 3.0
    assert "mixed steps 9, host ms p50 / p90 / p99 / max 30.0" in capsys.readouterr().out
