"""The simulator's scheduling arithmetic, against hand-computed step sequences."""

import asyncio

import pytest

from prefill_gate.proxy.sim import build_engine
from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig, SimRequest, block_hashes


def engine(**cfg):
    return Engine(EngineConfig(**cfg), CostModel(base=0.001))


def req(n, out=3, base=0):
    return SimRequest([base + i for i in range(n)], out, events=asyncio.Queue())


def steps(e, n):
    out = []
    for _ in range(n):
        plan = e.plan()
        out.append(plan.summary())
        e.apply(plan)
    return out


def test_budget_split_and_chunking():
    e = engine(max_num_batched_tokens=8, enable_prefix_caching=False)
    a = e.add(req(30, out=2))
    assert steps(e, 1) == [(0, [8])]
    b = e.add(req(3, out=2, base=1000))
    # A keeps its chunks; B waits for budget, then prefills in the step A finishes.
    assert steps(e, 4) == [(0, [8]), (0, [8]), (0, [6, 2]), (1, [1])]
    assert a.num_output == 2 and a.finished  # first token at the end of its prefill, second as a decode
    assert b.num_output == 1 and not b.prefilling
    assert steps(e, 1) == [(1, [])]
    assert b.finished and not e.has_work


def test_decodes_first_even_behind_an_earlier_prefilling_request():
    e = engine(max_num_batched_tokens=8, enable_prefix_caching=False)
    b = e.add(req(2, out=50))
    steps(e, 1)  # B prefilled, first token out
    a = e.add(req(100, out=1, base=500))
    assert steps(e, 1) == [(1, [7])]  # A enters running behind B
    e.running.reverse()  # put A (still prefilling) ahead of B in the running list
    assert e.running[0] is a
    assert steps(e, 3) == [(1, [7]), (1, [7]), (1, [7])]
    assert b.num_output == 5


def test_long_prefill_token_threshold_caps_each_request():
    e = engine(max_num_batched_tokens=10, long_prefill_token_threshold=4, enable_prefix_caching=False)
    e.add(req(9, out=1)), e.add(req(5, out=1, base=100))
    assert steps(e, 3) == [(0, [4, 4]), (0, [4, 1]), (0, [1])]


def test_max_num_seqs_holds_the_rest_in_waiting():
    e = engine(max_num_batched_tokens=100, max_num_seqs=1, enable_prefix_caching=False)
    a, b = e.add(req(10, out=2)), e.add(req(10, out=1, base=100))
    assert steps(e, 3) == [(0, [10]), (1, []), (0, [10])]
    assert a.finished and b.finished


def test_prefix_cache_hits_whole_blocks_and_always_computes_the_last_token():
    e = engine(max_num_batched_tokens=100, block_size=4)
    first = e.add(req(12, out=1))
    steps(e, 1)
    assert first.finished
    tail = e.add(SimRequest(first.prompt[:8] + [900, 901, 902, 903], 1))
    assert steps(e, 1) == [(0, [4])] and tail.num_cached == 8
    same = e.add(SimRequest(list(first.prompt), 1))
    assert steps(e, 1) == [(0, [1])] and same.num_cached == 11
    other = e.add(req(12, out=1, base=5000))
    assert steps(e, 1) == [(0, [12])] and other.num_cached == 0


def test_prefix_cache_evicts_least_recently_used_blocks():
    e = engine(max_num_batched_tokens=100, block_size=4, prefix_cache_blocks=3)
    a = e.add(req(12, out=1))
    steps(e, 1)
    e.add(req(8, out=1, base=100))
    steps(e, 1)  # 2 new blocks push out A's first two
    again = e.add(SimRequest(list(a.prompt), 1))
    steps(e, 1)
    assert again.num_cached == 0


def test_block_hashes_chain_prefixes():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same second block, other prefix


def test_abort_frees_the_request_in_any_state():
    e = engine(max_num_batched_tokens=8, max_num_seqs=1, enable_prefix_caching=False)
    a, b = e.add(req(20)), e.add(req(5, base=100))
    steps(e, 1)
    e.abort(b)  # waiting
    e.abort(a)  # running, mid-prefill
    assert not e.has_work and a.aborted and b.aborted
    assert e.plan().num_tokens == 0


