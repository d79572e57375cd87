"""Step pacing on the real vLLM 0.26 Scheduler and AsyncScheduler."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import statistics
from typing import NamedTuple

import pytest
from vllm.config.compilation import CUDAGraphMode

from prefill_gate.engine_patches import pacing
from prefill_gate.engine_patches.cost_model import StepCostModel
from prefill_gate.engine_patches.pacing import (
    PacedAsyncScheduler,
    PacedScheduler,
    Pacer,
    _mixed_step_graph_sizes,
)
from tests.engine.harness import DEFAULT_GRAPH_SIZES, Engine, build, vllm_config

CLASSES = [
    pytest.param(PacedScheduler, 1, id="sync"),
    pytest.param(PacedAsyncScheduler, 2, id="async"),
]


def make(cls, depth, tiny_model, **kw):
    scheduler = build(cls, tiny_model, async_scheduling=depth == 2, **kw)
    return scheduler


def about_to_finish(scheduler, rid) -> bool:
    """vLLM skips an async decode whose placeholders already reach max_tokens."""
    r = scheduler.requests.get(rid)
    return r is None or (
        r.num_output_placeholders > 0
        and r.num_computed_tokens + 2 - r.num_output_placeholders
        >= r.num_prompt_tokens + r.max_tokens
    )


def assert_paced(engine: Engine, cap: int, spec: int = 0) -> None:
    """No step that decodes schedules more prefill than the cap; none skips a decode. (A
    step whose only decoding requests have their last token in flight, under async
    scheduling, decodes nothing: no token waits for it, and it is not paced.)"""
    for i, step in enumerate(engine.steps):
        if not step.decoding:
            continue
        for rid in step.decoding:
            if rid in step.decode_tokens:
                assert step.decode_tokens[rid] <= 1 + spec
            else:
                assert about_to_finish(engine.scheduler, rid), f"step {i}: decode {rid} skipped"
        if step.decode_tokens:
            assert step.prefill_tokens <= cap, f"step {i}: {step.prefill_tokens} prefill > {cap}"


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("cap", [128, 512])
def test_cap_mixed_workload(cls, depth, cap, tiny_model, pacing_env):
    pacing_env("cap", cap_tokens=cap)
    engine = Engine(make(cls, depth, tiny_model), depth=depth)
    streams = [engine.add(40, 300, f"B{i}") for i in range(3)]
    engine.run(lambda: all(s in engine.first_token for s in streams))
    start = len(engine.steps)
    longs = [engine.add(28_600, 58, "A"), engine.add(9_000, 20, "C")]
    engine.step()
    shorts = [engine.add(120, 30, f"S{i}") for i in range(4)]
    engine.run(lambda: all(r in engine.finished for r in longs + shorts))
    engine.drain()

    assert_paced(engine, cap)
    # The prompts still progress at the cap: all prefill work done within the bound.
    prefill_work = 28_600 + 9_000 + 4 * 120
    last_first_token = max(engine.first_token[r] for r in longs + shorts)
    assert last_first_token - start <= math.ceil(prefill_work / cap) + 3
    # Every step while they were pending used the cap (no step wasted).
    busy = engine.steps[start + 1 : last_first_token]
    assert sum(s.prefill_tokens == cap for s in busy) >= len(busy) - 3


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("align", [1, 0])
def test_mixed_steps_fill_a_cuda_graph_size(cls, depth, align, tiny_model, pacing_env):
    """256 prefill + 1 decode would be padded to a 272-token graph: aligned, the step is
    255 + 1 = 256 (what `--max-num-batched-tokens 256` runs); with GRAPH_ALIGN=0, 257."""
    pacing_env("cap", cap_tokens=256, graph_align=align)
    scheduler = make(cls, depth, tiny_model, graph_sizes=DEFAULT_GRAPH_SIZES)
    engine = Engine(scheduler, depth=depth)
    stream = engine.add(40, 400, "B")
    engine.run(lambda: stream in engine.first_token)
    start = len(engine.steps)
    prompt = engine.add(9_000, 4, "A")
    engine.run(lambda: prompt in engine.first_token)
    mixed = [s for s in engine.steps[start:] if s.decoding and s.prefill_tokens]
    assert len(mixed) > 30
    totals = {s.output.total_num_scheduled_tokens for s in mixed[:-1]}  # the last chunk is a remainder
    assert totals == ({256} if align else {257})
    assert_paced(engine, 255 if align else 256)


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_decodes_first_when_prefills_sit_earlier_in_running(cls, depth, tiny_model, pacing_env):
    # Two long prompts and a stream admitted in one step (the user's own threshold of
    # 1000 lets all three in): the prompts sit ahead of the stream in `running`. With a
    # budget of decode tokens + cap, taken in that order, A1 would take the cap, A2 the
    # stream's token, and the stream would stall.
    pacing_env("cap", cap_tokens=256)
    scheduler = make(cls, depth, tiny_model, max_num_batched_tokens=2048,
                     long_prefill_token_threshold=1000)
    engine = Engine(scheduler, depth=depth)
    for name, prompt, out in (("A1", 40_000, 10), ("A2", 40_000, 10), ("B", 40, 150)):
        engine.add(prompt, out, name)
    engine.step()
    assert [r.request_id for r in scheduler.running] == ["A1", "A2", "B"]
    engine.run(lambda: "B" in engine.finished)
    engine.drain()
    assert_paced(engine, 256)
    streamed = [s for s in engine.steps if "B" in s.decode_tokens]
    assert len(streamed) == 150 - 1  # the first token came with its prompt; one per step
    # The prompts still got the whole cap (A1 first, by arrival), never more.
    assert all(s.prefill_tokens == 256 for s in streamed[:-2])


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_cadence_pattern_is_exact(cls, depth, interval, tiny_model, pacing_env):
    pacing_env("cadence", interval=interval)
    engine = Engine(make(cls, depth, tiny_model, max_num_batched_tokens=2048), depth=depth)
    engine.add(40, 400, "B")
    engine.run(lambda: "B" in engine.first_token)
    start = len(engine.steps)
    engine.add(20_000, 10, "A")
    engine.run(lambda: "A" in engine.first_token)
    engine.drain()
    pattern = [s.prefill_tokens > 0 for s in engine.steps[start : engine.first_token["A"] + 1]]
    expected = ([False] * interval + [True]) * (len(pattern) // (interval + 1) + 1)
    # The last step may be A's final (partial) chunk; the rhythm is exact up to it.
    assert pattern == expected[: len(pattern)]
    assert all("B" in s.decode_tokens for s in engine.steps[start:] if "B" in s.decoding
               and not about_to_finish(engine.scheduler, "B"))
    assert sum(pattern) == math.ceil(20_000 / 2048 - 1e-9)


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_align_mode_caps_are_whole_blocks(cls, depth, tiny_model, pacing_env):
    # Hybrid model, prefix-caching align mode, 1568-token KV pages: a 512-token cap
    # would leave every chunk short of a block boundary (0 tokens, no progress).
    pacing_env("cap", cap_tokens=512)
    scheduler = make(cls, depth, tiny_model, block_size=1568, hybrid_align=True,
                     num_blocks=400)
    assert scheduler.need_mamba_block_aligned_split
    engine = Engine(scheduler, depth=depth)
    engine.add(40, 120, "B")
    engine.run(lambda: "B" in engine.first_token)
    start = len(engine.steps)
    engine.add(28_600, 10, "A")
    engine.run(lambda: "A" in engine.first_token, max_steps=200)
    engine.drain()
    chunks = []
    for s in engine.steps[start:]:
        chunks.append(s.output.num_scheduled_tokens.get("A", 0))
        if s.chunk_end.get("A") == 28_600:
            break
    assert all(c > 0 for c in chunks), chunks  # never a 0-token chunk while A is pending
    assert all(c % 1568 == 0 for c in chunks[:-1])
    assert max(chunks) <= 1568
    assert_paced(engine, 1568)


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("k", [1, 3])
def test_spec_decode_counts_1_plus_k(cls, depth, k, tiny_model, pacing_env):
    pacing_env("cap", cap_tokens=256)
    scheduler = make(cls, depth, tiny_model, num_spec_tokens=k)
    engine = Engine(scheduler, depth=depth, spec_tokens=k)
    engine.add(40, 300, "B1")
    engine.add(40, 300, "B2")
    engine.run(lambda: "B1" in engine.first_token)
    start = len(engine.steps)
    engine.add(10_000, 10, "A")
    engine.run(lambda: "A" in engine.first_token)
    engine.drain()
    assert_paced(engine, 256, spec=k)
    window = engine.steps[start + 3 : engine.first_token["A"]]
    # Drafts arrive for both streams; they get 1 + k tokens and the prefill keeps its cap.
    assert any(sum(s.decode_tokens.values()) == 2 * (1 + k) for s in window)
    assert all(s.prefill_tokens == 256 for s in window)


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_a_alone_is_not_paced(cls, depth, tiny_model, pacing_env):
    chunks = {}
    for mode in ("off", "cap"):
        pacing_env(mode, cap_tokens=256)
        engine = Engine(make(cls, depth, tiny_model), depth=depth)
        engine.add(28_600, 58, "A")
        engine.run(lambda e=engine: "A" in e.finished)
        engine.drain()
        chunks[mode] = [s.output.num_scheduled_tokens.get("A", 0) for s in engine.steps]
    assert chunks["cap"] == chunks["off"]
    assert chunks["cap"][:3] == [8192, 8192, 8192]


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_off_is_vllm_unchanged(cls, depth, tiny_model, pacing_env):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    stock = AsyncScheduler if depth == 2 else Scheduler
    traces = []
    for klass in (stock, cls):
        pacing_env("off")
        engine = Engine(make(klass, depth, tiny_model, max_num_batched_tokens=2048), depth=depth)
        engine.add(40, 100, "B")
        engine.run(lambda e=engine: "B" in e.first_token)
        engine.add(20_000, 20, "A")
        engine.add(300, 20, "S")
        engine.run(lambda e=engine: all(r in e.finished for r in ("A", "B", "S")))
        engine.drain()
        traces.append([dict(s.output.num_scheduled_tokens) for s in engine.steps])
    assert traces[0] == traces[1]


def h200_like_cost(seed: int = 0, bias: float = 1.0, jitter: float = 0.0):
    """A step-time law shaped like the H200 runs (4.9 ms decode step, ~10 ms at 128
    prefill tokens, ~20 ms at 512, growing with the chunk's context), times a bias the
    fitted model does not know about, with uniform jitter of +-`jitter`."""
    rng = random.Random(seed)

    def cost(step, scheduler) -> float:
        rows = len(step.decode_tokens)
        tokens = step.prefill_tokens
        attention = 0.0
        for rid, end in step.chunk_end.items():
            n = step.output.num_scheduled_tokens[rid]
            attention += n * (end - n + n / 2)
        mixed = 0.004 if tokens and rows else 0.0
        t = 0.0047 + 0.0002 * rows + mixed + 2.2e-5 * tokens + 1.2e-9 * attention
        return t * bias * (1 + rng.uniform(-jitter, jitter))

    return cost


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("target_ms", [15.0, 25.0, 40.0])
@pytest.mark.parametrize("bias,jitter", [(1.0, 0.0), (1.15, 0.20)])
def test_adaptive_holds_the_target(cls, depth, target_ms, bias, jitter, tiny_model, pacing_env):
    pacing_env("adaptive", target_itl_ms=target_ms, cap_tokens=64)
    engine = Engine(make(cls, depth, tiny_model), depth=depth,
                    cost=h200_like_cost(seed=int(target_ms), bias=bias, jitter=jitter))
    engine.add(40, 5000, "B")
    engine.run(lambda: "B" in engine.first_token)
    for turn in range(3):  # three long prompts in a row, as in the H200 sweep's runs
        engine.add(28_600, 10, f"A{turn}")
        engine.run(lambda t=turn: f"A{t}" in engine.first_token, max_steps=3000)
    engine.drain()
    mixed = [d for s, d in zip(engine.steps, engine.durations) if s.prefill_tokens and s.decoding]
    settled = sorted(mixed[len(mixed) // 3 :])  # after the first long prompt
    p99 = settled[int(0.99 * (len(settled) - 1))]
    median = settled[len(settled) // 2]
    target = target_ms / 1000
    assert abs(p99 / target - 1) <= 0.10, (p99, target)
    assert median >= target * 0.80, (median, target)  # it uses the room it has
    assert engine.scheduler.pacer.model.samples >= 30


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_trace_file_has_one_line_per_step(cls, depth, tiny_model, pacing_env, tmp_path):
    trace = tmp_path / "trace.jsonl"
    pacing_env("adaptive", target_itl_ms=15, cap_tokens=64, trace_file=trace)
    engine = Engine(make(cls, depth, tiny_model, graph_sizes=DEFAULT_GRAPH_SIZES), depth=depth,
                    cost=h200_like_cost())
    engine.add(40, 200, "B")
    engine.run(lambda: "B" in engine.first_token)
    engine.add(5000, 5, "A")
    engine.run(lambda: "A" in engine.finished and "B" in engine.finished)
    import time

    engine.drain()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    unix = [line["unix"] for line in lines]  # the wall clock, in order, within this test's minute
    assert unix == sorted(unix) and time.time() - 60 < unix[0] <= unix[-1] <= time.time()
    worked = [(s, d) for s, d in zip(engine.steps, engine.durations) if s.output.total_num_scheduled_tokens]
    assert len(lines) == len(worked)
    for line, (step, duration) in zip(lines, worked):
        # launched when the loop came back to the scheduler (at once here), done when its output came
        assert line["launched"] == line["t"] and line["done"] >= line["t"] + duration - 1e-6
        if depth == 1:  # the synchronous loop: the output comes when the step ends
            assert line["done"] == pytest.approx(line["t"] + duration, abs=2e-6)
        assert sum(n for _, n in line["chunks"]) == step.prefill_tokens
        assert line["decode_rows"] == len(step.decode_tokens)
        tokens = step.output.total_num_scheduled_tokens  # vLLM pads the step to the next size
        assert line["graph_size"] == next((size for size in DEFAULT_GRAPH_SIZES if size >= tokens), None)
        if step.decoding and step.prefill_tokens:
            assert line["cap"] >= step.prefill_tokens and line["predicted_s"] > 0
    assert [line["step"] for line in lines] == sorted({line["step"] for line in lines})
    mixed = [line for line in lines if line["decode_rows"] and line["chunks"]]
    assert mixed and mixed[-1]["cap"] != 64  # the fit took over from the starting cap



def test_a_trace_line_waits_for_its_step_and_shutdown_writes_the_rest(tiny_model, pacing_env, tmp_path):
    trace = tmp_path / "trace.jsonl"
    pacing_env("adaptive", target_itl_ms=15, cap_tokens=64, trace_file=trace)
    engine = Engine(make(PacedAsyncScheduler, 2, tiny_model), depth=2, cost=h200_like_cost())
    engine.add(40, 50, "B")
    engine.run(lambda: len(engine.steps) >= 10)
    in_flight = len(engine._in_flight)
    assert in_flight == 1  # the async loop's second step, not yet back
    lines = trace.read_text().splitlines()
    assert len(lines) == 10 - in_flight and all(json.loads(line)["done"] is not None for line in lines)
    engine.scheduler.shutdown()  # the engine stops with a step in flight: its line is written as it is
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 10 and lines[-1]["done"] is None and lines[-1]["launched"] is not None


@pytest.mark.parametrize("graphs, warned", [("FULL_AND_PIECEWISE", True), ("FULL", False)])
def test_adaptive_on_piecewise_mixed_steps_says_to_use_full_graphs(graphs, warned, tiny_model, pacing_env,
                                                                     caplog):
    pacing_env("adaptive", target_itl_ms=15)
    with caplog.at_level(logging.WARNING, logger="vllm.prefill_gate"):
        build(PacedScheduler, tiny_model, graph_sizes=DEFAULT_GRAPH_SIZES, graph_mode=graphs)
    assert ("cudagraph_mode" in caplog.text) == warned


@pytest.mark.parametrize("graphs", ["FULL_AND_PIECEWISE", "PIECEWISE"])
def test_adaptive_on_a_hybrid_says_what_it_is_without_asking_for_full_graphs(graphs, tiny_model, pacing_env,
                                                                              caplog):
    """On a model with Mamba or GDN layers vLLM turns FULL into FULL_AND_PIECEWISE (their
    builders graph uniform batches only), so the warning must not send the user there."""
    pacing_env("adaptive", target_itl_ms=44)
    with caplog.at_level(logging.WARNING, logger="vllm.prefill_gate"):
        build(PacedScheduler, tiny_model, graph_sizes=DEFAULT_GRAPH_SIZES, graph_mode=graphs, hybrid_align=True,
              block_size=64, enable_prefix_caching=True)
    assert "recurrent (Mamba or Gated DeltaNet) layers" in caplog.text and "cudagraph_mode\":" not in caplog.text
    assert "PREFILL_GATE_GDN_GRAPH=on" in caplog.text  # what does graph a GDN hybrid's mixed steps whole


@pytest.mark.parametrize(
    "mode, eager, expected",
    [("FULL_AND_PIECEWISE", False, (8, 16, 256)), ("FULL", False, (8, 16, 256)),
     ("PIECEWISE", False, (8, 16, 256)), ("FULL_DECODE_ONLY", False, ()),
     ("NONE", False, ()), ("FULL_AND_PIECEWISE", True, ())],
)
def test_alignment_follows_the_graphs_mixed_steps_replay(mode, eager, expected, tiny_model):
    """Mixed steps are padded only where vLLM replays a graph for them."""
    config = vllm_config(tiny_model)
    config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    config.compilation_config.cudagraph_capture_sizes = [256, 8, 16]
    config.model_config.enforce_eager = eager
    assert _mixed_step_graph_sizes(config) == expected


def seed_shape_cycle(engine: Engine, turns: int) -> list[list[float]]:
    """The H200 bench's cycle, `turns` times: B alone (a decode-only stretch), A alone
    (8192-token prefill-only steps), then B with A arriving at B's 64th token. Returns the
    durations of the mixed steps of each overlap."""
    overlaps = []
    for turn in range(turns):
        solo_b = engine.add(40, 512, f"Bsolo{turn}")
        engine.run(lambda r=solo_b: r in engine.finished)
        solo_a = engine.add(28_600, 10, f"Asolo{turn}")
        engine.run(lambda r=solo_a: r in engine.finished)
        b = engine.add(40, 400, f"B{turn}")
        engine.run(lambda r=b: r in engine.first_token)
        a_at = len(engine.steps) + 63  # B's 64th token
        engine.run(lambda n=a_at: len(engine.steps) >= n)
        first = len(engine.steps)
        a = engine.add(28_600, 10, f"A{turn}")
        engine.run(lambda r=a: r in engine.first_token, max_steps=3000)
        overlaps.append([d for s, d in zip(engine.steps[first:], engine.durations[first:])
                         if s.prefill_tokens and s.decoding])
        engine.run(lambda r=b: r in engine.finished)
        engine.drain()
    return overlaps


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("target_ms", [15.0, 20.0])
def test_adaptive_holds_the_target_in_every_overlap(cls, depth, target_ms, tiny_model, pacing_env):
    """Between long prompts a stream decodes alone for hundreds of steps and a prompt runs
    alone in 8192-token steps. Neither may cost the fit what it learned about small mixed
    steps (here 4 ms of piecewise-graph overhead that a prefill-only step does not pay):
    with one window for every step, each overlap began 16-24% over a 15 ms target."""
    pacing_env("adaptive", target_itl_ms=target_ms, cap_tokens=256)
    engine = Engine(make(cls, depth, tiny_model, graph_sizes=DEFAULT_GRAPH_SIZES), depth=depth,
                    cost=h200_like_cost(seed=int(target_ms), jitter=0.05))
    target = target_ms / 1000
    for turn, mixed in enumerate(seed_shape_cycle(engine, 3)):
        ranked = sorted(mixed)
        p99 = ranked[int(0.99 * (len(ranked) - 1))]
        assert p99 <= 1.10 * target, (turn, p99, target)
        assert ranked[len(ranked) // 2] >= 0.80 * target, (turn, ranked[len(ranked) // 2])


# The 27B hybrid's capture sizes on an H100 (vLLM's to 128 at --max-num-seqs 64, the plugin's above).
HYBRID_GRAPH_SIZES = [1, 2, 4, *range(8, 129, 8), 160, 192, 224, 256, 320, 384, 448, 512]


def tiled_cost(sizes, *, tile_above: int = 256, tile_s: float = 0.011):
    """A step-time law shaped like the 27B hybrid's on an H100 (bench/results/hybrid/h100/
    run-33e8a15/): a 20.5 ms decode step, ~0.07 ms a prefill token, attention growing with the
    chunk's context, and a step padded to a CUDA graph above ``tile_above`` tokens ``tile_s``
    dearer (the matrix products' next row tile: 256 -> 320 tokens, 40 -> 51-56 ms measured)."""

    def cost(step, scheduler) -> float:
        tokens = step.output.total_num_scheduled_tokens
        attention = 0.0
        for rid, end in step.chunk_end.items():
            n = step.output.num_scheduled_tokens[rid]
            attention += n * (end - n + n / 2)
        padded = next((s for s in sizes if s >= tokens), tokens)
        tile = tile_s if step.prefill_tokens and padded > tile_above else 0.0
        return 0.0205 + 0.0003 * len(step.decode_tokens) + 7e-5 * step.prefill_tokens + 1.2e-9 * attention + tile

    return cost


def paced_pair_steps(cls, depth, tiny_model) -> list[float]:
    engine = Engine(make(cls, depth, tiny_model, graph_sizes=HYBRID_GRAPH_SIZES), depth=depth,
                    cost=tiled_cost(HYBRID_GRAPH_SIZES))
    engine.add(40, 5000, "B")
    engine.run(lambda: "B" in engine.first_token)
    for turn in range(3):  # the seed pair's three runs, on one server
        engine.add(28_600, 10, f"A{turn}")
        engine.run(lambda t=turn: f"A{t}" in engine.first_token, max_steps=3000)
    engine.drain()
    return [d for s, d in zip(engine.steps, engine.durations) if s.prefill_tokens and s.decoding]


def three_long_prompts(engine, slowdown) -> tuple[list[float], float]:
    """One stream, then three 28.6k-token prompts one after another, the stream decoding alone for
    200 steps between them; ``slowdown()`` is called at the second prompt's 40th step. Each prompt's
    time to its first token, and the stream's worst gap between tokens beside any of them."""
    engine.add(40, 20_000, "B")
    engine.run(lambda: "B" in engine.first_token)
    seconds, worst = [], 0.0
    for turn in range(3):
        began, start = engine.now, len(engine.steps)
        engine.add(28_600, 10, f"A{turn}")
        if turn == 1:
            engine.run(lambda: len(engine.steps) >= start + 40)
            slowdown()
        engine.run(lambda t=turn: f"A{t}" in engine.first_token, max_steps=5000)
        seconds.append(engine.now - began)
        tokens = [engine.done_at[i] for i in range(start, len(engine.steps))
                  if "B" in engine.steps[i].decode_tokens and i in engine.done_at]
        worst = max(worst, *(b - a for a, b in zip(tokens, tokens[1:])))
        engine.run(lambda n=len(engine.steps): len(engine.steps) >= n + 200)
    return seconds, worst


def long_prompt_seconds(cls, depth, tiny_model, *, slowdown_steps: int = 0) -> tuple[list[float], float]:
    """`three_long_prompts` on the hybrid's law; the slowdown makes that many steps take 45 ms
    whatever their prefill (the H100's, bench/results/hybrid/h100/run-5b8f30f/: 16 prefill tokens
    as dear as 255)."""
    law = tiled_cost(HYBRID_GRAPH_SIZES)
    slow = {"left": 0}

    def cost(step, scheduler) -> float:
        if slow["left"]:
            slow["left"] -= 1
            return max(law(step, scheduler), 0.045)
        return law(step, scheduler)

    engine = Engine(make(cls, depth, tiny_model, graph_sizes=HYBRID_GRAPH_SIZES), depth=depth, cost=cost)
    return three_long_prompts(engine, lambda: slow.update(left=slowdown_steps))


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_a_slowdown_no_cap_escapes_costs_the_long_prompt_only_while_it_lasts(cls, depth, tiny_model, pacing_env,
                                                                            monkeypatch):
    """On the H100 every mixed step ran ~45 ms for 3.5 s whatever its prefill; the pacer cut its
    cap to 15 tokens (each size run in the slowdown condemned, never run again to clear it; the
    aim at its floor for ~300 steps) and the long prompt took 9.6 s against 4.9. A slowdown must
    cost the prompt about what it lasts, and the next prompt nothing."""
    pacing_env("adaptive", target_itl_ms=44, cap_tokens=256)
    (calm, _, _), _ = long_prompt_seconds(cls, depth, tiny_model)
    (before, during, after), worst = long_prompt_seconds(cls, depth, tiny_model, slowdown_steps=90)
    assert before == pytest.approx(calm, rel=0.01)
    assert during <= 1.6 * calm, (during, calm)  # 90 steps at 45 ms: ~4 s of steps at any cap
    assert after <= 1.1 * calm, (after, calm)
    assert worst <= 0.045 * 1.02  # the slowdown's own steps; no dear size on top
    # without the fast rise, the aim is still low when the next prompt comes
    with monkeypatch.context() as patched:
        patched.setattr(pacing, "AIM_RECOVER_STEPS", 10**9)
        (_, _, after), _ = long_prompt_seconds(cls, depth, tiny_model, slowdown_steps=90)
        assert after > 1.25 * calm
    # without the drift each size's excess is measured against, the slowdown condemns the sizes
    monkeypatch.setattr(StepCostModel, "drift", property(lambda self: 0.0))
    (_, during, _), _ = long_prompt_seconds(cls, depth, tiny_model, slowdown_steps=90)
    assert during > 1.6 * calm  # the bound above fails


def host_bound_pair(tiny_model, *, slow_host_steps: int = 0) -> tuple[list[float], float]:
    """`three_long_prompts` on the async loop where the engine's host launches each mixed step in
    36 ms (the 27B hybrid's eager GDN path on the H100, bench/results/hybrid/h100/run-5b8f30f/;
    decode-only steps, graph replays, 2 ms) and the GPU runs the hybrid's law; the slowdown makes
    the host take 46 ms for that many steps (decode-only steps were untouched by the H100's
    slowdown: the host's, not the GPU's)."""
    law = tiled_cost(HYBRID_GRAPH_SIZES)
    slow = {"left": 0}

    def host(step, scheduler) -> float:
        if slow["left"]:
            slow["left"] -= 1
            return 0.046
        return 0.036 if step.prefill_tokens else 0.002

    engine = Engine(make(PacedAsyncScheduler, 2, tiny_model, graph_sizes=HYBRID_GRAPH_SIZES), depth=2,
                    cost=law, host=host)
    return three_long_prompts(engine, lambda: slow.update(left=slow_host_steps))


def test_a_host_slowdown_leaves_the_aim_alone(tiny_model, pacing_env, monkeypatch):
    """A step whose host work alone passed the target (the engine thread launching it, measured
    from schedule() to vLLM's loop coming back) says nothing about its prefill: a smaller one would
    have taken the host as long. Lowering the aim on such steps cut the cap through a 90-step host
    slowdown and kept it low for the next prompt, whose steps sit on the host's 36 ms, never the
    20% under the target the aim's fast return asks for."""
    pacing_env("adaptive", target_itl_ms=44, cap_tokens=256)
    (calm, _, _), calm_worst = host_bound_pair(tiny_model)
    assert calm_worst <= 0.044 * 1.02
    (before, during, after), worst = host_bound_pair(tiny_model, slow_host_steps=90)
    assert before == pytest.approx(calm, rel=0.01)
    assert during <= 1.25 * calm, (during, calm)  # 90 steps 10 ms longer: ~0.9 s at any cap
    assert after <= 1.1 * calm, (after, calm)
    assert worst <= 0.046 * 1.02  # the slowdown's own steps
    original = Pacer.feedback
    monkeypatch.setattr(Pacer, "feedback", lambda self, seconds, filled=False, host_s=None, target_s=None:
                        original(self, seconds, filled, None, target_s))  # the host's time not known
    (_, during, after), _ = host_bound_pair(tiny_model, slow_host_steps=90)
    assert during > 1.25 * calm and after > 1.1 * calm  # both bounds above fail


class SteadyRun(NamedTuple):
    ttft: list[float]  # each long prompt's, from its arrival
    prefill: list[float]  # each long prompt's, from its first scheduled chunk to its first token
    gaps: list[float]  # every gap between two of a stream's tokens


def steady_users(engine, *, users: int = 8, seconds: float = 40.0, long_every: float = 10.0,
                 long_tokens: int = 20_000, seed: int = 0) -> SteadyRun:
    """`bench mixed`'s steady load on the harness: ``users`` who each send a ~300-token prompt,
    stream 100-300 tokens and think for exp(0.5 s) before the next, every user on a clock of its
    own (never in lockstep), and a ``long_tokens`` prompt every exp(``long_every``) s. Each user
    and the long arrivals draw from RNGs of their own, as `bench mixed` does: two schedulers
    under test see the same plans and the same long prompts whatever order their steps finish
    requests in."""
    plans = {f"u{i}": random.Random(f"{seed}-u{i}") for i in range(users)}
    arrivals = random.Random(f"{seed}-long")
    sched = engine.scheduler
    next_turn: dict[str, float | None] = {user: plan.uniform(0, 1.0) for user, plan in plans.items()}
    turns = dict.fromkeys(next_turn, 0)
    live: dict[str, str] = {}  # request -> user
    longs: dict[str, float] = {}  # request -> arrival
    started: dict[str, float] = {}  # long request -> when its first chunk was scheduled
    next_long = 3.0
    while engine.now < seconds:
        for user, at in next_turn.items():
            if at is not None and at <= engine.now:
                rid = f"{user}-{turns[user]}"
                turns[user] += 1
                plan = plans[user]
                engine.add(300 + plan.randint(-20, 20), plan.randint(100, 300), rid)
                live[rid], next_turn[user] = user, None
        if next_long <= engine.now:
            rid = f"L{len(longs)}"
            engine.add(long_tokens, 1, rid)
            longs[rid] = next_long
            next_long += arrivals.expovariate(1 / long_every)
        for rid, user in list(live.items()):
            if rid in engine.finished:
                del live[rid]
                next_turn[user] = engine.now + plans[user].expovariate(1 / 0.5)
        if not sched.has_requests():  # idle until the next arrival
            engine.now = max(engine.now, min([t for t in next_turn.values() if t is not None] + [next_long]))
            continue
        scheduled_at = engine.now
        for rid in engine.step().output.num_scheduled_tokens:
            if rid in longs:
                started.setdefault(rid, scheduled_at)
    engine.drain()
    done = [rid for rid in longs if rid in engine.first_token]
    first = {rid: engine.done_at[engine.first_token[rid]] for rid in done}
    gaps, last = [], {}
    for i, step in enumerate(engine.steps):
        for rid in step.decode_tokens:
            if rid.startswith("u") and i in engine.done_at:
                if rid in last:
                    gaps.append(engine.done_at[i] - last[rid])
                last[rid] = engine.done_at[i]
    return SteadyRun([first[rid] - longs[rid] for rid in done], [first[rid] - started[rid] for rid in done], gaps)


def host_floor_engine(tiny_model, seed: int) -> Engine:
    """The async loop on the 27B hybrid's law where the host launches each mixed step in 36.5 +-
    4 ms whatever its prefill (the H100's: ~36 ms of host in a ~39 ms mixed step, p10 / p90 33 /
    43 ms; decode-only steps, graph replays, 4.4 ms; bench/results/hybrid/h100/run-1a80097/)."""
    jitter = random.Random(seed + 10)

    def host(step, scheduler) -> float:
        return max(0.02, jitter.gauss(0.0365, 0.004)) if step.prefill_tokens else 0.0044

    scheduler = make(PacedAsyncScheduler, 2, tiny_model, graph_sizes=HYBRID_GRAPH_SIZES, max_num_seqs=64,
                     max_num_batched_tokens=2048)
    return Engine(scheduler, depth=2, cost=tiled_cost(HYBRID_GRAPH_SIZES), host=host)


@pytest.mark.parametrize("target_ms", [40, 44])
def test_a_host_bound_engine_keeps_long_prompts_moving_under_steady_load(target_ms, tiny_model, pacing_env,
                                                                         monkeypatch):
    """On the H100 at a 40 ms target, mixed steps that cost the host ~36 ms whatever their prefill
    ran over the target now and then; the aim fell to its floor, the line put the host's time on
    the attention term, the cap sat at ~15 tokens and long prompts took 12.3x their time alone
    (44 ms: 2.3-2.4x). Host-bound, the pacer must run its cap down only from sizes measured over
    the target: long prompts prefill within 2.5x their time alone, streams' gaps within the
    host's own (p99 45.8 ms for 36.5 +- 4). A prefill is timed from its first chunk: a long
    prompt that waits behind another waits for the load's sake, not the pacer's (seed 0's draws
    bring 7-8 long prompts in 37 s, back to back from t = 16 s: TTFT p50 3.33x alone at 40 ms and
    2.55x at 44, while each prefill took 2.07-2.22x and 1.89-2.04x)."""
    pacing_env("adaptive", target_itl_ms=target_ms, cap_tokens=256)
    alone = host_floor_engine(tiny_model, 0)
    alone.add(20_000, 1, "A")
    alone.run(lambda: "A" in alone.first_token)
    alone.drain()
    alone_s = alone.done_at[alone.first_token["A"]]
    for seed in range(2):
        run = steady_users(host_floor_engine(tiny_model, seed), seed=seed)
        gaps = sorted(run.gaps)
        assert len(run.prefill) >= 3 and statistics.median(run.prefill) <= 2.5 * alone_s, (run.prefill, alone_s)
        assert gaps[int(0.99 * len(gaps))] <= 0.046, gaps[-10:]
    if target_ms == 40:  # PREFILL_GATE_PACING_HOST_SHARE=0, the line alone as before: the long prompts crawl
        pacing_env("adaptive", target_itl_ms=target_ms, cap_tokens=256, host_share=0)
        run = steady_users(host_floor_engine(tiny_model, 0), seed=0)
        assert len(run.prefill) < 3 or statistics.median(run.prefill) > 2.5 * alone_s, run.prefill


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_adaptive_steps_down_from_a_graph_size_that_costs_more_than_the_line(cls, depth, tiny_model, pacing_env,
                                                                              monkeypatch):
    """On the H100 a stream's worst gaps beside a long prompt (54-56 ms against a 44 ms target and
    issue 50's bound of 50) were steps padded to the 320-token graph, which the fitted line put at
    42-48 ms. The pacer must keep to sizes whose steps meet the target once it has measured them,
    and try a size above every measured one only with room to spare."""
    pacing_env("adaptive", target_itl_ms=44, cap_tokens=256)
    mixed = paced_pair_steps(cls, depth, tiny_model)
    assert max(mixed) <= 0.044 * 1.10, sorted(mixed)[-5:]
    assert sorted(mixed)[len(mixed) // 2] >= 0.044 * 0.85  # and still fills the steps it can
    # the line alone, as before: the aim tracker pushes into the dear size and streams pay for it
    monkeypatch.setattr(Pacer, "_within_graph_costs", lambda self, cap, *args: cap)
    assert max(paced_pair_steps(cls, depth, tiny_model)) > 0.050


def test_the_control_file_changes_the_settings_and_keeps_what_was_measured(tiny_model, pacing_env, monkeypatch,
                                                                           tmp_path):
    """`PREFILL_GATE_PACING_CONTROL_FILE`: new settings without a restart (bench/gpu's variants
    run so). The engine measured so far is the same engine: its mixed steps' host work carries
    over (a host-bound engine stays known as one), the aim only where the target is the same;
    a file that does not parse leaves the settings as they were."""
    control = tmp_path / "pacing.env"
    monkeypatch.setenv("PREFILL_GATE_PACING_CONTROL_FILE", str(control))
    pacing_env("adaptive", target_itl_ms=44, cap_tokens=256)
    engine = host_floor_engine(tiny_model, 0)
    steady_users(engine, seconds=8.0)
    scheduler = engine.scheduler
    assert scheduler.pacer.host_bound
    aim = scheduler.pacer.aim
    took = []  # the aim each new pacer took, before the step that read the file moves it
    poll = scheduler._poll_control_file
    monkeypatch.setattr(scheduler, "_poll_control_file", lambda now: (poll(now), took.append(scheduler.pacer.aim)))
    stamps = itertools.count(10**18, 10**9)
    control.write_text("PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=44\n"
                       "PREFILL_GATE_PACING_CAP_TOKENS=128\n")
    os.utime(control, ns=(next(stamps), next(stamps)))  # a new modification time, however coarse the clock
    engine.now += 1.0
    engine.step()
    assert scheduler.pacer.config.cap_tokens == 128 and scheduler.pacer.host_bound and took[-1] == aim
    control.write_text("PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=40\n")
    os.utime(control, ns=(next(stamps), next(stamps)))  # a new modification time, however coarse the clock
    engine.now += 1.0
    engine.step()
    assert scheduler.pacer.config.target_itl_s == 0.040 and scheduler.pacer.host_bound
    assert took[-1] == 0.95  # learned for 44 ms, not for 40
    control.write_text("PREFILL_GATE_PACING=sometimes\n")
    os.utime(control, ns=(next(stamps), next(stamps)))  # a new modification time, however coarse the clock
    engine.now += 1.0
    engine.step()
    assert scheduler.pacer.config.target_itl_s == 0.040
    # The GDN patch's settings share the file (its layers read them): the pacer takes the rest;
    # a name that is no engine setting (a typo) refuses the file
    control.write_text("PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=42\n"
                       "PREFILL_GATE_GDN_WALK=4x1\nPREFILL_GATE_FAST_LAUNCH=on\n")
    os.utime(control, ns=(next(stamps), next(stamps)))
    engine.now += 1.0
    engine.step()
    assert scheduler.pacer.config.target_itl_s == 0.042
    control.write_text("PREFILL_GATE_PACING=adaptive\nPREFILL_GATE_PACING_TARGET_ITL_MS=30\nPREFILL_GATE_GDN_WLAK=4x1\n")
    os.utime(control, ns=(next(stamps), next(stamps)))
    engine.now += 1.0
    engine.step()
    assert scheduler.pacer.config.target_itl_s == 0.042


def hybrid_h200_cost(step, scheduler) -> float:
    """The 27B hybrid's steps on the H200 (bench/results/hybrid/h200/run-0bbf63f/): 15.2 ms beside
    the decodes, ~0.09 ms a prefill token (256 tokens: ~38 ms)."""
    return 0.0152 + 9e-5 * step.prefill_tokens


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_short_step_x_splits_short_prompts_and_leaves_long_ones_their_target(cls, depth, tiny_model, pacing_env):
    """SHORT_STEP_X=2 with a 44 ms target, 4 streams: 300-token prompts arriving alone cost the
    streams at most ~2x their step (they take a step more), and a 20k prompt's steps keep the
    target, with a short prompt arriving while it prefills too."""
    seen = {}
    for x in (0, 2):
        pacing_env("adaptive", target_itl_ms=44, cap_tokens=64, short_step_x=x)
        engine = Engine(make(cls, depth, tiny_model), depth=depth, cost=hybrid_h200_cost)
        streams = [f"B{i}" for i in range(4)]
        for name in streams:
            engine.add(40, 100_000, name)
        engine.run(lambda: all(name in engine.first_token for name in streams))
        engine.add(8_000, 2, "warm")  # the fit's mixed steps
        engine.run(lambda: "warm" in engine.finished, max_steps=3000)
        for i in range(6):
            engine.add(300, 1, f"S{i}")
            engine.run(lambda i=i: f"S{i}" in engine.finished, max_steps=200)
        engine.add(20_000, 2, "L")
        engine.run(lambda: engine.scheduler.requests["L"].num_computed_tokens >= 10_000, max_steps=3000)
        engine.add(300, 1, "S-beside")
        engine.run(lambda: "L" in engine.finished and "S-beside" in engine.finished, max_steps=3000)
        engine.drain()
        steps = list(zip(engine.steps, engine.durations))

        def prefilled(step, names):
            return [r for r in step.output.num_scheduled_tokens if r not in step.decoding and r in names]

        short = [d for s, d in steps if s.decoding and prefilled(s, {f"S{i}" for i in range(6)})]
        long = [d for s, d in steps if s.decoding and prefilled(s, {"L"})]
        seen[x] = short, long
    (short_off, long_off), (short_on, long_on) = seen[0], seen[2]
    assert max(short_off) > 0.036  # the target lets a short prompt's first 250-300 tokens into one step
    assert max(short_on) <= 2 * 0.0152 * 1.05, sorted(short_on)[-5:]  # at most ~2x the step
    assert len(short_on) > len(short_off)  # the price: a step more for some
    # long prompts keep their steps; their last SHORT_TOKENS count as short, as short-first counts
    # them (a step or two more at the end: ~1.5% of the prompt's time here)
    assert statistics.median(long_on) >= 0.040 and sum(long_on) <= 1.03 * sum(long_off), (sum(long_on), sum(long_off))
