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
