"""bench/sim_slice_steps.py: slices' engine steps from the proxy's log against a preset's step model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from prefill_gate.proxy.sim.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sim_slice_steps", ROOT / "bench/sim_slice_steps.py")
sim_slice_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim_slice_steps)


def _line(req: int, sizes: list[int], gaps: list[float | None]) -> str:
    shown = ", ".join("None" if g is None else f"{g * 1e3:.3f}" for g in gaps)
    return (f"2026-12-05 04:51:11,783 INFO prefill_gate: sliced request #{req} on http://127.0.0.1:8001: "
            f"{len(sizes)} slices, {sum(sizes)} tokens in 0.946 s; slice tokens [{', '.join(map(str, sizes))}]; "
            f"largest gaps ms [{shown}]; cost model a=8.41 ms b=11.2 us c=0.6 ns margin=3.1 ms")


def test_an_engine_whose_attention_costs_half_the_presets_is_found_so(tmp_path, capsys):
    """Steps made with the preset's fixed part and per-token term and half its attention term:
    the fit gives those terms back, and observed / predicted falls with the context."""
    cost = PRESETS["h200-qwen3-8b"].cost
    decodes = [1000] * 3
    fixed = cost.step_seconds(decodes, [(0, 0)])
    lines = []
    for req, sizes in enumerate([[2560, 3840, 1488, 1440, 1456, 1360], [512, 2048, 1024, 1792, 1600, 64]], 1):
        gaps, prefix = [], 0
        for n in sizes:
            gaps.append(fixed + cost.per_prefill_token * n + cost.attention / 2 * n * (prefix + n / 2))
            prefix += n
        gaps[2] = None  # a slice whose gap no stream showed
        lines.append(_line(req, sizes, gaps))
    log = tmp_path / "proxy-proxy.log"
    log.write_text("\n".join(["INFO prefill_gate: large prefill #4 (20000 tokens): slice"] + lines) + "\n")
    out = tmp_path / "r.json"
    assert sim_slice_steps.main([str(log), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["slices"] == 9  # 12 slices, 2 unseen gaps, one under 256 tokens
    assert r["fitted_terms"]["per_prefill_token_s"] == pytest.approx(cost.per_prefill_token, rel=1e-3)
    assert r["fitted_terms"]["attention_s"] == pytest.approx(cost.attention / 2, rel=1e-3)
    assert r["obs_over_pred_p50"] < 1 and r["by_context"][0]["obs/pred p50"] > r["by_context"][-1]["obs/pred p50"]
    assert r["git_commit"] and "fitted to the slices" in capsys.readouterr().out
    assert sim_slice_steps.main([str(tmp_path / "r.json")]) == 2  # no sliced prompt in it
