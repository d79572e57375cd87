"""The proxy app through in-memory transports, against a fake vLLM-like upstream."""

import asyncio
import json

import httpx
import pytest
from conftest import (
    CHAT,
    UPSTREAM,
    FakeVLLM,
    chat,
    hold_stream,
    make_state,
    proxy_client,
    sample,
    serve,
)

from prefill_gate.proxy.bodies import with_member


async def test_non_streaming_passes_through_with_unknown_fields_untouched(fake):
    async with proxy_client(fake) as (c, state):
        body = chat(ignore_eos=True, priority=3, chat_template_kwargs={"enable_thinking": False})
        raw = json.dumps(body).encode()
        r = await c.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ab"
        assert fake.requests[-1].content == raw  # not re-serialised, byte for byte
        assert sample(state.metrics.registry, "prefill_gate_requests_total",
                      {"class": "interactive", "outcome": "completed"}) == 1


async def test_streaming_relays_events_and_hides_the_usage_chunk_it_asked_for(fake):
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, json=chat(stream=True, ignore_eos=True))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert not any(b'"usage"' in e for e in events)
        assert [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]] == ["", "a", "b"]
        sent = fake.bodies[-1]
        assert sent["stream_options"] == {"include_usage": True} and sent["ignore_eos"] is True
        reg = state.metrics.registry
        assert sample(reg, "prefill_gate_ttft_seconds_count", {"class": "interactive"}) == 1
        assert sample(reg, "prefill_gate_itl_seconds_count",
                      {"class": "interactive", "large_prefill_in_flight": "false"}) == 1
        assert sample(reg, "prefill_gate_estimate_relative_error_count") == 1


async def test_asking_for_usage_keeps_the_clients_bytes(fake):
    """The usage the proxy asks for on a stream is appended to the client's JSON as it came
    (a prompt's non-ASCII text stays UTF-8, not re-encoded as \\u escapes); a body whose
    stream_options exist but lack include_usage is re-encoded with it added."""
    raw = b'{"model":"m","stream":true, "messages":[{"role":"user","content":"gr\xc3\xbc\xc3\x9fe"}]}\n'
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200
        assert fake.requests[-1].content == raw.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'
        r = await c.post(CHAT, json=chat(stream=True, stream_options={"continuous_usage_stats": False}))
        assert r.status_code == 200
        assert fake.bodies[-1]["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_with_member_appends_to_plain_utf8_objects_only():
    member = b'"k":1'
    assert json.loads(with_member(b' {"a": [1, {}]} \r\n', member)) == {"a": [1, {}], "k": 1}
    assert with_member(b"{ }", member) == b'{"k":1}'
    assert with_member('{"a": 1}'.encode("utf-16"), member) is None
    assert with_member(b'["not an object"]', member) is None


async def test_streaming_forwards_usage_when_the_client_asked(fake):
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, json=chat(stream=True, stream_options={"include_usage": True}))
        assert b'"usage":{"prompt_tokens"' in r.content


async def test_completions_endpoint_goes_through_the_gate(fake):
    async with proxy_client(fake) as (c, state):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x" * 40000, "max_tokens": 2})
        assert r.status_code == 200
        assert sample(state.metrics.registry, "prefill_gate_admissions_total",
                      {"class": "large", "decision": "immediate"}) == 1


@pytest.mark.parametrize(
    "raw, param, fragment",
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (json.dumps({"model": "m"}).encode(), "messages", "required"),
        (json.dumps({"messages": "hi"}).encode(), "messages", "must be list"),
        (json.dumps({"messages": ["hi"]}).encode(), "messages", "messages[0] must be an object"),
        (json.dumps(chat(stream="yes")).encode(), "stream", "must be bool"),
        (json.dumps(chat(max_tokens="10")).encode(), "max_tokens", "must be int"),
        (json.dumps(chat(max_tokens=True)).encode(), "max_tokens", "must be int"),
        (json.dumps(chat(priority=1.5)).encode(), "priority", "must be int"),
        (json.dumps({**chat(), "model": 7}).encode(), "model", "must be str"),
    ],
)
async def test_bad_input_is_400_openai_shaped(fake, raw, param, fragment):
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert fragment in err["message"] and err["param"] == param
        assert fake.bodies == []  # nothing reached the upstream
        assert sample(state.metrics.registry, "prefill_gate_requests_total",
                      {"class": "interactive", "outcome": "bad_request"}) == 1


