"""The FastAPI app factory: wires the stages; the lifespan owns the clients.

Routes:
  POST /v1/chat/completions, /v1/completions   through the gate
  any  /v1/*, /tokenize, /detokenize, /version  passed through unchanged
  GET  /health                                  liveness: the proxy and which upstreams answer
  GET  /ready                                   readiness: 200 while an upstream passes its checks, else 503
  GET  /vllm/metrics                            the upstream's metrics, held requests counted as waiting
  GET  /metrics                                 Prometheus text

The gate's state lives in this process: run one uvicorn worker per proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import metrics as metrics_module
from .admission import AdmissionPolicy, Limits, Slicing
from .auth import OPEN_PATHS, KeyCheck
from .bodies import BodyOptions, BodyReader
from .errors import (
    BadRequest,
    HeadersTooLarge,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    Unauthorized,
    UpstreamUnavailable,
)
from .estimate import (
    Calibrator,
    Estimator,
    ExactCounter,
    TiktokenCounter,
    TokenizerJsonCounter,
    UpstreamTokenizeCounter,
)
from .exchange import GatedExchange, PassthroughExchange, client_headers, prepare, read_body
from .gate import Gate
from .gateway import add_held, upstream_page
from .labels import OutcomeKind
from .metrics import Metrics
from .openapi import ChatCompletionRequest, CompletionRequest, gated_responses
from .predict import Predictor
from .prefix_memory import PrefixMemory
from .relaycore import gap_tally_type, relay_factory
from .routing import Routing
from .settings import Settings
from .state import AppState
from .upstream import UpstreamClient

log = logging.getLogger("prefill_gate")

PASSTHROUGH_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _exact_counter(settings: Settings, client: UpstreamClient, state_ref: list) -> ExactCounter | None:
    if settings.tokenizer_json:
        return TokenizerJsonCounter(settings.tokenizer_json)
    if settings.tiktoken_encoding:
        return TiktokenCounter(settings.tiktoken_encoding)
    if settings.upstream_tokenize:
        async def post(payload: dict) -> dict:
            return await client.post_json(state_ref[0].pick_upstream(), "/tokenize", payload, timeout=5.0)

        return UpstreamTokenizeCounter(post)
    return None


def body_reader(settings: Settings) -> BodyReader:
    def options(endpoint: str) -> BodyOptions:
        return BodyOptions(endpoint, settings.max_messages, settings.max_json_containers, settings.max_json_depth,
                           settings.protect_non_streaming, settings.slicing != "off", settings.upstream_tokenize,
                           bool(settings.tokenizer_json or settings.tiktoken_encoding))

    return BodyReader({e: options(e) for e in ("chat", "completions")}, settings.offload_body_bytes,
                      settings.body_workers)


def build_state(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    exact: ExactCounter | None = None,
) -> AppState:
    if not settings.upstreams:
        raise ValueError("build_state needs at least one upstream (the CLI starts the simulator otherwise)")
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry, settings.upstreams)
    limits = Limits(
        max_large_in_flight=settings.max_large_in_flight,
        max_decodes_for_large=settings.max_decodes_for_large,
        max_queue=settings.max_queue,
        max_queue_bytes=settings.max_queued_bytes,
        max_queue_wait=settings.max_queue_wait,
        admit_on_timeout=settings.on_queue_timeout == "admit",
        itl_slo=settings.itl_slo_ms / 1000 if settings.itl_slo_ms else None,
        budget_start_tokens=settings.closed_loop_start_tokens,
        budget_step_tokens=settings.closed_loop_step_tokens,
        slicing=Slicing(settings.slicing),
        slice_idle=settings.slice_when_idle,
    )
    policy = AdmissionPolicy(settings.upstreams, limits)
    predictor = Predictor(settings.upstreams, slice_gap_s=settings.slice_gap_ms / 1000,
                          max_gap_s=settings.max_gap_ms / 1000, min_slice_tokens=settings.min_slice_tokens,
                          max_slice_tokens=settings.max_slice_tokens, slice_idle=settings.slice_when_idle,
                          wait_bound_s=settings.max_queue_wait)
    direct_relay, relay_core = relay_factory(settings.relay_core)
    client = UpstreamClient(
        settings.upstreams,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        max_connections=settings.max_connections,
        api_key=settings.upstream_api_key,
        drop_client_auth=settings.api_keys_file is not None,
        transport=transport,
        max_head_bytes=settings.max_upstream_head_bytes,
        max_headers=settings.max_upstream_headers,
        framed=relay_core == "compiled",  # its read callback takes whole chunks unparsed (fasthttp.body_sink)
    )
    state_ref: list[AppState] = []
    estimator = Estimator(
        settings.large_prefill_tokens,
        Calibrator(settings.bytes_per_token),
        exact if exact is not None else _exact_counter(settings, client, state_ref),
        band=settings.exact_count_band,
    )
    gate = Gate(policy, metrics)
    state = AppState(settings, metrics, policy, gate, client, estimator,
                     PrefixMemory(settings.upstreams, settings.prefix_memory_entries),
                     Routing(settings, metrics, gate, policy),
                     keys=KeyCheck.from_file(settings.api_keys_file) if settings.api_keys_file else None,
                     predictor=predictor, bodies=body_reader(settings))
    state.direct_relay, state.relay_core = direct_relay, relay_core
    state.gap_tally = gap_tally_type(relay_core, metrics_module.histogram_child)
    policy.chooser = state.choose_slice
    state_ref.append(state)
    metrics.bytes_per_token.set(settings.bytes_per_token)
    for u in settings.upstreams:
        metrics.upstream_up.labels(u).set(1)
    return state


HOT_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Spellings that an upstream (or the client library on the way) may resolve to another path:
# percent-encoded dots, slashes, backslashes and NULs.
_ENCODED = re.compile(rb"%(2e|2f|5c|00)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOT_RAW = {path: path.encode() for path in HOT_PATHS}  # their canonical spellings, as sent


def path_refusal(path: str, raw_path: bytes | None) -> ProxyError | None:
    """Why this path is refused before any routing, or None. Every path the proxy serves is
    routed by its one canonical spelling: dot segments, empty segments, backslashes, control
    characters and encoded separators are refused, so no spelling of a gated endpoint reaches
    the upstream through passthrough (which would resolve it there, ungated)."""
    if raw_path is not None and _HOT_RAW.get(path) == raw_path:
        return None  # a gated endpoint spelled as it is: nothing below can refuse it (the common case)
    if _ENCODED.search(raw_path or b"") or "\\" in path or "//" in path or _CONTROL.search(path):
        return BadRequest("the request path is not in canonical form (encoded or doubled separators, "
                          "control characters)")
    if any(seg in (".", "..") for seg in path.split("/")):
        return BadRequest("the request path holds a '.' or '..' segment")
    if path != "/" and path.endswith("/") and path.rstrip("/") in HOT_PATHS:
        return NotFound(f"no such endpoint {path!r}; did you mean {path.rstrip('/')!r}?")
    return None


class GateApp:
    """The ASGI entry point. The two gated endpoints go straight to their exchange:
    FastAPI's middleware stack wraps every ``send`` of a response, so on a relay of
    thousands of chunks a second it cost more than the relay itself (py-spy). Every
    other path and the lifespan are FastAPI's."""

    def __init__(self, state: AppState, api: FastAPI):
        self.state = state
        self.api = api

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.state.settings.max_header_bytes:
                exc = HeadersTooLarge(f"request headers are {size} bytes; the limit is "
                                      f"{self.state.settings.max_header_bytes} (max_header_bytes)")
                await exc.response()(scope, receive, send)
                return
            refused = path_refusal(scope["path"], scope.get("raw_path"))
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
        keys = self.state.keys
        if keys is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not keys.allows(auth):
                self.state.metrics.unauthorized.inc()
                exc = Unauthorized("missing or invalid API key (Authorization: Bearer <key>)")
                await exc.response()(scope, receive, send)
                return
        endpoint = HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is not None and scope["method"] != "POST":  # nothing but the gate reaches these
            await MethodNotAllowed(f"{scope['path']} takes POST", allow="POST").response()(scope, receive, send)
            return
        if endpoint is None:
            await self.api(scope, receive, send)
            return
        try:
            req = await prepare(self.state, scope, receive, endpoint)
        except ProxyError as exc:
            self.state.metrics.requests.labels("interactive", OutcomeKind.BAD_REQUEST).inc()
            await exc.response()(scope, receive, send)
            return
        except ClientDisconnect:  # gone before its body's end: nothing to answer, nothing sent upstream
            self.state.metrics.requests.labels("interactive", OutcomeKind.CLIENT_DISCONNECT).inc()
            return
        await GatedExchange(self.state, req)(scope, receive, send)


