"""Fuzzing the proxy's HTTP surface with hypothesis: bodies, headers, methods and paths.

Bodies are arbitrary JSON, raw bytes, or a valid request with any of its fields replaced by
arbitrary JSON (the shapes that get furthest into the proxy). The upstream behind it acts
like vLLM: it answers what it understands and returns a 400 for what it does not. Every
answer must be well formed and quick; a 5xx may only be one the upstream sent; afterwards
nothing is held (no queue, no live decode, no in-flight request).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
from conftest import FakeVLLM, proxy_client, response
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefill_gate.proxy.openapi import ChatCompletionRequest, CompletionRequest

SCHEMAS = {path: jsonschema_rs.validator_for(model.model_json_schema()) for path, model in
           (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest))}
VLLM_400 = {"error": {"message": "invalid request", "type": "BadRequestError", "param": None, "code": 400}}  # 0.26's shape

KEYS = st.text(min_size=1, max_size=12).filter(lambda k: k not in ("fail", "hold", "usage_prompt_tokens"))
SCALARS = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=40)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
                    max_leaves=20)
FIELDS = ("model", "messages", "prompt", "stream", "stream_options", "max_tokens", "priority", "temperature", "n",
          "tools")


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(("valid-mutated", "json", "bytes")))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    body = {"model": "m", "messages": [{"role": "user", "content": draw(st.text(max_size=200))}],
            "prompt": "hi", "stream": draw(st.booleans()), "max_tokens": 4}
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body[field] = draw(JSON)
    return json.dumps(body).encode()


HEADERS = st.dictionaries(
    st.sampled_from(("x-prefill-gate-class", "x-prefill-gate-priority", "content-type", "x-other")),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20), max_size=3)
GATED = st.tuples(st.just("POST"), st.sampled_from(("/v1/chat/completions", "/v1/completions")), bodies(), HEADERS)
OTHER = st.tuples(
    st.sampled_from(("POST", "GET", "PUT", "DELETE", "PATCH")),
    st.sampled_from(("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/health", "/metrics"))
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyz/_-.%", max_size=20).map(lambda p: "/v1/" + p),
    bodies(), HEADERS)
# Mostly the gated endpoints, where the proxy itself parses and acts on the body.
REQUESTS = st.sampled_from((GATED, GATED, GATED, OTHER)).flatmap(lambda s: s)


class LikeVLLM(FakeVLLM):
    """FakeVLLM, a 400 for whatever body it cannot make sense of (as vLLM validates), and
    vLLM's 405 for another method on its completion endpoints."""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("completions") and request.method != "POST":
            return response(405, {"detail": "Method Not Allowed"}, headers={"allow": "POST"})
        if path in SCHEMAS:  # vLLM validates its request models; these are the proxy's documented ones
            try:
                SCHEMAS[path].validate(json.loads(request.content))
            except (ValueError, jsonschema_rs.ValidationError):
                return response(400, VLLM_400)
        try:
            return await super().__call__(request)
        except (ValueError, TypeError, AttributeError, KeyError):
            return response(400, VLLM_400)


def test_no_input_makes_the_proxy_fail_hang_or_leak():
    loop = asyncio.new_event_loop()
    upstream = LikeVLLM()
    ctx = proxy_client(upstream)
    client, state = loop.run_until_complete(ctx.__aenter__())
    seen = {"4xx": 0, "2xx": 0}
    try:
        @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
        @given(REQUESTS)
        def one(req):
            method, path, body, headers = req
            before = len(upstream.requests)
            r = loop.run_until_complete(asyncio.wait_for(
                client.request(method, path, content=body if method != "GET" else None, headers=headers), 10))
            if r.status_code >= 500:
                # only an upstream's own 5xx passes through; the fake never sends one here
                raise AssertionError(f"{method} {path} -> {r.status_code}: {r.text[:300]}")
            if 400 <= r.status_code < 500:
                seen["4xx"] += 1
                if len(upstream.requests) == before or not r.headers.get("content-type", "").startswith(
                        "application/json") or "error" not in r.text:
                    err = r.json().get("error") if r.headers.get("content-type", "").startswith(
                        "application/json") else None
                    # the proxy's own errors are OpenAI-shaped; FastAPI's 404/405 for unknown
                    # routes carry "detail"
                    assert (isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}) or \
                        "detail" in r.json(), r.text[:300]
            else:
                seen["2xx"] += 1
                r.read()

        one()
        snap = state.policy.snapshot()
        assert state.policy.queue_depth == 0
        assert all(u.active == 0 and u.live_decodes == 0 and u.large_in_flight == 0 for u in snap.upstreams.values())
        assert upstream.open_streams == 0
        assert seen["4xx"] > 50 and seen["2xx"] > 20, seen  # the fuzz reached both sides
    finally:
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        loop.close()
