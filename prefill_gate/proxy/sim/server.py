"""A vLLM-like OpenAI server around the simulated engine.

Endpoints: /v1/chat/completions and /v1/completions (streaming or not), /v1/models,
/tokenize, /detokenize, /version, /health, /metrics (vLLM's names for running and
waiting requests). Tokens are characters, as with the project's dummy model on the
GPU: one character is one token; a chat message adds ChatML's markers (8 tokens
for a "user" message, 11 for the generation prompt). The model never stops early
(as with ``ignore_eos``): it writes ``max_tokens`` tokens. A client that
disconnects aborts its request, which frees its place in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import string
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ... import __version__
from ... import engine_info
from ..disconnect import DisconnectWatch
from . import refusals
from .engine import Engine, SimRequest

IM_START, IM_END = 0x110000, 0x110001  # special tokens: outside Unicode, one token each
SPECIAL_TEXT = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
DEFAULT_MAX_TOKENS = 16
# vLLM's own bucket edges for its TTFT and inter-token histograms are finer; these suffice.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ALPHABET = string.ascii_letters + string.digits + " "


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def render_chat(messages: list, add_generation_prompt: bool = True) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids.append(IM_START)
        ids.extend(map(ord, f"{m.get('role', 'user')}\n{_text(m.get('content'))}"))
        ids.append(IM_END)
        ids.append(ord("\n"))
    if add_generation_prompt:
        ids.append(IM_START)
        ids.extend(map(ord, "assistant\n"))
    return ids


def encode_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(map(ord, prompt))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return list(map(ord, prompt[0]))
    raise ValueError("prompt must be a string, a list of strings or a list of token ids")


def decode(ids: list[int]) -> str:
    return "".join(SPECIAL_TEXT.get(i) or chr(i) for i in ids)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}},
                        status_code=status)


class _EngineResponse(Response):
    """Sends one request's tokens (SSE, or one JSON body at the end) and aborts the
    request the moment the client goes away, as vLLM does."""

    def __init__(self, engine: Engine, req: SimRequest, render, stream: bool):
        self.engine, self.req, self.render, self.stream = engine, req, render, stream
        self.background = None
        self.status_code = 200

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with DisconnectWatch(receive, send) as watch:
                await self._send_tokens(send, watch)
        except OSError:  # the socket closed under a send: the client is gone
            pass
        finally:
            self.engine.abort(self.req)  # a no-op for a finished request

    async def _send_tokens(self, send, watch: DisconnectWatch) -> None:
        if not self.stream:
            while await self.req.events.get() is not None:
                pass
            body = json.dumps(self.render.whole()).encode()
            watch.closing = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        while (index := await self.req.events.get()) is not None:
            await send({"type": "http.response.body", "body": self.render.token(index), "more_body": True})
        watch.closing = True
        await send({"type": "http.response.body", "body": self.render.tail(), "more_body": False})


class _Render:
    """OpenAI chunk and response bodies for one request (chat or text completion)."""

    def __init__(self, chat: bool, model: str, req: SimRequest, rng, include_usage: bool):
        self.chat, self.model, self.req, self.include_usage = chat, model, req, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        self.created = int(time.time())
        self.rng = rng
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._prefix = f'{{"id":"{self.id}","object":"{kind}","created":{self.created},"model":{json.dumps(model)},'

    def _char(self) -> str:
        return self.rng.choice(_ALPHABET)

    def _event(self, choice: str, usage: str = "") -> bytes:
        return f"data: {self._prefix}\"choices\":[{choice}]{usage}}}\n\n".encode()

    def token(self, index: int) -> bytes:
        finish = '"length"' if index >= self.req.max_tokens else "null"
        text = json.dumps(self._char())
        if self.chat:
            role = '"role":"assistant",' if index == 1 else ""
            choice = f'{{"index":0,"delta":{{{role}"content":{text}}},"logprobs":null,"finish_reason":{finish}}}'
        else:
            choice = f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":{finish}}}'
        return self._event(choice)

    def usage(self) -> dict:
        r = self.req
        return {"prompt_tokens": r.prompt_len, "total_tokens": r.prompt_len + r.num_output,
                "completion_tokens": r.num_output, "prompt_tokens_details": {"cached_tokens": r.num_cached}}

    def tail(self) -> bytes:
        out = b""
        if self.include_usage:
            out += f'data: {self._prefix}"choices":[],"usage":{json.dumps(self.usage())}}}\n\n'.encode()
        return out + b"data: [DONE]\n\n"

    def whole(self) -> dict:
        text = "".join(self._char() for _ in range(self.req.num_output))
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}


def create_sim_app(engine: Engine, model: str = "sim", max_model_len: int = 131072) -> FastAPI:
    registry = CollectorRegistry()
    labels = {"model_name": model}
    running = Gauge("vllm:num_requests_running", "Requests in the engine's running set.", ["model_name"],
                    registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", ["model_name"],
                    registry=registry)
    prompt_total = Counter("vllm:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                           ["model_name"], registry=registry)
    gen_total = Counter("vllm:generation_tokens", "Generated tokens.", ["model_name"], registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                     buckets=_LATENCY_BUCKETS, registry=registry)
    itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of one request.",
                    ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry)
    kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", ["model_name"],
                     registry=registry)
    cache_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                       ["block_size", "enable_prefix_caching", "engine"], registry=registry)
    cache_info.labels(str(engine.config.block_size), str(engine.config.enable_prefix_caching), "0").set(1)
    if engine.config.pacing_cap > 0:  # as engine_patches' plugin publishes it on a paced vLLM's page
        info = engine_info.EngineInfo(pacing="cap", short_tokens=str(engine.config.pacing_short_tokens),
                                      version=__version__)
        Gauge(engine_info.NAME, engine_info.DOCUMENTATION, list(info.labels()),
              registry=registry).labels(**info.labels()).set(1)
    kv_capacity = engine.config.prefix_cache_blocks * engine.config.block_size
    kv_usage.labels(**labels).set_function(
        lambda: min(1.0, sum(r.num_computed + r.num_output for r in engine.running) / kv_capacity))
    ttft_l, itl_l = ttft.labels(**labels), itl.labels(**labels)
    engine.on_token = lambda req, seconds, first: (ttft_l if first else itl_l).observe(seconds)
    running.labels(**labels).set_function(lambda: len(engine.running))
    waiting.labels(**labels).set_function(lambda: len(engine.waiting))
    counted = {"prompt": 0, "gen": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(engine.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="prefill-gate engine simulator", lifespan=lifespan)

    async def _json(request: Request) -> dict | JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "request body is not valid JSON")
        return body if isinstance(body, dict) else _error(400, "request body must be a JSON object")

    async def generate(request: Request, chat: bool):
        body = await _json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            refusals.check_shape(body, chat)
            refusals.check_model(body, model)
            refusals.check_sampling(body, chat, max_model_len)
            try:
                prompt = render_chat(body["messages"]) if chat else encode_prompt(body["prompt"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                return _error(400, f"bad prompt: {exc}", "messages" if chat else "prompt")
            max_tokens = refusals.max_tokens_of(body)
            max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
            refusals.check_length(len(prompt), max_tokens, max_model_len)
        except refusals.Refusal as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        ids = not chat and isinstance(body.get("prompt"), list) and bool(body["prompt"]) \
            and isinstance(body["prompt"][0], int)
        per = engine.cost.frontend_per_id if ids else engine.cost.frontend_per_token
        await asyncio.sleep(per * len(prompt))  # the front end's share
        req = engine.add(SimRequest(prompt, max_tokens, events=asyncio.Queue()), token_ids=ids)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        render = _Render(chat, body.get("model") or model, req, engine.rng, include_usage)
        return _EngineResponse(engine, req, render, stream=bool(body.get("stream")))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "prefill-gate",
                                            "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            if "messages" in body:
                ids = render_chat(body["messages"], body.get("add_generation_prompt", True))
            else:
                ids = encode_prompt(body.get("prompt", ""))
        except (TypeError, ValueError, AttributeError) as exc:
            return _error(400, f"bad prompt: {exc}")
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        if isinstance(body, JSONResponse):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return _error(400, "tokens must be a list of integers", "tokens")
        return {"prompt": decode(tokens)}

    @app.get("/version")
    async def version():
        return {"version": "prefill-gate-sim"}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        for key, counter, value in (("prompt", prompt_total, engine.prompt_tokens_total),
                                    ("gen", gen_total, engine.generation_tokens_total)):
            counter.labels(**labels).inc(value - counted[key])
            counted[key] = value
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
