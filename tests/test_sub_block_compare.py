"""bench/gpu/sub_block_compare.py leaves the paced server as it found it: the control file it
rewrites per mode ends empty whatever happens, and an empty control file gives the scheduler
its own environment's settings back (the file is layered over it). So the check can run on the
server `CLASS=hybrid bench/gpu/defaults_h200.sh` started for the stack's row, on a card that
holds one 27B server at a time."""

from __future__ import annotations

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

    async def scenario(url, mode, a_text, c_text):
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
