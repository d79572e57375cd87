"""bench short: what one new short prompt costs the live streams."""

from __future__ import annotations

import json

import pytest

from prefill_gate.proxy.bench.overlap import Trace
from prefill_gate.proxy.bench.services import Service
from prefill_gate.proxy.bench.short import ShortShape, arrivals, costs, run_short, summarize


def trace(sent: float, tokens: list[float]) -> Trace:
    return Trace(sent=sent, tokens=tokens, end=tokens[-1] if tokens else sent)


def test_a_prompts_cost_is_the_longest_stream_gap_overlapping_its_flight():
    streams = [trace(0.0, [0.0, 0.01, 0.02, 0.12, 0.13, 0.14]),  # one 100 ms gap at 0.02-0.12
               trace(0.0, [0.005, 0.015, 0.025, 0.09, 0.15])]     # 65 and 60 ms gaps
    prompts = [trace(0.03, [0.11]),  # in flight 0.03-0.11: both long gaps overlap it
               trace(0.5, [0.6])]    # no gap overlaps it: no cost recorded
    cost, quiet = costs(streams, prompts)
    assert cost == pytest.approx([0.10])
    assert sorted(quiet) == pytest.approx([0.01, 0.01, 0.01, 0.01, 0.01, 0.01])
    s = summarize(streams, prompts)
    assert s["cost_ms_max"] == pytest.approx(100.0)
    assert s["step_ms_p50"] == pytest.approx(10.0)
    assert s["cost_x_step_p50"] == pytest.approx(10.0)
    assert s["answered"] == 2 and s["ttft_ms_max"] == pytest.approx(100.0)


def test_arrivals_are_poisson_from_the_seed_and_never_a_fixed_beat():
    shape = ShortShape(every_s=1.0, duration_s=200.0, min_tokens=200, max_tokens=400)
    a, b = arrivals(shape, 1), arrivals(shape, 1)
    assert a == b and a != arrivals(shape, 2)
    times = [t for t, _ in a]
    gaps = [y - x for x, y in zip(times, times[1:])]
    assert 150 < len(a) < 250  # ~200 at one a second
    assert min(gaps) < 0.1 and max(gaps) > 2.5  # exponential, not lockstep
    assert all(200 <= n <= 400 for _, n in a)


@pytest.mark.parametrize("bad", [ShortShape(streams=0), ShortShape(min_tokens=500, max_tokens=400),
                                 ShortShape(every_s=0)])
def test_shapes_that_measure_nothing_are_refused(bad):
    with pytest.raises(ValueError):
        bad.validate()


@pytest.mark.slow
async def test_on_the_hybrid_simulator_a_short_prompt_costs_streams_a_whole_prefill_step():
    """The simulator's hybrid preset: a decode step ~15 ms, a step with a 200-400-token
    prefill several times that (the issue's hard case); the probe must see it."""
    with Service("sim", "--preset", "h200-27b-hybrid", "--max-num-batched-tokens", "2048", name="hybrid") as sim:
        result = await run_short(sim.url, None, ShortShape(streams=3, duration_s=8.0, warmup_s=2.0, every_s=1.0),
                                 seed=3, progress=False)
    json.dumps(result)
    assert result["answered"] == result["prompts"] > 2 and not result["errors"]
    assert 10 < result["step_ms_p50"] < 25
    assert result["cost_x_step_p50"] > 3
