"""A client that goes away in any phase is released exactly once, and its upstream
request is aborted: real sockets, the proxy and the simulator both under uvicorn."""

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from conftest import sample, serve
from prefill_gate.proxy.app import build_state, create_app
from prefill_gate.proxy.settings import load_settings
from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
from prefill_gate.proxy.sim.server import create_sim_app

CHAT = "/v1/chat/completions"
# Slow enough to act in each phase: 20 ms per step, ~1 s to prefill 10k tokens.
COST = CostModel(base=0.02, per_prefill_token=1e-4)


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def body(content, max_tokens, stream=True):
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


@pytest.fixture(params=["uvicorn", "listener"])
async def stack(request):
    """The proxy behind uvicorn as it comes (DisconnectWatch's task waits on receive()) and
    behind its own listener, as `prefill-gate serve` runs it (the connection's callback)."""
    engine = Engine(EngineConfig(max_num_batched_tokens=2048), COST)
    async with serve(create_sim_app(engine)) as sim_url:
        state = build_state(load_settings({"upstreams": [sim_url], "large_prefill_tokens": 1000}, environ={}),
                            registry=CollectorRegistry())
        async with serve(create_app(state, health_checks=False), plain=request.param == "uvicorn") as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                yield client, state, engine, sim_url


def counts(state):
    u = next(iter(state.policy.upstreams.values()))
    return (state.policy.queue_depth, u.active, u.live_decodes, u.large_in_flight, u.prefill_tokens)


async def start_b(client):
    """B streams until closed; returns (context manager, its byte iterator) once B decodes.
    Keep the iterator referenced: its finalizer would close the stream."""
    cm = client.stream("POST", CHAT, json=body("b", 5000))
    resp = await cm.__aenter__()
    it = resp.aiter_raw()
    while b'"content":"' not in await it.__anext__():
        pass
    return cm, it


async def large_is_admitted_at_once(client, state):
    before = sample(state.metrics.registry, "prefill_gate_admissions_total", {"class": "large", "decision": "immediate"})
    r = await client.post(CHAT, json=body("x" * 6000, 1, stream=False))
    assert r.status_code == 200
    after = sample(state.metrics.registry, "prefill_gate_admissions_total", {"class": "large", "decision": "immediate"})
    return after == before + 1


async def test_disconnect_while_queued(stack):
    client, state, engine, _ = stack
    cm, b_stream = await start_b(client)
    a = asyncio.create_task(client.post(CHAT, json=body("x" * 6000, 5)))
    await until(lambda: state.policy.queue_depth == 1)
    a.cancel()
    await until(lambda: state.policy.queue_depth == 0)
    assert len(engine.running) + len(engine.waiting) == 1  # only B: A never reached the engine
    await cm.__aexit__(None, None, None)
    await until(lambda: counts(state) == (0, 0, 0, 0, 0))
    await until(lambda: not engine.running)
    assert await large_is_admitted_at_once(client, state)
    assert sample(state.metrics.registry, "prefill_gate_admissions_total",
                  {"class": "large", "decision": "cancelled"}) == 1


async def test_disconnect_while_prefilling(stack):
    client, state, engine, _ = stack
    a = asyncio.create_task(client.post(CHAT, json=body("x" * 10000, 5)))
    await until(lambda: state.policy.upstreams[next(iter(state.policy.upstreams))].large_in_flight == 1)
    await until(lambda: engine.running and engine.running[0].num_computed > 0)
    assert engine.running[0].prefilling
    a.cancel()
    await until(lambda: counts(state) == (0, 0, 0, 0, 0))
    await until(lambda: not engine.running and not engine.waiting)  # the simulator aborted it
    assert await large_is_admitted_at_once(client, state)
    assert sample(state.metrics.registry, "prefill_gate_requests_total",
                  {"class": "large", "outcome": "client_disconnect"}) == 1


LONG = "x" * 100_000  # an agent's tool result: over offload_body_bytes (64 KiB), read in a worker process


