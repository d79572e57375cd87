"""Shared fixtures: a fake vLLM-like upstream (httpx.MockTransport), the app on an
in-memory transport, and real uvicorn servers on loopback for disconnect tests."""

from __future__ import annotations

import os

# Triton kernels run in Triton's interpreter on the CPU. It must be chosen before anything
# imports Triton (vLLM does, for the engine tests). On a GPU: TRITON_INTERPRET=0 pytest -m gpu.
os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio
import contextlib
import json
import socket

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

# The relay's compiled core built apart (tests/test_relaycore_asan.py: with AddressSanitizer),
# loaded in place of the installed one before anything imports it.
if os.environ.get("PREFILL_GATE_RELAYCORE_SO"):
    import importlib.machinery
    import importlib.util
    import sys

    _loader = importlib.machinery.ExtensionFileLoader("prefill_gate.proxy._relaycore",
                                                      os.environ["PREFILL_GATE_RELAYCORE_SO"])
    _core = importlib.util.module_from_spec(importlib.util.spec_from_loader(_loader.name, _loader))
    _loader.exec_module(_core)
    sys.modules[_loader.name] = _core

from prefill_gate.proxy.app import build_state, create_app  # noqa: E402
from prefill_gate.proxy.settings import load_settings  # noqa: E402
from prefill_gate.proxy.state import AppState  # noqa: E402

UPSTREAM = "http://vllm.test"
CHAT = "/v1/chat/completions"
RELAY_CORES = ["compiled", "python"]  # relay_core settings the relay's tests run under


def compiled_core():
    """prefill_gate.proxy._relaycore (the relay's compiled core). Where the install could not build it the
    test is skipped, or fails with PREFILL_GATE_REQUIRE_COMPILED=1 (scripts/test.sh sets it:
    CI builds it)."""
    from prefill_gate.proxy.relaycore import compiled_module

    core = compiled_module()
    if isinstance(core, ImportError):
        if os.environ.get("PREFILL_GATE_REQUIRE_COMPILED") == "1":
            pytest.fail(f"the compiled relay core did not import: {core}")
        pytest.skip(f"the compiled relay core is not built here ({core})")
    return core


def chat(content="hi", **extra) -> dict:
    """A chat body; unknown fields (``stream``, ``hold``, ``fail``...) drive FakeVLLM."""
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(content, finish=None):
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def response(status: int, json_body=None, text: str | None = None, headers=None) -> httpx.Response:
    """A response whose body arrives as a stream, as from a real connection."""
    data = json.dumps(json_body).encode() if json_body is not None else (text or "").encode()
    ctype = "application/json" if json_body is not None else "text/plain"

    async def body():
        yield data

    return httpx.Response(status, headers={"content-type": ctype, **(headers or {})}, content=body())