def test_tokens_are_emitted_then_the_end():
    e = engine(max_num_batched_tokens=8, enable_prefix_caching=False)
    r = e.add(req(4, out=3))
    steps(e, 3)
    got = [r.events.get_nowait() for _ in range(4)]
    assert got == [1, 2, 3, None]


def test_cost_model_arithmetic():
    c = CostModel(base=0.005, mixed=0.002, per_decode_row=0.001, per_prefill_token=1e-5, attention=1e-9,
                  decode_kv=1e-7)
    assert c.step_seconds([100], []) == pytest.approx(0.005 + 1e-5)
    assert c.step_seconds([100, 300], []) == pytest.approx(0.005 + 0.001 + 4e-5)
    # one decode row + a 1000-token chunk starting at context 2000 (mean context 2500)
    assert c.step_seconds([100], [(1000, 2000)]) == pytest.approx(0.005 + 1e-5 + 0.002 + 0.01 + 2.5e-3)
    assert c.scaled(2).step_seconds([100], []) == pytest.approx(2 * (0.005 + 1e-5))


def test_a_mixed_step_takes_at_least_the_host_floor_and_a_large_one_hides_it():
    c = CostModel(base=0.014, mixed=0.060, per_prefill_token=5e-5, mixed_floor=0.100)
    assert c.step_seconds([0], []) == pytest.approx(0.014)  # decodes alone: graphed, no floor
    assert c.step_seconds([0], [(300, 0)]) == pytest.approx(0.114)  # 0.089 of work, host-bound
    assert c.step_seconds([0], [(100, 0), (200, 0)]) == pytest.approx(0.114)  # two prompts, one floor
    assert c.step_seconds([0], [(1568, 0)]) == pytest.approx(0.014 + 0.060 + 0.0784)  # GPU-bound
    assert c.scaled(2).step_seconds([0], [(300, 0)]) == pytest.approx(0.228)


def test_a_step_past_the_largest_cuda_graph_costs_the_eager_extra():
    c = CostModel(base=0.005, mixed=0.002, per_prefill_token=1e-5, graph_tokens=512, eager=0.030)
    assert c.step_seconds([0], [(511, 0)]) == pytest.approx(0.005 + 0.002 + 0.00511)  # 512 tokens: graphed
    assert c.step_seconds([0], [(512, 0)]) == pytest.approx(0.005 + 0.002 + 0.00512 + 0.030)  # 513: eager
    assert c.step_seconds([0] * 600, []) > 0.030  # decode rows count too
    assert c.scaled(2).step_seconds([0], [(512, 0)]) == pytest.approx(2 * (0.005 + 0.002 + 0.00512 + 0.030))
    assert CostModel(base=0.005, eager=0.030).step_seconds([0], [(4096, 0)]) == pytest.approx(0.005)  # off


def test_a_share_of_eager_steps_stalls_longer():
    """`eager_tail`: 1 in ~20 eager steps 75 ms longer (the H100 host), none within the graph."""
    from prefill_gate.proxy.sim.engine import StepPlan

    cost = CostModel(base=0.005, per_prefill_token=1e-5, graph_tokens=512, eager=0.020, eager_tail=0.05,
                     eager_tail_s=0.075)
    e = Engine(EngineConfig(), cost, seed=3)
    long = [e.step_seconds(StepPlan(chunks=[(SimRequest(prompt=[], max_tokens=1), 600)])) for _ in range(4000)]
    short = [e.step_seconds(StepPlan(chunks=[(SimRequest(prompt=[], max_tokens=1), 500)])) for _ in range(4000)]
    assert 0.035 <= sum(t > 0.1 for t in long) / 4000 <= 0.065
    assert max(short) == pytest.approx(0.005 + 0.005) and min(long) == pytest.approx(0.005 + 0.006 + 0.020)
    assert cost.scaled(2).eager_tail_s == 0.150 and cost.scaled(2).eager_tail == 0.05