async def test_long_prompts_whose_clients_leave_while_queued_never_reach_the_engine(stack):
    """Five long prompts queue behind a live stream; their clients leave. They leave the
    queue at once (not when the stream ends), none reaches the engine, and the next long
    prompt is admitted the moment the stream ends, not after the abandoned ones."""
    client, state, engine, _ = stack
    cm, b_stream = await start_b(client)
    gone = [asyncio.create_task(client.post(CHAT, json=body(LONG, 5))) for _ in range(5)]
    await until(lambda: state.policy.queue_depth == 5)
    for task in gone:
        task.cancel()
    await until(lambda: state.policy.queue_depth == 0, timeout=1.0)
    assert len(engine.running) + len(engine.waiting) == 1  # B alone: no abandoned prompt reached it
    assert sample(state.metrics.registry, "prefill_gate_admissions_total",
                  {"class": "large", "decision": "cancelled"}) == 5
    nxt = asyncio.create_task(client.post(CHAT, json=body(LONG, 1, stream=False)))
    await until(lambda: state.policy.queue_depth == 1)
    await cm.__aexit__(None, None, None)  # B ends: the next long prompt goes at once
    r = await asyncio.wait_for(nxt, 30)
    assert r.status_code == 200
    assert engine.prompt_tokens_total < 2 * 100_000  # its own prefill, no abandoned one's


async def test_a_long_prompt_whose_client_leaves_while_it_prefills_is_aborted_at_once(stack):
    client, state, engine, _ = stack
    a = asyncio.create_task(client.post(CHAT, json=body(LONG, 5)))
    await until(lambda: engine.running and engine.running[0].num_computed > 0)  # ~10 s of prefill here
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    a.cancel()
    await until(lambda: not engine.running and not engine.waiting, timeout=1.0)
    assert loop.time() - t0 < 0.3  # the engine stopped computing it (its connection closed), not 10 s later
    await until(lambda: counts(state) == (0, 0, 0, 0, 0))


def watcher_tasks() -> int:
    return sum(t.get_coro().__qualname__ == "DisconnectWatch._watch" for t in asyncio.all_tasks())


async def test_disconnect_while_decoding(stack, request):
    client, state, engine, _ = stack
    cm, b_stream = await start_b(client)
    await until(lambda: counts(state)[2] == 1)
    # The simulator (plain uvicorn) watches B with a task; the proxy too unless behind its listener.
    assert watcher_tasks() == (1 if "listener" in request.node.callspec.id else 2)
    await b_stream.__anext__()  # still streaming
    await cm.__aexit__(None, None, None)
    await until(lambda: counts(state) == (0, 0, 0, 0, 0))
    await until(lambda: not engine.running)
    req_steps = engine.steps
    await asyncio.sleep(0.1)
    assert engine.steps == req_steps  # nothing left to step: no orphaned request
    assert await large_is_admitted_at_once(client, state)
    assert sample(state.metrics.registry, "prefill_gate_requests_total",
                  {"class": "interactive", "outcome": "client_disconnect"}) == 1


async def test_non_streaming_client_gone_aborts_upstream(stack):
    client, state, engine, _ = stack
    a = asyncio.create_task(client.post(CHAT, json=body("hello", 3000, stream=False)))
    await until(lambda: engine.running and engine.running[0].num_output > 2)
    a.cancel()
    await until(lambda: not engine.running and counts(state) == (0, 0, 0, 0, 0))


async def test_official_openai_client_streaming_and_not(stack):
    openai = pytest.importorskip("openai")
    client, state, engine, _ = stack
    oc = openai.AsyncOpenAI(base_url=str(client.base_url) + "/v1", api_key="unused")
    try:
        r = await oc.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens == 4 and len(r.choices[0].message.content) == 4
        text = []
        stream = await oc.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, stream=True)
        async for ev in stream:
            assert ev.usage is None  # the usage chunk the proxy asked for stays hidden
            text.extend(c.delta.content or "" for c in ev.choices)
        assert len("".join(text)) == 5
        c = await oc.completions.create(model="sim", prompt="abc", max_tokens=3)
        assert len(c.choices[0].text) == 3
        models = await oc.models.list()
        assert [m.id for m in models.data] == ["sim"]
    finally:
        await oc.close()
    assert counts(state) == (0, 0, 0, 0, 0)
