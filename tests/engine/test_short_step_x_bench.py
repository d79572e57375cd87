"""bench/short_step_x.py's parts: the H200 step law it charges, and the client's view of tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("short_step_x", ROOT / "bench/short_step_x.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_law_charges_a_step_its_graph_sizes_median(bench, tmp_path):
    law_file = tmp_path / "steps.json"
    law_file.write_text(json.dumps({"rows": [{"graph_size": 160, "median_ms": 28.0},
                                             {"graph_size": 256, "median_ms": 38.0},
                                             {"graph_size": 320, "median_ms": 47.0}]}))
    law = bench.StepLaw(law_file, decode_ms=15.0)
    assert law.seconds(4, 0, 4) == pytest.approx(0.015)  # decodes only
    assert law.seconds(150, 146, 4) == pytest.approx(0.028)  # padded to 160
    assert law.seconds(250, 246, 4) == pytest.approx(0.038)  # padded to 256
    per_token = (0.038 - 0.015) / 256
    assert law.seconds(400, 396, 4) == pytest.approx(0.047 + per_token * 128)  # 448: from 320 up
    assert law.seconds(1568, 1568, 0) == pytest.approx(0.015 + per_token * 1568)  # no decodes: no graph
    assert law.seconds(1000, 996, 4) == pytest.approx(0.015 + per_token * 996)  # past the graphs
    assert law.seconds(3, 2, 1) == pytest.approx(0.015 + per_token * 2)  # below every size measured


def test_the_driver_sees_every_token_once_at_its_steps_end(bench, tmp_path, tiny_model):
    law_file = tmp_path / "steps.json"
    law_file.write_text(json.dumps({"rows": [{"graph_size": s, "median_ms": 15 + 0.09 * s}
                                             for s in (8, 16, 32, 64, 128, 160, 192, 224, 256, 320)]}))
    before = dict(os.environ)
    engine = bench.fresh_engine({}, bench.StepLaw(law_file), tiny_model)
    assert dict(os.environ) == before  # the stack's settings reach this scheduler, not the process
    d = bench.Driver(engine, random.Random(0))
    done = []
    stream = d.send(40, 50, "s", 0.0, done.append)
    d.at(0.3, lambda: d.send(3000, 1, "p", 0.3))
    d.run(done=lambda: bool(done))
    engine.drain()
    tokens = d.traces[stream].tokens
    assert done == [stream] and len(tokens) == 50  # its first token and 49 decodes, each once
    assert tokens == sorted(tokens) and d.traces[stream].end == tokens[-1]
    prompt = next(t for rid, t in d.traces.items() if rid.startswith("p"))
    assert prompt.sent == 0.3 and len(prompt.tokens) == 1 and prompt.ttft > 0.3  # paced: several steps
    gaps = [b - a for a, b in zip(tokens, tokens[1:])]
    assert max(gaps) <= 0.044 * 1.1  # the stream's steps held near the 44 ms target


def _trace(path: Path, steps: list[tuple[int, int, float]]) -> Path:
    """A step trace as pacing writes it: (decode rows, prefill tokens, the interval after the call)."""
    t, lines = 0.0, []
    for i, (decodes, prefill, interval) in enumerate(steps):
        lines.append(json.dumps({"step": i, "t": t, "decode_rows": decodes, "chunks": [["r", prefill]] if prefill else [],
                                 "graph_size": (256 if prefill else 4) if decodes else None}))
        t += interval
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_noise_is_each_steps_time_over_its_kinds_median(bench, tmp_path):
    decodes = [(4, 0, 0.020)] * 5 + [(4, 0, 0.030)] + [(4, 0, 0.020)] * 4  # one decode step 1.5x
    prefill_only = [(0, 1568, 0.150)]  # its neighbours' intervals are not a decode step's time
    mixed = [(4, 252, 0.040)] * 4 + [(4, 252, 0.048)] + [(4, 252, 0.040)] * 5  # one mixed step 1.2x
    noise = bench.StepNoise(_trace(tmp_path / "t.jsonl", decodes + prefill_only + mixed))
    assert max(noise.ratios[False]) == pytest.approx(1.5) and min(noise.ratios[False]) == pytest.approx(1.0)
    assert max(noise.ratios[True]) == pytest.approx(1.2) and min(noise.ratios[True]) == pytest.approx(1.0)
    # the 1.5x decode step seen once, the 150 ms around the prefill-only step never
    assert sorted(noise.ratios[False]).count(pytest.approx(1.5)) == 1
    # the 10 decode steps but the two whose next two calls include the prefill-only one; the mixed
    # steps but the last two (the trace ends: no call after them)
    assert len(noise.ratios[False]) == 8 and len(noise.ratios[True]) == 8
    draw = noise.drawn_with(random.Random(0))
    draws = [draw(True) for _ in range(200)]
    assert set(round(r, 6) for r in draws) == {1.0, 1.2}


def test_a_noisy_engine_charges_the_law_times_the_draw(bench, tmp_path, tiny_model):
    law_file = tmp_path / "steps.json"
    law_file.write_text(json.dumps({"rows": [{"graph_size": 256, "median_ms": 38.0}]}))
    law = bench.StepLaw(law_file, decode_ms=15.0)
    noise = bench.StepNoise(_trace(tmp_path / "t.jsonl", [(4, 0, 0.02)] * 8 + [(4, 252, 0.04)] * 8))
    ttft = {}
    for ratio in (1.0, 2.0):
        noise.ratios = {True: [ratio], False: [1.0]}
        d = bench.Driver(bench.fresh_engine({}, law, tiny_model, noise.drawn_with(random.Random(0))), random.Random(0))
        rid = d.send(3000, 1, "p", 0.0)
        d.run(done=lambda: rid in d.engine.finished)
        ttft[ratio] = d.traces[rid].ttft
    assert ttft[2.0] == pytest.approx(2 * ttft[1.0])