def _text(content) -> str:
    """A message's text: a string, or the text of its content parts."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


class FakeVLLM:
    """Answers like vLLM. Unknown body fields drive it: ``hold`` keeps a stream open
    after its first token until ``release`` is set; ``fail`` picks a failure."""

    def __init__(self):
        self.release = asyncio.Event()
        self.requests: list[httpx.Request] = []
        self.bodies: list[dict] = []
        self.open_streams = 0
        self.first_token = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/health":
            return response(200)
        if path == "/v1/models":
            return response(200, {"object": "list", "data": [{"id": "m"}]})
        if path == "/tokenize":
            body = json.loads(request.content)
            text = "".join(m["content"] for m in body.get("messages", [])) or body.get("prompt", "")
            return response(200, {"count": len(text) + 19})
        if path == "/version":
            return response(200, {"version": "0.26.0"})
        if not path.endswith("completions"):
            return response(200, {"path": path, "method": request.method})
        body = json.loads(request.content)
        self.bodies.append(body)
        fail = body.get("fail")
        if fail == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if fail == "timeout":
            raise httpx.ReadTimeout("silent", request=request)
        if fail == "400":
            return response(400, {"object": "error", "message": "bad thing", "code": 400})
        if fail == "500":
            return response(500, text="engine dead")
        # Like vLLM: the prompt's tokens (here ~4 characters each, plus a template's 19 per
        # message) unless a test dictates them.
        text = "".join(_text(m.get("content")) for m in body.get("messages", [])) or str(body.get("prompt", ""))
        counted = len(text) // 4 + 19 * max(1, len(body.get("messages", [])))
        usage = {"prompt_tokens": body.get("usage_prompt_tokens", counted), "completion_tokens": 2,
                 "total_tokens": body.get("usage_prompt_tokens", counted) + 2}
        if "usage_cached_tokens" in body:
            usage["prompt_tokens_details"] = {"cached_tokens": body["usage_cached_tokens"]}
        if not body.get("stream"):
            if body.get("hold"):
                self.first_token.set()
                await self.release.wait()
            return response(200, {"id": "x", "object": "chat.completion", "model": "m", "usage": usage,
                                  "choices": [{"index": 0, "message": {"content": "ab"}}]})
        include_usage = (body.get("stream_options") or {}).get("include_usage")

        async def stream():
            self.open_streams += 1
            try:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                yield sse(chunk("a"))
                self.first_token.set()
                if body.get("hold"):
                    await self.release.wait()
                if fail == "midstream":
                    raise httpx.ReadError("connection reset")
                yield sse(chunk("b", finish="length"))
                if include_usage:
                    yield sse({"choices": [], "usage": usage})
                if fail != "no_done":
                    yield b"data: [DONE]\n\n"
            finally:
                self.open_streams -= 1

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())


def make_state(transport=None, **settings):
    settings.setdefault("upstreams", [UPSTREAM])
    s = load_settings(settings, environ={})
    return build_state(s, registry=CollectorRegistry(), transport=transport)


@pytest.fixture
def fake():
    return FakeVLLM()


@contextlib.asynccontextmanager
async def proxy_client(fake, **settings):
    """The app on an in-memory ASGI transport, over the fake upstream: (client, state)."""
    state = make_state(httpx.MockTransport(fake), **settings)
    app = create_app(state, health_checks=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy.test") as client:
            yield client, state
    finally:
        state.bodies.close()  # (the lifespan's part, which the in-memory transport does not run)


SHUTDOWN_BOUND_S = 10.0  # serve's bound on the server's graceful shutdown


@contextlib.asynccontextmanager
async def serve(app, settings=None, *, plain=False):
    """A real uvicorn server on a free loopback port, in this event loop. The proxy's app
    (or any app, given ``settings``) behind the proxy's listener, configured as
    ``prefill-gate serve`` configures it; ``plain``: behind uvicorn's own protocol."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if settings is None and not plain and isinstance(getattr(app, "state", None), AppState):
        settings = app.state.settings
    if settings is None or plain:
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
    else:
        from prefill_gate.proxy.listener import server_config

        config = server_config(app, settings, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            # A graceful shutdown waits for every request under way; a test that failed
            # mid-request would otherwise hang here instead of reporting its failure.
            done, _ = await asyncio.wait([task], timeout=SHUTDOWN_BOUND_S)
            if not done:
                server.force_exit = True
                await task
                raise AssertionError(f"the server still had requests under way {SHUTDOWN_BOUND_S} s after "
                                     "the test asked it to stop; forced")
        finally:
            sock.close()


def sample(registry, name, labels=None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


async def hold_stream(c: httpx.AsyncClient, fake: FakeVLLM, body: dict | None = None) -> asyncio.Task:
    """Start a streaming request that stays in its decode phase until fake.release is set."""
    task = asyncio.create_task(c.post(CHAT, json=body or chat(stream=True, hold=True)))
    await asyncio.wait_for(fake.first_token.wait(), 5)
    await asyncio.sleep(0.05)
    return task


async def stream_events(url: str, max_tokens: int, content: str = "hello",
                        started: asyncio.Event | None = None) -> list[bytes]:
    """Stream a chat answer from a real server (the simulator, or the proxy in front of it);
    its ``data:`` lines. ``started`` is set once five of them have arrived."""
    body = {"model": "sim", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}]}
    events = []
    async with httpx.AsyncClient(timeout=60) as c, c.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(line.encode())
                if started is not None and len(events) >= 5:
                    started.set()
    return events


def children_of(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid`` (Linux's /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
