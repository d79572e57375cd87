"""bench/gpu/gpu_probe.py: the GPU's clocks, power and clock event reasons sampled beside a run
(NVML itself only on the device; here a source with NVML's answers stands in for it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench/gpu/gpu_probe.py"
spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
gpu_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_probe)


class Card:
    """NVML's answers, one sample at a time."""

    def __init__(self, samples):
        self.samples = iter(samples)

    def sample(self):
        return next(self.samples)


def sample(unix, sm=1980, power=300.0, temp=50, util=90, reasons=0):
    return {"unix": unix, "sm_mhz": sm, "mem_mhz": 2619, "power_w": power, "temp_c": temp, "util": util,
            "reasons": reasons}


def test_it_writes_one_whole_line_a_sample_for_the_time_asked(tmp_path):
    out = tmp_path / "gpu.jsonl"
    card = Card(sample(100 + i) for i in range(1000))
    n = gpu_probe.record(out, every=0.01, seconds=0.2, source=card)
    rows = gpu_probe.read(out)
    assert 3 <= n == len(rows) and out.read_text().endswith("\n")
    assert [r["unix"] for r in rows] == [100 + i for i in range(n)]


def test_a_machine_without_nvml_records_nothing_and_says_so(tmp_path):
    out = tmp_path / "gpu.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--seconds", "0.2"], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode == 0 and out.exists() and out.read_text():
        return  # a machine with a GPU: it sampled
    assert proc.returncode == 0 and "no NVML here" in proc.stderr and not (out.exists() and out.read_text())


def test_the_summary_names_what_held_the_clocks_and_leaves_idle_out():
    rows = [sample(0, sm=1980), sample(1, sm=1410, power=700.0, reasons=0x4),
            sample(2, sm=1200, temp=88, reasons=0x20 | 0x4), sample(3, sm=345, util=0, reasons=gpu_probe.IDLE)]
    s = gpu_probe.summarize(rows)
    assert s["samples"] == 4 and s["busy_samples"] == 3
    assert (s["sm_mhz_min"], s["sm_mhz_p50"], s["sm_mhz_max"]) == (1200, 1410, 1980)  # busy samples only
    assert s["temp_c_max"] == 88 and s["power_w_max"] == 700.0
    assert s["held_by"] == {"sw_power_cap": 0.5, "sw_thermal": 0.25}
    assert gpu_probe.reason_names(0x1 | 0x8 | 0x10000) == ["gpu_idle", "hw_slowdown", "0x10000"]


def test_each_pair_runs_long_prompt_gets_the_samples_of_its_own_window(tmp_path, capsys):
    defaults = {"rows": {"proxy": {"pair": {"raw": [
        {"run": 1, "t0_unix": 1000.0, "a": {"sent": 5.0, "tokens": [8.0, 8.1]}},
        {"run": 2, "t0_unix": 1020.0, "a": {"sent": 5.0, "tokens": [7.0]}},
        {"run": 3, "a": {"sent": 5.0, "tokens": [7.0]}},  # no wall clock: skipped
    ]}}, "direct": {"steady": {}}}}
    rows = [sample(1004.9, sm=1980), sample(1005.5, sm=1200, reasons=0x20), sample(1007.9, sm=1300, reasons=0x20),
            sample(1025.5, sm=1980), sample(1026.5, sm=1975)]
    assert gpu_probe.pair_windows(defaults) == [("proxy", 1, 1005.0, 1008.0), ("proxy", 2, 1025.0, 1027.0)]
    probe, path = tmp_path / "gpu.jsonl", tmp_path / "defaults.json"
    probe.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"unix": 10')  # a line cut by the kill
    path.write_text(json.dumps(defaults))
    assert gpu_probe.main([str(probe), str(path), "--pairs"]) == 0
    out = capsys.readouterr().out.splitlines()
    first, second = (json.loads(line.split(": ", 1)[1]) for line in out)
    assert out[0].startswith("proxy pair run 1 (3.00 s)") and first["sm_mhz_min"] == 1200
    assert first["held_by"] == {"sw_thermal": 1.0} and second["sm_mhz_min"] == 1975 and second["held_by"] == {}
    packed = tmp_path / "gpu.jsonl.gz"  # as run folders keep them
    import gzip
    packed.write_bytes(gzip.compress(probe.read_bytes()))
    assert gpu_probe.read(packed) == gpu_probe.read(probe) and len(gpu_probe.read(packed)) == len(rows)
