"""Faults against real processes: the upstream dies mid-stream and comes back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from proxy.bench.services import Service

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"


async def stream(url: str, max_tokens: int, started: asyncio.Event | None = None) -> list[bytes]:
    body = {"model": "sim", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello"}]}
    events = []
    async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(line.encode())
                if started is not None and len(events) >= 5:
                    started.set()
    return events


async def test_upstream_killed_mid_stream_then_back_without_a_proxy_restart():
    sim = Service("sim", name="sim")
    port = sim.port
    try:
        with Service("serve", "--upstream", sim.url, "--health-interval", "0.2", "--log-level", "warning",
                     name="proxy") as proxy:
            started = asyncio.Event()
            task = asyncio.create_task(stream(proxy.url, 3000, started))
            await asyncio.wait_for(started.wait(), 10)
            sim.kill()  # SIGKILL: the connection drops mid-stream
            events = await asyncio.wait_for(task, 10)
            assert events[-1] == b"data: [DONE]"
            error = json.loads(events[-2][5:])["error"]
            assert error["type"] == "server_error" and error["code"] == "upstream_protocol_error"

            async with httpx.AsyncClient(timeout=10) as c:
                await asyncio.sleep(0.6)  # a health check or two fail
                health = (await c.get(proxy.url + "/health")).json()
                assert health["upstreams"][sim.url]["healthy"] is False
                down = await c.post(proxy.url + CHAT, json={"model": "sim", "messages": [
                    {"role": "user", "content": "anyone?"}], "max_tokens": 4})
                assert down.status_code == 502 and down.json()["error"]["code"] == "upstream_unavailable"

                sim = Service("sim", name="sim", port=port)  # the upstream returns on its address
                for _ in range(50):
                    if (await c.get(proxy.url + "/health")).json()["upstreams"][sim.url]["healthy"]:
                        break
                    await asyncio.sleep(0.1)
                events = await stream(proxy.url, 20)
                assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)
                health = (await c.get(proxy.url + "/health")).json()
                up = health["upstreams"][sim.url]
                assert up["healthy"] and up["live_decodes"] == 0 and up["active"] == 0
                assert health["queue_depth"] == 0
    finally:
        sim.stop()
