"""Paced steps serve short prompts first, on vLLM 0.26's real schedulers."""

from __future__ import annotations

import random

import pytest

from prefill_gate.engine_patches.short_first import reserve_for_short
from tests.engine.harness import Engine
from tests.engine.test_pacing import CLASSES, assert_paced, h200_like_cost, make


def start_overlap(engine: Engine, long_tokens: int = 28_000) -> None:
    """B decoding, A mid-way through its paced prefill."""
    engine.add(40, 5000, "B")
    engine.run(lambda: "B" in engine.first_token)
    engine.add(long_tokens, 10, "A")
    for _ in range(10):
        engine.step()


def steps_to_first_token(engine: Engine, rid: str) -> int:
    start = len(engine.steps)
    engine.run(lambda: rid in engine.first_token, max_steps=5000)
    return engine.first_token[rid] - start + 1


# --------------------------------------------------------------------- the rule
@pytest.mark.parametrize("cap,demand,long_pending,share,block,expected", [
    (256, 300, True, 0.5, None, 128),  # the long prompt keeps half
    (256, 40, True, 0.5, None, 40),  # short demand below the share: all of it
    (256, 300, False, 0.5, None, 256),  # nothing long pending: the whole cap
    (256, 300, True, 0.0, None, 256),  # share 0: short prompts may take every token
    (256, 300, True, 1.0, None, 0),  # share 1: they never go ahead
    (3136, 5000, True, 0.5, 1568, 1568),  # align mode: the long keeps whole blocks
    (1568, 500, True, 0.25, 1568, 0),  # ... at least one, or it would never advance
    (256, 0, True, 0.5, None, 0),
])
def test_reserve(cap, demand, long_pending, share, block, expected):
    assert reserve_for_short(cap, demand, long_pending, share, block) == expected


# ------------------------------------------------------------ on vLLM's scheduler
@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("mode", ["cap", "adaptive"])
def test_short_prompt_mid_long_prefill_starts_within_two_steps(cls, depth, mode, tiny_model, pacing_env):
    waited = {}
    for short_tokens in (1024, 0):
        pacing_env(mode, cap_tokens=512, target_itl_ms=40, short_tokens=short_tokens)
        engine = Engine(make(cls, depth, tiny_model), depth=depth,
                        cost=h200_like_cost() if mode == "adaptive" else None)
        start_overlap(engine)
        engine.add(300, 20, "S")
        waited[short_tokens] = steps_to_first_token(engine, "S")
        engine.run(lambda e=engine: "A" in e.first_token, max_steps=5000)
        engine.drain()
        if mode == "cap":
            assert_paced(engine, 512)
    # With a 256-token reserve (adaptive: a 40 ms target gives a cap near 550 here), 300
    # tokens take two steps (a third step's result under the async loop's lag); in
    # arrival order S waits for A's remaining chunks.
    assert waited[1024] <= 2 + (depth - 1)
    assert waited[0] >= 30


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_a_stream_of_short_prompts_cannot_starve_the_long_one(cls, depth, tiny_model, pacing_env):
    cap = 256
    pacing_env("cap", cap_tokens=cap, short_tokens=1024, long_min_share=0.5)
    engine = Engine(make(cls, depth, tiny_model, max_num_seqs=64), depth=depth)
    start_overlap(engine, long_tokens=20_000)
    given = []
    for i in range(60):  # a new 200-token prompt every step: demand far above the cap
        engine.add(200, 2, f"S{i}")
        step = engine.step()
        given.append(step.output.num_scheduled_tokens.get("A", 0))
    assert min(given[1:]) >= cap // 2, given
    assert engine.scheduler.pacing_telemetry.short_first_steps >= 55
    engine.run(lambda: "A" in engine.first_token, max_steps=5000)
    engine.drain()
    assert_paced(engine, cap)


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_nothing_changes_when_no_request_decodes(cls, depth, tiny_model, pacing_env):
    traces = []
    for mode in ("off", "cap"):
        pacing_env(mode, cap_tokens=256, short_tokens=1024)
        engine = Engine(make(cls, depth, tiny_model, max_num_batched_tokens=2048), depth=depth)
        engine.add(20_000, 1, "A")  # one token each: no request ever decodes
        engine.step()
        for i in range(3):
            engine.add(300, 1, f"S{i}")
        engine.run(lambda e=engine: all(r in e.finished for r in ("A", "S0", "S1", "S2")))
        engine.drain()
        traces.append([dict(s.output.num_scheduled_tokens) for s in engine.steps])
    assert traces[0] == traces[1]


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("mode", ["cap", "adaptive"])
def test_with_short_when_idle_a_short_prompt_beside_a_lone_long_prefill_goes_first(cls, depth, mode, tiny_model,
                                                                                   pacing_env):
    """PREFILL_GATE_PACING_SHORT_WHEN_IDLE=1: nothing decodes (every request wants one token),
    a long prompt prefills in whole 2,048-token chunks, a short one arrives: it no longer waits
    for the long prompt's remaining chunks (vLLM's running loop gives them the whole budget)
    but gets its first token after a bounded step or two; the long prompt, alone again, goes
    back to whole chunks."""
    waited, chunks_after = {}, {}
    for idle in (0, 1):
        pacing_env(mode, cap_tokens=512, target_itl_ms=40, short_tokens=1024, short_when_idle=idle)
        engine = Engine(make(cls, depth, tiny_model, max_num_batched_tokens=2048), depth=depth,
                        cost=h200_like_cost() if mode == "adaptive" else None)
        engine.add(20_000, 1, "A")
        for _ in range(2):
            engine.step()
        engine.add(300, 1, "S")
        waited[idle] = steps_to_first_token(engine, "S")
        start = len(engine.steps)
        engine.run(lambda e=engine: "A" in e.first_token, max_steps=5000)
        engine.drain()
        chunks_after[idle] = max([s.output.num_scheduled_tokens.get("A", 0) for s in engine.steps[start:]],
                                 default=0)
    assert waited[0] >= 5  # behind A's ~8 remaining whole chunks
    assert waited[1] <= 2 + (depth - 1), waited
    assert chunks_after[1] == 2048  # alone again: unbounded


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_a_short_prompt_waiting_behind_a_long_one_goes_first(cls, depth, tiny_model, pacing_env):
    pacing_env("cap", cap_tokens=256, short_tokens=1024)
    engine = Engine(make(cls, depth, tiny_model), depth=depth)
    start_overlap(engine)
    engine.add(9_000, 5, "C")  # a second long prompt, waiting ahead of the short one
    engine.add(300, 5, "S")
    assert steps_to_first_token(engine, "S") <= 3 + (depth - 1)
    assert "C" in engine.scheduler.requests
    engine.run(lambda: all(r in engine.first_token for r in ("A", "C")), max_steps=5000)
    engine.drain()
    assert_paced(engine, 256)
    # The queue kept C: it was admitted, once, after S.
    assert engine.first_token["C"] > engine.first_token["S"]


