"""protect_non_streaming: stream upstream, see the phase, answer with assembled JSON."""

import asyncio
import json

from conftest import UPSTREAM, proxy_client
from prefill_gate.proxy.assemble import Assembler, convertible

CHAT = "/v1/chat/completions"


def test_assembler_merges_content_reasoning_and_tool_calls():
    a = Assembler("chat")
    a.add({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    a.add({"choices": [{"index": 0, "delta": {"reasoning_content": "think "}}]})
    a.add({"choices": [{"index": 0, "delta": {"content": "he"}}, {"index": 1, "delta": {"content": "x"}}]})
    a.add({"choices": [{"index": 0, "delta": {"content": "llo", "tool_calls": [
        {"index": 0, "id": "t1", "function": {"name": "get", "arguments": '{"a"'}}]}}]})
    a.add({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                        "finish_reason": "tool_calls"}]})
    a.add({"choices": [], "usage": {"prompt_tokens": 3}})
    r = a.response()
    assert r["id"] == "c" and r["object"] == "chat.completion" and r["usage"] == {"prompt_tokens": 3}
    m = r["choices"][0]["message"]
    assert m["content"] == "hello" and m["reasoning_content"] == "think "
    assert m["tool_calls"] == [{"type": "function", "id": "t1", "function": {"name": "get", "arguments": '{"a": 1}'}}]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and r["choices"][1]["message"]["content"] == "x"


def test_completions_and_what_is_not_converted():
    a = Assembler("completions")
    a.add({"id": "t", "choices": [{"index": 0, "text": "ab"}]})
    a.add({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]})
    assert a.response()["choices"][0]["text"] == "abc"
    assert convertible({}) and not convertible({"logprobs": True}) and not convertible({"stream": True})


async def test_protected_non_streaming_request_holds_a_large_prefill(fake):
    async with proxy_client(fake, protect_non_streaming=True) as (c, state):
        b = asyncio.create_task(c.post(CHAT, json={"messages": [{"role": "user", "content": "b"}], "hold": True}))
        await asyncio.wait_for(fake.first_token.wait(), 5)
        await asyncio.sleep(0.05)
        assert state.policy.upstreams[UPSTREAM].live_decodes == 1  # the proxy sees its decode phase
        assert fake.bodies[0]["stream"] is True
        a = asyncio.create_task(c.post(CHAT, json={"messages": [{"role": "user", "content": "x" * 40000}]}))
        await asyncio.sleep(0.05)
        assert state.policy.queue_depth == 1
        fake.release.set()
        rb, ra = await b, await asyncio.wait_for(a, 5)
        body = rb.json()
        assert rb.status_code == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == "ab" and body["usage"]["prompt_tokens"] == 19
        assert ra.status_code == 200 and rb.headers["content-type"] == "application/json"


async def test_without_the_setting_non_streaming_is_not_protected(fake):
    async with proxy_client(fake) as (c, state):
        b = asyncio.create_task(c.post(CHAT, json={"messages": [{"role": "user", "content": "b"}], "hold": True,
                                                   "stream": False}))
        await asyncio.wait_for(fake.first_token.wait(), 5)
        a = await asyncio.wait_for(c.post(CHAT, json={"messages": [{"role": "user", "content": "x" * 40000}]}), 5)
        assert a.status_code == 200 and not b.done()  # admitted while B still generates: B is not protected
        fake.release.set()
        await b


async def test_assembled_request_failing_mid_generation_is_a_502(fake):
    async with proxy_client(fake, protect_non_streaming=True) as (c, state):
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "b"}], "fail": "midstream"})
        assert r.status_code == 502 and json.loads(r.content)["error"]["code"] == "upstream_protocol_error"
        assert state.policy.upstreams[UPSTREAM].active == 0