async def test_completions_needs_a_prompt(fake):
    async with proxy_client(fake) as (c, _):
        r = await c.post("/v1/completions", json={"model": "m"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("header, value", [("x-prefill-gate-class", "huge"), ("x-prefill-gate-priority", "high")])
async def test_bad_gate_headers_are_400(fake, header, value):
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, json=chat(), headers={header: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == header


async def test_body_over_the_limit_is_413_declared_or_streamed(fake):
    async with proxy_client(fake, max_body_bytes=2048) as (c, _):
        r = await c.post(CHAT, json=chat("x" * 5000))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks():
            for _ in range(10):
                yield b" " * 500

        r = await c.post(CHAT, content=chunks())  # no content-length: counted while read
        assert r.status_code == 413


@pytest.mark.parametrize(
    "fail, status, code, kind",
    [("connect", 502, "upstream_unavailable", "connect"), ("timeout", 504, "upstream_timeout", "timeout")],
)
async def test_upstream_failures_before_the_first_byte(fake, fail, status, code, kind):
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, json=chat(fail=fail, stream=True))
        assert r.status_code == status and r.json()["error"]["code"] == code
        reg = state.metrics.registry
        assert sample(reg, "prefill_gate_upstream_errors_total", {"upstream": UPSTREAM, "kind": kind}) == 1
        assert sample(reg, "prefill_gate_requests_total", {"class": "interactive", "outcome": "upstream_error"}) == 1
        assert state.health.get(UPSTREAM, True) is (fail != "connect")  # refused: marked down until a check passes
        assert state.policy.upstreams[UPSTREAM].active == 0


@pytest.mark.parametrize("fail, status, body, kind", [("400", 400, b'"bad thing"', "http_4xx"),
                                                       ("500", 500, b"engine dead", "http_5xx")])
async def test_upstream_error_bodies_pass_through_unchanged(fake, fail, status, body, kind):
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, json=chat(fail=fail, stream=True))
        assert r.status_code == status and body in r.content
        assert sample(state.metrics.registry, "prefill_gate_upstream_errors_total",
                      {"upstream": UPSTREAM, "kind": kind}) == 1


@pytest.mark.parametrize("fail, fragment", [("midstream", b"broke the connection"), ("no_done", b"before [DONE]")])
async def test_failure_after_the_first_byte_is_an_in_stream_error_and_a_clean_end(fake, fail, fragment):
    async with proxy_client(fake) as (c, state):
        r = await c.post(CHAT, json=chat(fail=fail, stream=True))
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert fragment.decode() in err["message"] and err["code"] == "upstream_protocol_error"
        assert state.policy.upstreams[UPSTREAM].live_decodes == 0


async def test_large_prefill_waits_for_the_live_decode_then_runs(fake):
    async with proxy_client(fake) as (c, state):
        b = await hold_stream(c, fake)
        assert state.policy.upstreams[UPSTREAM].live_decodes == 1
        a = asyncio.create_task(c.post(CHAT, json=chat("x" * 40000)))
        await asyncio.sleep(0.1)
        assert state.policy.queue_depth == 1 and not a.done()
        small = await c.post(CHAT, json=chat("quick"))  # small prompts never wait
        assert small.status_code == 200
        fake.release.set()
        assert (await b).status_code == 200
        assert (await asyncio.wait_for(a, 5)).status_code == 200
        reg = state.metrics.registry
        assert sample(reg, "prefill_gate_admissions_total", {"class": "large", "decision": "after_wait"}) == 1
        assert sample(reg, "prefill_gate_queue_wait_seconds_count", {"decision": "after_wait"}) == 1
        assert sample(reg, "prefill_gate_queue_depth") == 0


async def test_class_and_priority_headers(fake):
    async with proxy_client(fake) as (c, state):
        b = await hold_stream(c, fake)
        lo = asyncio.create_task(c.post(CHAT, json=chat(), headers={"x-prefill-gate-class": "large",
                                                                     "x-prefill-gate-priority": "5"}))
        await asyncio.sleep(0.05)
        hi = asyncio.create_task(c.post(CHAT, json=chat(priority=-1), headers={"x-prefill-gate-class": "large"}))
        await asyncio.sleep(0.05)
        assert [t.priority for t in state.policy.queued()] == [-1, 5]
        fake.release.set()
        await asyncio.gather(b, lo, hi)
        assert "x-prefill-gate-class" not in fake.requests[-1].headers


async def test_queue_full_is_429_with_retry_after(fake):
    async with proxy_client(fake, max_queue=1, max_queue_wait=20) as (c, state):
        b = await hold_stream(c, fake)
        a1 = asyncio.create_task(c.post(CHAT, json=chat("x" * 40000)))
        await asyncio.sleep(0.05)
        r = await c.post(CHAT, json=chat("y" * 40000))
        assert r.status_code == 429 and r.json()["error"]["code"] == "prefill_queue_full"
        assert 19 <= int(r.headers["retry-after"]) <= 20
        fake.release.set()
        await asyncio.gather(b, a1)
        assert sample(state.metrics.registry, "prefill_gate_requests_total",
                      {"class": "large", "outcome": "rejected"}) == 1


@pytest.mark.parametrize("policy, status", [("reject", 503), ("admit", 200)])
async def test_wait_bound(fake, policy, status):
    async with proxy_client(fake, max_queue_wait=0.2, on_queue_timeout=policy) as (c, state):
        b = await hold_stream(c, fake)
        r = await asyncio.wait_for(c.post(CHAT, json=chat("x" * 40000)), 5)
        assert r.status_code == status
        if status == 503:
            assert r.json()["error"]["code"] == "prefill_queue_timeout"
        decision = "rejected_timeout" if policy == "reject" else "after_timeout"
        assert sample(state.metrics.registry, "prefill_gate_admissions_total",
                      {"class": "large", "decision": decision}) == 1
        fake.release.set()
        await b


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/version"),
                                          ("POST", "/v1/embeddings"), ("DELETE", "/v1/files/abc")])
