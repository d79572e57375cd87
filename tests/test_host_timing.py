"""bench/gpu/host_timing.py: the GDN benches' shared loop (host time a call, bits, GPU time)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
from host_timing import time_ways  # noqa: E402


def test_each_way_on_its_own_state_copy_timed_in_rounds():
    state0 = torch.zeros(3)
    seen = {"add": 0, "mul": 0}

    def add(state):
        seen["add"] += 1
        state += 1
        return state * 10

    def mul(state):
        seen["mul"] += 1
        state.mul_(2)
        return state + 5

    synced = []
    host, bits, gpu = time_ways({"add": add, "mul": mul}, state0, calls=4, repeats=2,
                                sync=lambda: synced.append(1), cuda=False)
    assert list(host) == ["add", "mul"] and all(len(v) == 2 and min(v) > 0 for v in host.values())
    assert seen == {"add": 3 + 2 * 4 + 1, "mul": 3 + 2 * 4 + 1}  # warm-up, rounds, the bits' call
    assert torch.equal(bits["add"][0], torch.full((3,), 10.0)) and torch.equal(bits["add"][1], torch.ones(3))
    assert torch.equal(bits["mul"][0], torch.full((3,), 5.0)) and torch.equal(bits["mul"][1], torch.zeros(3))
    assert torch.equal(state0, torch.zeros(3))  # never touched: each loop its own copy
    assert gpu == {"add": None, "mul": None} and len(synced) == 1 + 2 * 2 * 2 + 2