def create_app(state: AppState, *, health_checks: bool = True, start_workers: bool = False) -> GateApp:
    """The proxy's ASGI app. ``health_checks``: probe the upstreams in the background;
    ``start_workers``: start the body reader processes with the app (``BodyReader.start``),
    not with the first big body (``prefill-gate serve`` does; tests that make many apps not)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = []
        if health_checks:
            tasks.append(asyncio.create_task(state.routing.check_forever(
                state.client, state.settings.health_interval)))
        if start_workers:
            tasks.append(asyncio.create_task(state.bodies.start()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            state.bodies.close()
            await state.client.aclose()

    app = FastAPI(title="prefill-gate", version="0.1.0", lifespan=lifespan)
    app.state.gate_state = state

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The framework's own 404 and 405, OpenAI-shaped like every other error."""
        if exc.status_code == 405:
            return MethodNotAllowed(str(exc.detail), allow=(exc.headers or {}).get("Allow", "")).response()
        if exc.status_code == 404:
            return NotFound(str(exc.detail)).response()
        return JSONResponse(ProxyError(str(exc.detail)).body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return BadRequest(f"invalid request: {exc.errors()[:3]}").response()

    @app.get("/ready", responses={503: {"description": "no upstream passes its health checks"}})
    async def ready():
        """Readiness, for load balancers: 200 while at least one upstream passed its latest
        health check, else 503 (before the first check too)."""
        passing = state.routing.passing()
        body = {"ready": bool(passing), "upstreams_passing": len(passing),
                "upstreams": len(state.settings.upstreams)}
        return JSONResponse(body, status_code=200 if passing else 503)

    @app.get("/health")
    async def health():
        """Liveness: 200 while the proxy answers; ``status`` says whether any upstream passes."""
        ups = state.policy.snapshot().upstreams
        passing = bool(state.routing.passing())
        body = {
            "status": "ok" if passing else "no_upstream_passing",
            "queue_depth": state.policy.queue_depth,
            "upstreams": {
                u: {
                    "healthy": state.health.get(u),  # None: not checked yet
                    "live_decodes": ups[u].live_decodes,
                    "large_prefills_in_flight": ups[u].large_in_flight,
                    "active": ups[u].active,
                    "mode": state.routing.modes[u].value if u in state.routing.modes else None,
                    **({"slicing": {"possible": state.caps[u].can_slice, "why_not": state.caps[u].why_not() or None,
                                    "block_size": state.caps[u].block_size, "slicing_now": ups[u].slicer is not None}}
                       if state.settings.slicing != "off" and u in state.caps else {}),
                    **({"engine": state.caps[u].engine.labels()} if u in state.caps and state.caps[u].engine else {}),
                }
                for u in state.settings.upstreams
            },
        }
        return JSONResponse(body)

    if state.settings.metrics_port is None:  # else served by create_metrics_app on its own port
        @app.get("/metrics", response_class=PlainTextResponse,
                 responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
        async def metrics():
            return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/vllm/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "the upstream vLLM's metrics, held requests added to "
                              "vllm:num_requests_waiting", "content": {"text/plain": {}}},
                        404: {"description": "more than one upstream"},
                        502: {"description": "the upstream's /metrics did not answer"}})
    async def vllm_metrics():
        """For inference gateways: the upstream's own metrics page, with the requests the
        gate holds there added to ``vllm:num_requests_waiting`` (a sidecar's one upstream)."""
        ups = state.settings.upstreams
        if len(ups) != 1:
            return NotFound("/vllm/metrics serves a proxy with one upstream (a sidecar)").response()
        page = await upstream_page(state.client, ups[0])
        if page is None:
            return UpstreamUnavailable(f"upstream {ups[0]} did not answer /metrics").response()
        up = state.policy.upstreams[ups[0]]
        held = state.policy.queue_depth + (1 if up.slicer is not None else 0)
        return Response(add_held(page, held), media_type=CONTENT_TYPE_LATEST)

    def gated(path: str, model: type, summary: str) -> None:
        """Describe a gated endpoint in /openapi.json. GateApp answers these POSTs before
        FastAPI routes anything, so this handler never runs."""

        async def served_by_the_gate(body):
            raise RuntimeError(f"POST {path} is served by GateApp")

        served_by_the_gate.__annotations__ = {"body": model}  # a class, not this module's string annotation

        app.add_api_route(path, served_by_the_gate, methods=["POST"], summary=summary,
                          responses=gated_responses(), name=path)

    gated("/v1/chat/completions", ChatCompletionRequest, "OpenAI chat completions, through the gate")
    gated("/v1/completions", CompletionRequest, "OpenAI completions, through the gate")

    async def passthrough(request: Request):
        headers = client_headers(request.scope["headers"])
        body = await read_body(request.receive, headers, state.settings.max_body_bytes)
        return PassthroughExchange(
            state, state.pick_upstream(), request.method, request.url.path, request.url.query, headers, body,
        )

    app.add_api_route("/v1/{rest:path}", passthrough, methods=PASSTHROUGH_METHODS, include_in_schema=False)
    for path in ("/tokenize", "/detokenize", "/version"):
        app.add_api_route(path, passthrough, methods=["GET", "POST"], include_in_schema=False)
    return GateApp(state, app)


def create_metrics_app(state: AppState):
    """``GET /metrics`` alone, for a listener of its own (``metrics_port``): scrapers reach
    it without reaching the API, and the API port need not expose it."""
    body_type = CONTENT_TYPE_LATEST.encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics" or scope["method"] != "GET":
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"not found"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", body_type)]})
        await send({"type": "http.response.body", "body": generate_latest(state.metrics.registry)})

    return app