async def test_passthrough_paths(fake, method, path):
    async with proxy_client(fake) as (c, _):
        body = b'{"prompt": "hello"}' if method == "POST" else b""
        r = await c.request(method, path, content=body, headers={"x-custom": "1"})
        sent = fake.requests[-1]
        assert sent.method == method and sent.url.path == path and sent.headers["x-custom"] == "1"
        assert sent.content == body and str(sent.url).startswith(UPSTREAM)
        if path == "/tokenize":
            assert r.json() == {"count": 5 + 19}


async def test_upstream_key_replaces_the_client_authorization(fake):
    async with proxy_client(fake, upstream_api_key="sk-upstream") as (c, _):
        r = await c.post(CHAT, json=chat(), headers={"authorization": "Bearer client-key"})
        assert r.status_code == 200
        assert fake.requests[-1].headers["authorization"] == "Bearer sk-upstream"
        assert b"sk-upstream" not in r.content and "sk-upstream" not in str(r.headers)


async def test_health_and_metrics(fake):
    async with proxy_client(fake) as (c, state):
        h = (await c.get("/health")).json()  # no health check has run: not known to be healthy
        assert h["status"] == "no_upstream_passing" and h["upstreams"][UPSTREAM]["healthy"] is None
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        state.mark_health(UPSTREAM, True)
        h = (await c.get("/health")).json()
        assert h["status"] == "ok" and h["upstreams"][UPSTREAM]["healthy"] is True
        assert (await c.get("/ready")).status_code == 200
        state.mark_health(UPSTREAM, False)
        assert (await c.get("/ready")).status_code == 503
        assert (await c.get("/health")).status_code == 200  # liveness: the proxy itself answers
        state.mark_health(UPSTREAM, True)
        text = (await c.get("/metrics")).text
        for name in ("prefill_gate_requests_total", "prefill_gate_queue_depth", "prefill_gate_itl_seconds_bucket",
                     "prefill_gate_live_decodes", "prefill_gate_inflight_prefill_tokens",
                     "prefill_gate_upstream_errors_total", "prefill_gate_estimate_relative_error_bucket"):
            assert name in text
        assert 'prefill_gate_requests_total{class="large",outcome="rejected"} 0.0' in text  # pre-initialised


