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