@pytest.mark.parametrize("cap,stall", [(0, 0.1 + 0.002), (256, 0.0)])
def test_a_long_prompts_arrival_stalls_a_stock_engine_and_not_a_paced_one(cap, stall):
    """The arrival stall is stock vLLM's (seen as one gap more than a prompt has chunks); the
    engine patches' paced runs on the H200 showed none (the comment at ``Engine.add``). A text
    prompt of 1,000 tokens at 0.1 ms a token, and one given as 2,000 token ids at 1 us an id:
    the next step carries both on a stock engine, nothing on a paced one, and only once."""
    from prefill_gate.proxy.sim.engine import StepPlan

    e = Engine(EngineConfig(pacing_cap=cap), CostModel(base=0.005, arrival_per_token=1e-4, arrival_per_id=1e-6))
    e.add(req(1000, out=1))
    e.add(req(2000, out=1), token_ids=True)
    assert e.step_seconds(StepPlan()) == pytest.approx(0.005 + stall)
    assert e.step_seconds(StepPlan()) == pytest.approx(0.005)


def test_build_engine_overrides_and_errors():
    e, p = build_engine("rtx3090-27b-hybrid", engine={"max_num_batched_tokens": 2048}, time_scale=0.5)
    assert e.config.max_num_batched_tokens == 2048 and e.config.block_size == 1568
    assert e.cost.base == pytest.approx(p.cost.base / 2)
    with pytest.raises(ValueError, match="unknown simulator preset"):
        build_engine("a100")
    with pytest.raises(ValueError):
        build_engine(None, engine={"max_num_seqs": 0})
    with pytest.raises(ValueError):
        build_engine(None, cost={"nonsense": 1.0})


async def test_run_loop_paces_steps_on_the_clock():
    e = Engine(EngineConfig(max_num_batched_tokens=64), CostModel(base=0.01))
    task = asyncio.create_task(e.run())
    await asyncio.sleep(0)
    r = e.add(req(10, out=10))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await r.events.get() is not None:
        pass
    elapsed = loop.time() - t0
    task.cancel()
    assert 10 * 0.01 <= elapsed < 10 * 0.01 + 0.2


def test_pacing_cap_bounds_prefill_only_while_decoding():
    from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig, SimRequest

    engine = Engine(EngineConfig(max_num_batched_tokens=8192, pacing_cap=256), CostModel(base=0.005))
    b = engine.add(SimRequest([1] * 40, 50))
    engine.apply(engine.plan())  # B's prompt: B decodes from now on
    a = engine.add(SimRequest(list(range(20_000)), 4))
    for _ in range(10):
        plan = engine.plan()
        assert plan.decodes == [b]
        assert sum(n for _, n in plan.chunks) == 256  # paced while B decodes
        engine.apply(plan)
    assert a.prefilling and a.num_computed == 10 * 256
    engine.abort(b)
    plan = engine.plan()
    assert not plan.decodes and plan.chunks[0][1] == 8192  # nobody decodes: the whole budget


def test_agent_bench_helpers():
    from prefill_gate.proxy.bench.agent import max_gap_in, plan_conversation

    plan = plan_conversation(seed=1, turns=6, short_chars=50, tool_chars=500)
    assert [k for k, _ in plan] == ["short", "short", "tool"] * 2
    assert all(45 <= len(t) <= 50 for k, t in plan if k == "short")
    assert plan == plan_conversation(seed=1, turns=6, short_chars=50, tool_chars=500)
    tokens = [0.0, 0.01, 0.02, 0.10, 0.11]
    assert max_gap_in(tokens, 0.015, 0.105) == pytest.approx(0.08)
    assert max_gap_in(tokens, 0.5, 0.6) != max_gap_in(tokens, 0.5, 0.6)  # nan: no gap inside


@pytest.mark.parametrize("short_tokens,within", [(1024, 3), (0, 70)])
def test_paced_engine_serves_short_prompts_first(short_tokens, within):
    """The paced simulator follows engine_patches' short-first rule: a 300-token prompt that
    arrives while a long prompt prefills next to a stream is prefilled in three steps of
    half a 256-token cap (in arrival order: after the long one's ~70 more), and the long
    one keeps the other half."""
    e = engine(max_num_batched_tokens=8192, pacing_cap=256, pacing_short_tokens=short_tokens,
               enable_prefix_caching=False)
    e.add(req(40, out=10_000))
    steps(e, 1)
    long = e.add(req(20_000, out=1, base=1000))
    steps(e, 5)
    short = e.add(req(300, out=1, base=50_000))
    for n in range(1, 200):
        plan = e.plan()
        got = dict((r.id, k) for r, k in plan.chunks)
        if short_tokens and long.prefilling:
            assert got.get(long.id, 0) >= 128
        e.apply(plan)
        if short.finished:
            break
    assert n <= within if short_tokens else n >= within


