"""bench/gpu/sub_block_compare.py leaves the paced server as it found it: the control file it
rewrites per mode ends empty whatever happens, and an empty control file gives the scheduler
its own environment's settings back (the file is layered over it). So the check can run on the
server `CLASS=hybrid bench/gpu/defaults_h200.sh` started for the stack's row, on a card that
holds one 27B server at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import sub_block_compare  # noqa: E402

from prefill_gate.engine_patches.config import PacingConfig, read_control_file  # noqa: E402

SERVER_ENV = {"PREFILL_GATE_PACING": "adaptive", "PREFILL_GATE_PACING_TARGET_ITL_MS": "44",
              "PREFILL_GATE_PACING_SUB_BLOCK": "1"}


@pytest.mark.parametrize("fails", [False, True])
def test_the_control_file_ends_empty_and_gives_the_server_its_own_settings(tmp_path, monkeypatch, fails):
    control = tmp_path / "control.env"
    seen = []

    async def scenario(url, mode, a_text, c_text, block):
        seen.append(read_control_file(str(control), SERVER_ENV))  # what the scheduler reads in this mode
        if fails:
            raise RuntimeError("the server went away")
        return {"a_seconds": 1.0, "b_gaps_during_a_ms": {"p50": 1, "max": 2}, "a": {"token_ids": [1]},
                "c": {"token_ids": [2], "cached_tokens": 3136}}

    monkeypatch.setattr(sub_block_compare, "scenario", scenario)
    monkeypatch.setattr(sub_block_compare.time, "sleep", lambda s: None)
    monkeypatch.setattr(sys, "argv", ["sub_block_compare.py", "http://x", "--control", str(control),
                                      "--json", str(tmp_path / "out.json")])
    if fails:
        with pytest.raises(RuntimeError):
            sub_block_compare.main()
    else:
        assert sub_block_compare.main() == 0
    assert [c.mode for c in seen] == ["cap"] * len(seen) and seen[0].cap_tokens == 1568
    assert read_control_file(str(control), SERVER_ENV) == PacingConfig.from_env(SERVER_ENV)
    assert PacingConfig.from_env(SERVER_ENV).mode == "adaptive"


def answer(ids, logprobs, top=None):
    return {"token_ids": ids, "logprobs": logprobs, "top_logprobs": top}


def test_logprobs_are_compared_where_the_answers_agree_and_the_control_sets_the_scale():
    whole = answer([85, 85, 85], [-0.50, -0.40, -0.30], [{"x": -0.50, "y": -2.0}, {"x": -0.40}, {"x": -0.30}])
    rounding = answer([85, 85, 85], [-0.51, -0.40, -0.30], [{"x": -0.51, "y": -2.02}, {"x": -0.40}, {"x": -0.30}])
    assert sub_block_compare.logprob_diff(whole, rounding) == pytest.approx(0.02)  # a top-5 entry's
    parted = answer([85, 70, 70], [-0.50, -9.0, -9.0])
    assert sub_block_compare.logprob_diff(whole, parted) == pytest.approx(0.0)  # only before they part
    wrong_state = answer([85, 85, 85], [-1.7, -1.6, -1.5])  # the same greedy tokens, other logprobs
    assert sub_block_compare.logprob_diff(whole, wrong_state) == pytest.approx(1.2)
    assert sub_block_compare.logprob_diff(whole, answer([85], None)) is None


def test_the_verdict_says_whether_the_modes_agree_within_a_share_of_the_control(tmp_path, monkeypatch):
    control = tmp_path / "control.env"
    moved = {"whole": 0.0, "sub": 0.01}

    async def scenario(url, mode, a_text, c_text, block):
        shift = moved[mode]
        run = {"a_seconds": 1.0, "b_gaps_during_a_ms": {"p50": 1, "max": 2}, "a": answer([85] * 3, [-0.5 - shift] * 3),
               "c": {**answer([70] * 3, [-0.7 - shift] * 3), "cached_tokens": 3136}}
        if mode == "whole":
            run["c_other"] = answer([70] * 3, [-1.7] * 3)  # another state before the same tail: 1.0 away
        return run

    monkeypatch.setattr(sub_block_compare, "scenario", scenario)
    monkeypatch.setattr(sub_block_compare.time, "sleep", lambda s: None)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["sub_block_compare.py", "http://x", "--control", str(control),
                                      "--json", str(out)])
    assert sub_block_compare.main() == 0
    verdict = json.loads(out.read_text())
    assert verdict["c_logprob_diff"] == pytest.approx(0.01) and verdict["control_logprob_diff"] == pytest.approx(1.0)
    assert verdict["states_agree"] is True
    moved["sub"] = 0.5  # as far as half the control: a state read wrong
    assert sub_block_compare.main() == 0
    assert json.loads(out.read_text())["states_agree"] is False