async def test_calibration_from_usage_moves_the_ratio(fake):
    async with proxy_client(fake) as (c, state):
        for _ in range(state.estimator.calibrator.MIN_SAMPLES):
            await c.post(CHAT, json=chat("z" * 4000, usage_prompt_tokens=4008))
        assert state.estimator.calibrator.ratio("m") == pytest.approx(1.0)
        assert sample(state.metrics.registry, "prefill_gate_bytes_per_token") == pytest.approx(1.0)


async def test_headers_over_the_limit_are_431_on_every_path(fake):
    async with proxy_client(fake, max_header_bytes=4096) as (c, _):
        big = {"x-filler": "y" * 5000}
        for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/health")):
            r = await c.request(method, path, json=chat() if method == "POST" else None, headers=big)
            assert r.status_code == 431, path
            assert r.json()["error"]["code"] == "headers_too_large" and "max_header_bytes" in r.json()["error"]["message"]
        assert fake.requests == []  # nothing reached the upstream
        r = await c.post(CHAT, json=chat(), headers={"x-filler": "y" * 1000})
        assert r.status_code == 200


async def test_oversized_headers_over_a_real_socket():
    """uvicorn hands the proxy a 200 KB header block; the proxy answers 431, not 5xx."""
    from prefill_gate.proxy.app import create_app

    state = make_state(httpx.MockTransport(FakeVLLM()))
    async with serve(create_app(state, health_checks=False)) as url, httpx.AsyncClient() as c:
        r = await c.get(url + "/health", headers={"x-filler": "y" * 200_000})
        assert r.status_code == 431
        assert (await c.get(url + "/health")).status_code == 200


async def test_integral_floats_are_integers_as_for_vllm(fake):
    """JSON Schema and vLLM's validation take 5.0 for an integer; so does the gate."""
    async with proxy_client(fake) as (c, _):
        r = await c.post(CHAT, json={**chat(), "max_tokens": 5.0, "priority": 2.0})
        assert r.status_code == 200
        assert fake.bodies[-1]["max_tokens"] == 5.0  # passed on unchanged
        r = await c.post(CHAT, json={**chat(), "max_tokens": 5.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_an_upstream_cookie_goes_to_its_client_only(fake):
    """One upstream client serves every request: it must not keep an upstream's Set-Cookie."""
    original = fake.__call__

    async def with_cookie(request):
        r = await original(request)
        if request.url.path == "/v1/models":
            r.headers["set-cookie"] = "session=alice; Path=/"
        return r

    fake.__call__ = with_cookie
    async with proxy_client(with_cookie) as (c, _):
        r = await c.get("/v1/models")
        assert r.headers["set-cookie"] == "session=alice; Path=/"  # passed back to its client
        c.cookies.clear()  # another client, without alice's cookie
        assert (await c.post(CHAT, json=chat())).status_code == 200
        assert (await c.get("/v1/models", headers={"cookie": "mine=1"})).status_code == 200
    sent = [req.headers.get("cookie") for req in fake.requests]
    assert sent[-2] is None and sent[-1] == "mine=1"  # only a client's own cookie reaches upstream