@pytest.mark.parametrize("idle,within", [(True, 2), (False, 8)])
def test_short_when_idle_caps_a_lone_long_prefill_beside_a_short_prompt(idle, within):
    """PREFILL_GATE_PACING_SHORT_WHEN_IDLE in the simulator, as on vLLM's scheduler
    (tests/engine/test_short_first.py): nothing decodes, a 20k prompt prefills in whole
    2,048-token chunks; a 300-token prompt arriving then is done in two capped steps with the
    setting, after the long one's remaining chunks without it; alone again, whole chunks."""
    e = engine(max_num_batched_tokens=2048, pacing_cap=512, pacing_short_when_idle=idle,
               enable_prefix_caching=False)
    long = e.add(req(20_000, out=1, base=1000))
    steps(e, 2)
    short = e.add(req(300, out=1, base=50_000))
    for n in range(1, 50):
        e.apply(e.plan())
        if short.finished:
            break
    assert n <= within if idle else n >= within
    if long.prefilling:
        assert dict((r.id, k) for r, k in e.plan().chunks)[long.id] == 2048


def test_align_mode_chunks_whole_blocks_and_waits_when_none_fits():
    # vLLM's hybrid align mode: a chunk ends on a block boundary until the prompt's last full
    # block, so a budget of 10 with blocks of 4 prefills 8 a step; with a decode in the step,
    # 9 tokens are left and still 8 go; the chunk that would end the prompt stops at its last
    # boundary first (20 of 21: vLLM 0.26 schedules 4 then 1, as tests/engine checks on its
    # real scheduler); a budget that holds no whole block next to the decode waits.
    e = engine(max_num_batched_tokens=10, block_size=4, align_chunks=True)
    e.add(req(2, out=50))
    steps(e, 1)
    e.add(req(21, out=1, base=500))
    assert steps(e, 4) == [(1, [8]), (1, [8]), (1, [4]), (1, [1])]
    tight = engine(max_num_batched_tokens=4, block_size=4, align_chunks=True)
    tight.add(req(2, out=50))
    steps(tight, 1)
    long = tight.add(req(9, out=1, base=500))
    assert steps(tight, 2) == [(1, []), (1, [])]  # 3 tokens left beside the decode: no block fits
    assert long in tight.waiting
    off = engine(max_num_batched_tokens=10, block_size=4, align_chunks=True, enable_prefix_caching=False)
    off.add(req(21, out=1))
    assert steps(off, 1) == [(0, [10])]  # no prefix caching: no align mode


def test_the_hybrid_stack_preset_walks_small_steps_and_costs_blocks_as_stock():
    """h200-27b-hybrid-stack: a short prompt's step within the graphs costs a decode step, 1 ms and
    0.09 ms a prompt token (the GDN walk; 300 tokens: the H200's 43.5 ms median with the arrival);
    a whole 1,568-token block beside the streams costs what the stock preset says (the patch
    leaves it)."""
    from prefill_gate.proxy.sim.presets import get_preset

    stack, stock = get_preset("h200-27b-hybrid-stack").cost, get_preset("h200-27b-hybrid").cost
    streams = [2000] * 4
    for n in (200, 300, 400, 500):
        assert stack.step_seconds(streams, [(n, 0)]) == pytest.approx(0.0141 + 0.001 + 9e-5 * n + 4.3e-10 * n * n / 2)
        assert stock.step_seconds(streams, [(n, 0)]) == pytest.approx(0.0141 + 0.099)
    for start in (0, 14 * 1568):
        assert stack.step_seconds(streams, [(1568, start)]) == pytest.approx(stock.step_seconds(streams, [(1568, start)]))
    assert stack.step_seconds(streams, []) == stock.step_seconds(streams, [])  # decodes alone: the same
    assert stack.scaled(2).graph_per_prefill_token == pytest.approx(1.8e-4)
