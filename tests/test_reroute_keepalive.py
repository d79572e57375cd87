"""Through the app: retry on another upstream before the first byte, SSE keep-alives
while held, and the closed loop admitting next to live decodes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import (
    CHAT,
    FakeVLLM,
    chat,
    hold_stream,
    make_state,
    proxy_client,
    response,
    sample,
    serve,
)
from prefill_gate.proxy.app import create_app

DOWN, UP = "http://down.test", "http://up.test"


def failing(fake: FakeVLLM, how: str):
    """DOWN refuses connections (or answers 503); UP is the fake vLLM."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down.test" and request.url.path.endswith("completions"):
            if how == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            return response(503, {"error": {"message": "overloaded"}})
        return await fake(request)

    return handler


async def test_unreachable_upstream_moves_the_request_and_is_marked_down(fake):
    async with proxy_client(failing(fake, "connect"), upstreams=[DOWN, UP]) as (c, state):
        for _ in range(3):
            r = await c.post(CHAT, json=chat(stream=True))
            assert r.status_code == 200 and b"data: [DONE]" in r.content
        reg = state.metrics.registry
        assert sample(reg, "prefill_gate_retries_total", {"upstream": DOWN}) == 1  # then skipped
        assert state.policy.upstreams[DOWN].healthy is False  # until a health check passes
        assert state.health[DOWN] is False
        assert sample(reg, "prefill_gate_upstream_up", {"upstream": DOWN}) == 0
        assert all(u.active == 0 and u.prefill_tokens == 0 for u in state.policy.upstreams.values())


async def test_503_before_the_first_byte_is_retried_elsewhere(fake):
    async with proxy_client(failing(fake, "503"), upstreams=[DOWN, UP]) as (c, state):
        r = await c.post(CHAT, json=chat())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab"
        assert sample(state.metrics.registry, "prefill_gate_retries_total", {"upstream": DOWN}) >= 1
        assert state.policy.upstreams[DOWN].healthy is True  # it answered: not marked down


async def test_with_one_upstream_the_error_reaches_the_client(fake):
    async with proxy_client(failing(fake, "connect"), upstreams=[DOWN]) as (c, _state):
        r = await c.post(CHAT, json=chat())
        assert r.status_code == 502 and r.json()["error"]["type"]
    async with proxy_client(failing(fake, "503"), upstreams=[DOWN]) as (c, _state):
        r = await c.post(CHAT, json=chat())
        assert r.status_code == 503 and r.json() == {"error": {"message": "overloaded"}}


async def test_held_stream_gets_keepalive_comments_then_its_answer(fake):
    async with proxy_client(fake, upstreams=[UP], sse_keepalive=0.05) as (c, state):
        b = await hold_stream(c, fake)
        a = asyncio.create_task(c.post(CHAT, json=chat("x" * 40000, stream=True)))
        await asyncio.sleep(0.3)
        assert state.policy.queue_depth == 1
        fake.release.set()
        await b
        r = await asyncio.wait_for(a, 5)
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        body = r.content
        comments = [ln for ln in body.split(b"\n") if ln.startswith(b": prefill-gate queued")]
        assert len(comments) >= 3
        assert comments[0].startswith(b": prefill-gate queued position=1 max_wait_s=")
        assert body.index(comments[-1]) < body.index(b'"content":"a"')
        assert body.endswith(b"data: [DONE]\n\n")


async def test_keepalive_then_timeout_reject_is_an_in_stream_error(fake):
    async with proxy_client(fake, upstreams=[UP], sse_keepalive=0.05, max_queue_wait=0.3,
                          on_queue_timeout="reject") as (c, state):
        b = await hold_stream(c, fake)
        r = await asyncio.wait_for(c.post(CHAT, json=chat("x" * 40000, stream=True)), 5)
        assert r.status_code == 200  # the status went out with the first keep-alive
        assert b": prefill-gate queued" in r.content
        assert b'"code":"prefill_queue_timeout"' in r.content.replace(b" ", b"")
        assert r.content.endswith(b"data: [DONE]\n\n")
        fake.release.set()
        await b
        assert state.policy.queue_depth == 0


@pytest.mark.parametrize("fail,event", [
    ("400", b'data: {"object": "error", "message": "bad thing", "code": 400}\n\n'),  # JSON: relayed as sent
    ("500", b'data: {"error": {"message": "engine dead", "type": "upstream_error", "param": null, "code": 500}}\n\n'),
])
async def test_upstream_error_after_keepalive_is_an_error_event(fake, fail, event):
    async with proxy_client(fake, upstreams=[UP], sse_keepalive=0.05) as (c, state):
        b = await hold_stream(c, fake)
        a = asyncio.create_task(c.post(CHAT, json=chat("x" * 40000, stream=True, fail=fail)))
        await asyncio.sleep(0.2)
        fake.release.set()
        await b
        r = await asyncio.wait_for(a, 5)
        assert r.status_code == 200
        assert event in r.content
        assert r.content.endswith(b"data: [DONE]\n\n")
        assert sample(state.metrics.registry, "prefill_gate_requests_total",
                      {"class": "large", "outcome": "upstream_http_error"}) == 1


async def test_without_keepalive_nothing_is_sent_while_held(fake):
    async with proxy_client(fake, upstreams=[UP]) as (c, _state):
        b = await hold_stream(c, fake)
        a = asyncio.create_task(c.post(CHAT, json=chat("x" * 40000, stream=True)))
        await asyncio.sleep(0.2)
        fake.release.set()
        await b
        r = await asyncio.wait_for(a, 5)
        assert b": prefill-gate" not in r.content


async def test_closed_loop_admits_next_to_a_smooth_stream(fake):
    async with proxy_client(fake, upstreams=[UP], itl_slo_ms=50, closed_loop_start_tokens=20000) as (c, state):
        b = await hold_stream(c, fake)
        r = await asyncio.wait_for(c.post(CHAT, json=chat("x" * 40000)), 5)  # ~10k tokens
        assert r.status_code == 200  # admitted while B still decodes
        assert sample(state.metrics.registry, "prefill_gate_admissions_total",
                      {"class": "large", "decision": "immediate"}) == 1
        assert sample(state.metrics.registry, "prefill_gate_closed_loop_budget_tokens", {"upstream": UP}) == 20000
        fake.release.set()
        await b


async def test_a_held_stream_gets_its_200_and_a_first_comment_at_once(fake):
    """With comments every 3 s, the status line used to wait 3 s for the first one."""
    state = make_state(httpx.MockTransport(fake), upstreams=[UP], sse_keepalive=3.0)
    async with serve(create_app(state, health_checks=False)) as url, httpx.AsyncClient(base_url=url) as c:
        b = await hold_stream(c, fake)
        t = asyncio.get_running_loop().time()
        async with c.stream("POST", CHAT, json=chat("x" * 40000, stream=True)) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            first = await r.aiter_raw().__anext__()
            assert first.startswith(b": prefill-gate queued position=1")
            assert asyncio.get_running_loop().time() - t < 1.0
            assert state.policy.queue_depth == 1  # still held
            fake.release.set()
        await b
