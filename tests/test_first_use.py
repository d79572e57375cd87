"""bench/gpu/first_use.py on the CPU: its plumbing (a child per loading mode, every count timed
after the largest, the spikes named), which on the device answers whether a server's first step
at a new request count pays a lazily loaded kernel."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("first_use", ROOT / "bench/gpu/first_use.py")
first_use = importlib.util.module_from_spec(spec)
spec.loader.exec_module(first_use)


def test_a_spike_is_a_first_call_well_over_its_repeat():
    rows = [{"reqs": 8, "first_ms": 0.4, "again_ms": 0.3}, {"reqs": 9, "first_ms": 66.0, "again_ms": 0.3},
            {"reqs": 10, "first_ms": 5.2, "again_ms": 0.3}]
    assert first_use.spikes(rows, 5.0) == [9]
    assert first_use.spikes(rows, 4.0) == [9, 10]


def test_each_mode_times_every_count_in_a_child_and_the_result_says_which_spiked(tmp_path):
    out = tmp_path / "first-use.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu/first_use.py"), "--device", "cpu", "--max-reqs", "5",
                           "--hidden", "16", "--vocab", "8,12", "--fill", "0.9", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LAZY" in done.stdout and "EAGER" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"LAZY", "EAGER"} and result["git_commit"] and result["fill"] == 0.9
    for per_vocab in result["modes"].values():
        assert set(per_vocab) == {"8", "12"}
        for res in per_vocab.values():
            assert [r["reqs"] for r in res["rows"]] == [1, 2, 3, 4, 5]
            assert all(set(r["first_by_op_ms"]) == {"gather", "output_layer", "to_float32", "argmax",
                                                                 "copy_out"} for r in res["rows"])
            assert res["spikes"] == first_use.spikes(res["rows"], 5.0)


def test_an_unknown_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        first_use.main(["--modes", "LAZY,SOMETIMES", "--device", "cpu"])
    assert refused.value.code == 2 and "SOMETIMES" in capsys.readouterr().err


@pytest.mark.parametrize("fill", ["-0.1", "0.99", "2"])
def test_a_fill_past_the_card_is_refused(fill, capsys):
    with pytest.raises(SystemExit) as refused:
        first_use.main(["--fill", fill, "--device", "cpu"])
    assert refused.value.code == 2 and "--fill" in capsys.readouterr().err


def test_nothing_is_held_off_the_gpu_or_at_no_fill():
    import torch

    assert first_use.hold(torch.device("cpu"), 0.9) is None and first_use.hold(torch.device("cuda"), 0.0) is None
