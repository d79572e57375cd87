"""What an inference gateway sees through prefill-gate: vLLM's metrics with the requests the
gate holds counted as waiting (a held prompt never reaches vLLM, so a holding pod would
look idle and attract more work)."""

from __future__ import annotations

import asyncio

import httpx
from conftest import CHAT, FakeVLLM, chat, hold_stream, proxy_client, response

from prefill_gate.proxy.gateway import add_held

PAGE = (b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        b"# TYPE vllm:num_requests_waiting gauge\n"
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


def test_held_requests_are_added_to_waiting_and_nothing_else_changes():
    out = add_held(PAGE, 3)
    assert b'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0\n' in out
    assert out.replace(b"5.0", b"2.0") == PAGE
    assert add_held(PAGE, 0) == PAGE
    assert add_held(b"vllm:num_requests_waiting 0\n", 1) == b"vllm:num_requests_waiting 1.0\n"


class WithMetrics(FakeVLLM):
    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return response(200, text=PAGE.decode())
        return await super().__call__(request)


async def test_a_held_prompt_shows_as_waiting_at_vllm_metrics():
    fake = WithMetrics()
    async with proxy_client(fake, large_prefill_tokens=1000) as (c, state):
        r = await c.get("/vllm/metrics")
        assert r.status_code == 200 and b'model_name="m"} 2.0' in r.content
        b = await hold_stream(c, fake)
        held = asyncio.create_task(c.post(CHAT, json=chat("x" * 40_000)))
        await asyncio.sleep(0.1)
        assert state.policy.queue_depth == 1
        r = await c.get("/vllm/metrics")
        assert b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0' in r.content
        assert b"vllm:kv_cache_usage_perc" in r.content  # the rest of vLLM's page, as it was
        fake.release.set()
        await asyncio.gather(b, held)


async def test_vllm_metrics_needs_one_upstream_that_answers():
    fake = FakeVLLM()  # its /metrics is not vLLM's: 200 with JSON, still relayed; a failing one is not
    async with proxy_client(fake, upstreams=["http://a.test", "http://b.test"]) as (c, _):
        assert (await c.get("/vllm/metrics")).status_code == 404

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with proxy_client(down) as (c, _):
        r = await c.get("/vllm/metrics")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
