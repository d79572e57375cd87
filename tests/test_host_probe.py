"""bench/gpu/host_probe.py: the host's own speed sampled beside a GPU run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench/gpu/host_probe.py"
spec = importlib.util.spec_from_file_location("host_probe", SCRIPT)
host_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_probe)


def test_it_samples_until_killed_and_leaves_whole_lines(tmp_path):
    out = tmp_path / "probe.jsonl"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--every", "0.05"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 4):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # a TERM ends the loop after its sample, not mid-line
    rows = host_probe.read(out)
    assert len(rows) >= 4 and out.read_text().endswith("\n")
    assert all(r["work_us"] > 0 and abs(r["unix"] - time.time()) < 60 for r in rows)
    if os.path.exists("/proc/stat"):  # every sample after the first has the interval's CPU shares
        assert all(0 <= r["busy"] <= 1 and 0 <= r["steal"] <= 1 for r in rows[1:]), rows


def test_the_summary_finds_the_slow_stretches(tmp_path, capsys):
    rows = [{"unix": 100 + i * 0.2, "work_us": us, "busy": 0.1, "steal": 0.0}
            for i, us in enumerate([1000, 1010, 990, 2000, 2100, 1900, 1000, 1005, 3000, 995])]
    out = tmp_path / "p.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    assert host_probe.main(["--summary", str(out)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples"] == 10 and s["work_us_p50"] == 1007.5 and s["work_us_max"] == 3000
    assert [(x["from_unix"], x["to_unix"]) for x in s["slow_stretches"]] == [(100.6, 101.0), (101.6, 101.6)]
    assert s["slow_stretches"][0]["x_median"] == round(2000 / 1007.5, 2) and s["slow_share"] == 0.4
    assert host_probe.main(["--summary", str(tmp_path / "none.jsonl")]) == 2


def test_cpu_shares_come_from_proc_stat_deltas(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    before = host_probe.cpu_times(stat)
    stat.write_text("cpu  160 0 70 880 50 0 0 40 0 0\n")
    after = host_probe.cpu_times(stat)
    assert before == (1000, 850, 0) and after == (1200, 930, 40)
    row = host_probe.sample(before, after, 0.00125)
    assert row["work_us"] == 1250.0 and row["busy"] == 0.6 and row["steal"] == 0.2  # 120 of 200 busy, 40 stolen
    assert host_probe.cpu_times(tmp_path / "absent") is None and host_probe.sample(None, after, 0.001)["busy"] is None


def _defaults(t_pair: float, t_steady: float) -> dict:
    part = {"a": {"sent": 1.0, "end": 3.0}, "b": {"sent": 0.0, "end": 4.0}, "client_gc": {"collections": 2}}
    return {"rows": {"proxy": {
        "pair": {"raw": [{"run": 1, "t0_unix": t_pair, **part}, {"run": 2, "t0_unix": t_pair + 10, **part}]},
        "steady": {"mixed": {"t0_unix": t_steady}, "shape": {"duration": 20.0}},
        "short": {"per_prompt": []},  # a part with no times of its own: not judged
    }}}


def test_each_part_is_judged_by_the_spikes_within_it(tmp_path, capsys):
    # a steady host during the pair (100..114 s), spikes of 4x during steady load (200..220 s)
    rows = [{"unix": 100 + i * 0.2, "work_us": 1000 + (i % 3)} for i in range(70)]
    rows += [{"unix": 200 + i * 0.2, "work_us": 4000 if i % 10 == 0 else 1100} for i in range(100)]
    probe, defaults = tmp_path / "p.jsonl", tmp_path / "defaults.json"
    probe.write_text("".join(json.dumps(r) + "\n" for r in rows))
    defaults.write_text(json.dumps(_defaults(100.0, 200.0)))
    assert host_probe.part_windows(_defaults(100.0, 200.0)) == [("proxy", "pair", 100.0, 114.0),
                                                                ("proxy", "steady", 200.0, 220.0)]
    assert host_probe.main(["--parts", str(probe), str(defaults)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("host proxy pair: quiet ") and out[1].startswith("host proxy steady: NOISY ")
    pair, steady = (json.loads(line.split(" ", 4)[4].split(") ", 1)[-1]) for line in out)
    assert pair["samples"] == 70 and pair["spike_share"] == 0 and pair["quiet"]
    assert steady["samples"] == 100 and steady["spike_share"] == 0.1 and not steady["quiet"]
    # the run's median is 1,100 us (90 of its 170 samples): the pair's host was a little faster
    assert steady["max_x_median"] == round(4000 / 1100, 2) and steady["median_x_run"] == 1.0
    assert pair["median_x_run"] == round(1001 / 1100, 2) and pair["p99_x_median"] == round(1002 / 1001, 2)


def test_one_spike_in_a_few_hundred_samples_is_still_quiet():
    rows = [{"unix": float(i), "work_us": 5000 if i == 7 else 1000} for i in range(300)]
    q = host_probe.quiet(rows, 0, 299, 1000)
    assert q["quiet"] and q["spike_share"] == round(1 / 300, 4)
    rows[8]["work_us"] = 5000  # two in 300: over QUIET_SPIKES
    assert not host_probe.quiet(rows, 0, 299, 1000)["quiet"]
    assert host_probe.quiet(rows, 1000, 2000, 1000) == {"samples": 0}


def test_parts_needs_both_files(tmp_path, capsys):
    with __import__("pytest").raises(SystemExit):
        host_probe.main(["--parts", str(tmp_path / "p.jsonl")])
    (tmp_path / "d.json").write_text("{}")
    assert host_probe.main(["--parts", str(tmp_path / "p.jsonl"), str(tmp_path / "d.json")]) == 2
