"""bench/gpu/place_stalls.py: a run's worst gaps beside the servers' logged moments."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("place_stalls", ROOT / "bench/gpu/place_stalls.py")
place_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(place_stalls)

T0 = 1_800_000_000.0


def test_a_stall_is_placed_beside_the_collection_and_the_long_step_inside_it(tmp_path, capsys):
    # Stall 1: three streams from 20.122 s to ~20.16 s. Stall 2: one stream at 27.62 s.
    worst = [[20.1553, 33.75, 10], [20.1577, 35.99, 9], [20.1623, 40.18, 2], [27.6500, 32.46, 0]]
    (tmp_path / "defaults.json").write_text(json.dumps(
        {"rows": {"stack": {"steady": {"mixed": {"worst_gaps": worst, "t0_unix": T0}}}}}))
    (tmp_path / "gc.log").write_text(
        "server-paced.log:WARNING 12-05 10:00:00 [stalls.py:70] prefill-gate: Python's cycle collector held "
        f"EngineCore_DP0 (pid 77) 31.0 ms, generation 2, 5 objects collected, ending at {T0 + 20.154:.3f} (unix s); "
        "1 such collection(s) in this process, the longest 31.0 ms\n"
        f"proxy-stack.log:WARNING the cycle collector held the event loop 22.0 ms (generation 2), ending at "
        f"{T0 + 50.0:.3f} (unix s)\n")
    trace = [{"unix": T0 + t, "decode_rows": 12, "chunks": [[0, n]], "predicted_s": 0.012}
             for t, n in [(20.110, 400), (20.1215, 480), (20.155, 0), (20.162, 0), (27.60, 256), (27.612, 256)]]
    trace[1].update(t=500.0, launched=500.0301)  # its host time, schedule to launch: 30.1 ms
    with gzip.open(tmp_path / "trace.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in trace) + "\n")

    assert place_stalls.main([str(tmp_path / "defaults.json"), "--gc", str(tmp_path / "gc.log"),
                              "--trace", str(tmp_path / "trace.jsonl.gz")]) == 0
    out = capsys.readouterr().out
    first, second = out.split("stall at ")[1:]
    assert "40.2 ms, 3 stream(s) [2, 9, 10]" in first and "EngineCore_DP0 (pid 77) 31.0 ms" in first
    assert "lasting 33.5 ms: 12 decode rows, 480 prefill tokens, predicted 12.0 ms, host 30.1 ms" in first
    assert " 0 prefill tokens, predicted 12.0 ms\n" in first  # no launch recorded: no host time
    assert first.count("  step at ") == 3  # the one it began in, and the two within it
    assert "event loop" not in out  # the proxy's collection was elsewhere
    assert "1 stream(s) [0]" in second and "collection" not in second
    assert "step at -5.5 ms to the trace's end: 12 decode rows, 256 prefill tokens" in second


def test_a_run_from_before_t0_unix_or_not_a_result_is_refused_with_the_reason(tmp_path, capsys):
    (tmp_path / "d.json").write_text(json.dumps({"rows": {"stack": {"steady": {"mixed": {"worst_gaps": []}}}}}))
    assert place_stalls.main([str(tmp_path / "d.json")]) == 2
    assert "no t0_unix" in capsys.readouterr().err
    (tmp_path / "d.json").write_text("not json")
    assert place_stalls.main([str(tmp_path / "d.json")]) == 2
    assert "not a bench defaults result" in capsys.readouterr().err


def test_the_pairs_worst_gaps_are_placed_beside_the_steps_and_the_hosts_speed(tmp_path, capsys):
    """``--part pair``: each run's worst gap of B on the wall clock (its ``t0_unix``), with the
    steps in it and the host probe's samples then, against their median: a slow machine shows."""
    raw = [{"run": 1, "t0_unix": T0, "b": {"tokens": [1.00, 1.02, 1.04, 1.093, 1.11]}},
           {"run": 2, "t0_unix": T0 + 30, "b": {"tokens": [1.00, 1.02, 1.07, 1.09]}},
           {"run": 3, "b": {"tokens": [1.0, 2.0]}}]  # from before t0_unix: not placed
    (tmp_path / "d.json").write_text(json.dumps({"rows": {"stack": {"pair": {"raw": raw}}}}))
    trace = [{"unix": T0 + 1.041, "decode_rows": 1, "chunks": [[0, 255]], "predicted_s": 0.04},
             {"unix": T0 + 1.092, "decode_rows": 1, "chunks": [[255, 38]], "predicted_s": 0.02}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in trace) + "\n")
    probe = [{"unix": T0 + t, "work_us": us, "busy": 0.2, "steal": st}
             for t, us, st in [(0.5, 1000, 0.0), (1.06, 2100, 0.05), (2.0, 1000, 0.0), (31.0, 1010, 0.0),
                               (31.05, 990, 0.0), (40.0, 1000, 0.0)]]
    with gzip.open(tmp_path / "probe.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in probe) + '{"unix": 18')  # the line the kill cut
    assert place_stalls.main([str(tmp_path / "d.json"), "--part", "pair", "--trace", str(tmp_path / "t.jsonl"),
                              "--probe", str(tmp_path / "probe.jsonl.gz")]) == 0
    first, second = capsys.readouterr().out.split("stall at ")[1:]
    assert "53.0 ms, 1 stream(s) ['B, run 1']" in first and "255 prefill tokens" in first
    assert "host probe at +20.0 ms: 2100 us, 2.10x its median, 5% stolen" in first
    assert "50.0 ms, 1 stream(s) ['B, run 2']" in second and "1.01x its median" in second
    (tmp_path / "old.json").write_text(json.dumps({"rows": {"stack": {"pair": {"raw": raw[2:]}}}}))
    assert place_stalls.main([str(tmp_path / "old.json"), "--part", "pair"]) == 2
    assert "no t0_unix" in capsys.readouterr().err


def test_a_step_with_more_requests_than_any_before_it_is_marked():
    """A server's first step past a request count (9 at run-ed51eec: ~65 ms more host time) is
    named; a later step with as many, or one after a larger count, is not."""
    trace = place_stalls.steps([{"unix": T0 + i, "step": i + 1, "decode_rows": d, "chunks": c}
                                for i, (d, c) in enumerate([(4, []), (6, [[0, 50], [0, 75]]),
                                                            (6, [[0, 125], [50, 50], [0, 75]]),
                                                            (8, [[100, 25]]), (7, None)])])
    assert [r["requests"] for r in trace] == [4, 8, 9, 9, 7]
    assert [r["most_requests_yet"] for r in trace] == [True, True, True, False, False]
    # A server started again writes to the same trace from its step 1: its own firsts count.
    again = place_stalls.steps([{"unix": T0 + i, "step": s, "decode_rows": d, "chunks": []}
                                for i, (s, d) in enumerate([(1, 3), (2, 9), (3, 5), (1, 2), (2, 9), (3, 9)])])
    assert [r["most_requests_yet"] for r in again] == [True, True, False, True, True, False]
    stall = {"start": T0 + 1.9, "end": T0 + 3.5, "gap_ms": 1600.0, "users": [0]}
    placed = place_stalls.place(stall, [], trace)["steps"]
    assert [(s["requests"], s["most_requests_yet"]) for s in placed] == [(8, True), (9, True), (9, False)]
