"""The simulator's OpenAI surface, through an in-memory transport."""

import json

import httpx

from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
from prefill_gate.proxy.sim.server import create_sim_app, render_chat


async def client_for(engine):
    app = create_sim_app(engine, model="sim")
    return app


def test_render_chat_counts_like_the_dummy_chatml_model():
    assert len(render_chat([{"role": "user", "content": "x" * 40}])) == 40 + 19


async def test_surface_and_cached_tokens():
    import asyncio

    engine = Engine(EngineConfig(max_num_batched_tokens=512, block_size=4), CostModel(base=0.001))
    app = create_sim_app(engine, model="sim")
    task = asyncio.create_task(engine.run())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "sim"
            tok = (await c.post("/tokenize", json={"messages": [{"role": "user", "content": "abcd"}]})).json()
            assert tok["count"] == 4 + 19
            assert (await c.post("/detokenize", json={"tokens": [104, 105]})).json() == {"prompt": "hi"}
            msgs = [{"role": "user", "content": "q" * 100}]
            r1 = (await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})).json()
            assert r1["usage"]["prompt_tokens"] == 119 and r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            r2 = (await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})).json()
            assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 116  # whole blocks of 4
            s = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}})
            events = [e for e in s.content.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 4
            assert len(events) == 4 + 2
            bad = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 0})
            assert bad.status_code == 400
            assert (await c.post("/v1/completions", content=b"{")).status_code == 400
            m = (await c.get("/metrics")).text
            assert 'vllm:num_requests_running{model_name="sim"} 0.0' in m and "vllm:num_requests_waiting" in m
            assert 'vllm:generation_tokens_total{model_name="sim"} 10.0' in m
    finally:
        task.cancel()