def test_priority_first_then_short_first_within_a_priority(tiny_model, pacing_env):
    from prefill_gate.engine_patches.pacing import PacedScheduler

    pacing_env("cap", cap_tokens=256, short_tokens=1024)
    engine = Engine(make(PacedScheduler, 1, tiny_model, policy="priority"), depth=1)
    engine.add(40, 5000, "B")
    engine.run(lambda: "B" in engine.first_token)
    engine.add(28_000, 10, "A", priority=0)
    for _ in range(5):
        engine.step()
    engine.add(9_000, 5, "C", priority=0)  # urgent and long
    engine.add(600, 5, "S-late", priority=1)  # short but less urgent
    engine.add(300, 5, "S", priority=0)  # short and urgent: ahead of C
    engine.run(lambda: "S-late" in engine.first_token and "C" in engine.first_token, max_steps=5000)
    ft = engine.first_token
    assert ft["S"] < ft["C"]
    # C is more urgent than S-late: S-late gets prefill only once C has had its chunk.
    first_chunk = {rid: next(i for i, s in enumerate(engine.steps) if rid in s.output.num_scheduled_tokens)
                   for rid in ("C", "S-late")}
    assert first_chunk["C"] <= first_chunk["S-late"]


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_preemption_keeps_every_request(cls, depth, tiny_model, pacing_env, monkeypatch):
    """A step that preempts skips vLLM's waiting loop, and the preempted request goes back
    to the waiting queue, which short-first shows reordered during the call: the queue it
    restores must hold the preempted request and every request not admitted."""
    pacing_env("cap", cap_tokens=256, short_tokens=1024)
    scheduler = make(cls, depth, tiny_model, num_blocks=200, max_num_seqs=32)
    during_arrangement = []
    preempt = type(scheduler)._preempt_request

    def counting(self, request, timestamp):
        during_arrangement.append(self._arrangement is not None and self._arrangement.waiting_order is not None)
        return preempt(self, request, timestamp)

    monkeypatch.setattr(type(scheduler), "_preempt_request", counting)
    engine = Engine(scheduler, depth=depth)
    # Two streams whose KV outgrows 200 blocks of 16 tokens: vLLM must preempt one.
    names = [engine.add(40, 2500, "B"), engine.add(40, 2500, "D")]
    engine.run(lambda: "B" in engine.first_token)
    for i in range(1600):
        engine.step()
        if i == 1000:
            names.append(engine.add(3000, 5, "A"))
        if i > 1000 and i % 7 == 0:
            names += [engine.add(2000, 3, f"L{i}"), engine.add(200, 3, f"S{i}")]
    engine.run(lambda: all(n in engine.finished for n in names), max_steps=20_000)
    engine.drain()
    assert any(during_arrangement), f"no preemption while the queue was reordered: {during_arrangement}"
    sched = engine.scheduler
    assert not sched.waiting and not sched.skipped_waiting and not sched.running


def test_a_cached_long_prompt_is_short(tiny_model, pacing_env):
    """An agent's turn re-sends the conversation: its cached prefix is not prefill work."""
    from prefill_gate.engine_patches.pacing import PacedScheduler

    pacing_env("cap", cap_tokens=256, short_tokens=1024)
    engine = Engine(make(PacedScheduler, 1, tiny_model, enable_prefix_caching=True), depth=1)
    rng = random.Random(1)
    history = [rng.randrange(3, 200) for _ in range(6_000)]
    engine.add(0, 2, "turn1", tokens=history)
    engine.run(lambda: "turn1" in engine.finished)
    engine.add(0, 5000, "B", tokens=[rng.randrange(3, 200) for _ in range(40)])
    engine.run(lambda: "B" in engine.first_token)
    engine.add(0, 10, "A", tokens=[rng.randrange(3, 200) for _ in range(20_000)])
    for _ in range(5):
        engine.step()
    turn2 = history + [rng.randrange(3, 200) for _ in range(250)]
    engine.add(0, 5, "turn2", tokens=turn2)
    start = len(engine.steps)
    assert steps_to_first_token(engine, "turn2") <= 2
    computed = sum(s.output.num_scheduled_tokens.get("turn2", 0) for s in engine.steps[start:])
    assert computed <= 250 + 16  # only the new tail (and the last partial block) was prefill
