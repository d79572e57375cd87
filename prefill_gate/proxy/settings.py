"""One validated settings object for the proxy.

Sources, strongest first: command-line flags > ``PREFILL_GATE_*`` environment
variables > a YAML file (``--config``) > the defaults below. Every field has the
same name in all three places: ``--large-prefill-tokens``,
``PREFILL_GATE_LARGE_PREFILL_TOKENS``, ``large_prefill_tokens:``. A bad value stops
the start with a message that names the setting and where it came from.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger("prefill_gate")

ENV_PREFIX = "PREFILL_GATE_"


class SettingsError(ValueError):
    """A setting is missing, unknown or out of range; the message names it."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- where -----------------------------------------------------------------
    upstreams: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible upstream base URLs (vLLM servers). "
        "None: run the built-in engine simulator in-process.",
    )
    host: str = Field("127.0.0.1", description="Address the proxy listens on.")
    port: int = Field(8080, ge=0, le=65535, description="Port the proxy listens on (0: any free port).")

    # --- the gate --------------------------------------------------------------
    large_prefill_tokens: int = Field(
        2048, ge=1, description="Estimated uncached prompt tokens at or above which a request is a large prefill."
    )
    max_queue_wait: float = Field(
        30.0, gt=0, description="Seconds a large prefill may wait in the queue before on_queue_timeout applies."
    )
    on_queue_timeout: Literal["admit", "reject"] = Field(
        "admit", description="What happens when the wait bound passes: admit anyway, or reject with 503."
    )
    max_queue: int = Field(256, ge=0, description="Queued large prefills at most; beyond it: 429 with Retry-After.")
    max_large_in_flight: int = Field(
        1, ge=1, description="Large prefills prefilling at once on one upstream."
    )
    max_decodes_for_large: int = Field(
        0, ge=0, description="A large prefill is admitted only while at most this many protected decodes are live."
    )
    itl_slo_ms: float = Field(
        0.0, ge=0,
        description="Closed loop (0: off): also admit large prefills next to live decodes while the "
        "measured p95 gap of protected streams on that upstream stays within this many ms (for "
        "engines running step pacing); AIMD on the in-flight prefill-token budget.",
    )
    closed_loop_start_tokens: int = Field(
        32768, ge=0, description="Closed loop: each upstream's starting in-flight prefill-token budget."
    )
    closed_loop_step_tokens: int = Field(
        8192, ge=1, description="Closed loop: budget added per 1 s window whose p95 gap met the SLO."
    )
    slicing: Literal["off", "on", "auto"] = Field(
        "auto",
        description="Sliced prefill for stock engines: warm the upstream's prefix cache with growing "
        "prefixes of a large prompt (small requests, one at a time) instead of holding it while "
        "protected streams are live. auto: slice when that is predicted to finish the prompt sooner "
        "than holding; on: slice whenever it would hold; off: hold. Upstreams that cannot be sliced "
        "(prefix caching off, no /tokenize) hold.",
    )
    paced_admission: Literal["admit", "gate"] = Field(
        "admit",
        description="An upstream whose engine paces its own steps (prefill-gate's engine patches, found "
        "on its /metrics): admit: large prefills go to it without waiting for live streams (the engine "
        "keeps their steps short; max_large_in_flight still applies); gate: hold or slice them as on "
        "stock vLLM.",
    )
    slice_gap_ms: float = Field(
        45.0, gt=0,
        description="Slicing: the protected streams' largest gap the slice size aims at (lowered by the "
        "slice cost model's recent errors to keep max_gap_ms).",
    )
    max_gap_ms: float = Field(
        50.0, gt=0,
        description="Slicing: the promise to protected streams, their gaps' p99.9 while prompts are "
        "sliced (slices aim below it; the worst gap is reported beside it, not bounded); an upstream "
        "where even the smallest slice breaks it is held for 30 s.",
    )
    slice_settle_ms: float = Field(
        100.0, ge=0,
        description="Slicing: before each slice, wait up to this long for other requests' prefills "
        "on the upstream to end (a slice and a prompt in one engine step add up in the streams' gap; "
        "0: do not wait).",
    )
    slice_when_idle: bool = Field(
        False,
        description="Slicing: slice a large prompt also when no protected stream is live (instead "
        "of admitting it whole), so requests arriving during its prefill are not stalled behind it.",
    )
    slice_inflight: int = Field(
        1, ge=1, le=4,
        description="Slicing: slices in flight at once; 2 sends the next slice half a round trip "
        "after the previous, so that the engine takes it in while the previous one computes "
        "(vLLM caches a slice's blocks when it schedules them).",
    )
    slice_inflight_capped: int = Field(
        1, ge=1, le=4,
        description="Slicing: slices in flight at once while slices are kept under a ceiling (after "
        "slices above some size stalled streams past 1.5x max_gap_ms again and again): those slices "
        "run short steps, and their round trips set a long prompt's time (at least slice_inflight).",
    )
    min_slice_tokens: int = Field(256, ge=1, description="Slicing: the smallest slice (rounded up to a KV block).")
    max_slice_tokens: int = Field(4096, ge=1, description="Slicing: the largest slice.")
    sse_keepalive: float = Field(
        0.0, ge=0,
        description="Seconds between SSE comment lines (queue position, seconds left until the wait "
        "bound) sent to a held streaming request, the first with its 200 at once (0: none).",
    )
    protect_non_streaming: bool = Field(
        False,
        description="Count non-streaming requests as protected decodes (the proxy then streams "
        "upstream and assembles the JSON itself, so that it sees their phase).",
    )

    # --- estimation ------------------------------------------------------------
    bytes_per_token: float = Field(
        4.0, gt=0, description="Initial bytes-per-token ratio; recalibrated per model from reported usage."
    )
    exact_count_band: float = Field(
        0.5,
        ge=0,
        description="Use the exact counter only when the cheap estimate is within this fraction of the threshold.",
    )
    tokenizer_json: str | None = Field(None, description="Path to a HF tokenizer.json for exact counts.")
    tiktoken_encoding: str | None = Field(None, description="A tiktoken encoding name (e.g. o200k_base).")
    upstream_tokenize: bool = Field(False, description="Ask the upstream's /tokenize for exact counts.")
    prefix_memory_entries: int = Field(
        20000, ge=0, description="Message-list prefixes remembered per upstream (0: count whole prompts)."
    )

    class_header: Literal["off", "large", "any"] = Field(
        "large",
        description="Which x-prefill-gate-class values clients may set: any, only large (a client may "
        "hold itself, never skip the gate), or off (the header is ignored).",
    )

    # --- limits and timeouts ---------------------------------------------------
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above).")
    max_messages: int = Field(4096, ge=1, description="Most chat messages in one request (400 above).")
    max_json_containers: int = Field(
        200_000, ge=100,
        description="Most JSON objects and arrays in one request body (400 above; counted as '{' and '[' "
        "bytes, strings included), so that no body costs a body reader more than a bounded parse.",
    )
    offload_body_bytes: int = Field(
        64 * 1024, ge=0,
        description="Request bodies (and /tokenize answers) of this many bytes or more are parsed and read "
        "in a worker process (body_workers), not on the event loop that relays every stream (0: every body).",
    )
    body_workers: int = Field(
        2, ge=0, le=64,
        description="Worker processes that read big request bodies, started with the proxy (a first big body "
        "would otherwise wait for the spawn: 134-177 ms on a 2-core VM; 0: every body is read on the event loop).",
    )
    relay_core: Literal["auto", "compiled", "python"] = Field(
        "auto",
        description="The relay's per-read path (prefill_gate/proxy/relaycore.py): compiled (prefill_gate/proxy/_relaycore.c, built by "
        "pip install where a C compiler is at hand; less CPU a relayed chunk, docs/results/proxy-cost.md) or "
        "Python's, which behaves alike. auto: compiled where built; compiled: refuse to start without it.",
    )
    max_json_depth: int = Field(
        128, ge=8, le=900,
        description="Deepest nesting of JSON objects and arrays in a request body (400 above).",
    )
    max_queued_bytes: int = Field(
        1 << 30, ge=1024, description="Request bodies held in the queue at most, in bytes (429 beyond)."
    )
    max_upstream_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="Largest upstream answer the proxy reads whole (a non-streaming answer, an error "
        "body, an assembled stream); 502 above.",
    )
    max_upstream_event_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest single SSE event from an upstream (502 above)."
    )
    max_upstream_head_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest upstream response head (status line and headers; 502 above)."
    )
    max_upstream_headers: int = Field(128, ge=8, description="Most headers in an upstream response (502 above).")
    max_request_seconds: float = Field(
        3600.0, gt=0,
        description="Overall bound on one proxied request, queue wait included (504 or an in-stream "
        "error after it), whatever the upstream does (drip-feeding, endless interim answers).",
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest total size of a request's header names and values (431 above)."
    )
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to connect to an upstream (502 after).")
    read_timeout: float = Field(
        600.0, gt=0, description="Seconds an upstream may stay silent (no response, no chunk) before 504."
    )
    max_connections: int = Field(
        4096, ge=1,
        description="Upstream requests in flight at most, all upstreams together (idle keep-alive connections come on top: at most 256 per upstream).",
    )
    health_interval: float = Field(5.0, gt=0, description="Seconds between upstream health checks.")
    max_client_connections: int = Field(
        16384, ge=16,
        description="Client connections and requests at once, at most (503 beyond; uvicorn's limit_concurrency).",
    )
    client_idle_timeout: float = Field(
        5.0, gt=0, description="Seconds an idle client keep-alive connection stays open (uvicorn's timeout_keep_alive)."
    )
    client_header_timeout: float = Field(
        10.0, gt=0,
        description="Seconds a client has to send a request's headers, from connecting or from its "
        "previous answer (408 and the connection closed after; slow-header clients).",
    )
    client_body_timeout: float = Field(
        30.0, gt=0,
        description="Seconds a client has to send a request's body after its headers, one more second for "
        "each 64 KiB that arrives (408 and the connection closed after; slow-body clients).",
    )
    api_keys_file: str | None = Field(
        None, description="File of client API key hashes (sha256:<hex> per line; prefill-gate hash-key "
        "prints one). Set: every path but /health and /ready needs a listed Bearer key (401 otherwise), /metrics too unless it has its own metrics_port.",
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Serve /metrics on this port (at metrics_host) instead of the API port.",
    )
    metrics_host: str = Field("127.0.0.1", description="Address of the separate /metrics listener (metrics_port).")
    shutdown_grace: float = Field(
        30.0, ge=0, description="Seconds streams may run on after SIGTERM; then each ends with an error event.",
    )
    upstream_api_key: str | None = Field(
        None, description="Bearer key the proxy sends upstream (replaces the client's Authorization)."
    )

    # --- the embedded simulator and logs ---------------------------------------
    sim_preset: str = Field("h200-qwen3-8b", description="Simulator preset when no upstream is given.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @model_validator(mode="after")
    def _check_slicing(self) -> "Settings":
        if self.min_slice_tokens > self.max_slice_tokens:
            raise ValueError(f"min_slice_tokens ({self.min_slice_tokens}) is above max_slice_tokens "
                             f"({self.max_slice_tokens})")
        if self.slice_gap_ms > self.max_gap_ms:
            raise ValueError(f"slice_gap_ms ({self.slice_gap_ms:g}) is above max_gap_ms ({self.max_gap_ms:g}): "
                             "slices sized to it would break the promise")
        return self

    @field_validator("sim_preset")
    @classmethod
    def _check_preset(cls, name: str) -> str:
        from .sim.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown simulator preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return name

    @field_validator("upstreams")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        out = []
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
            if "@" in url.split("://", 1)[1].split("/", 1)[0]:
                raise ValueError("an upstream URL must not carry credentials (they would show in /health, "
                                 "/metrics and logs): use upstream_api_key")
            url = url.rstrip("/")
            if url.endswith("/v1"):  # what every OpenAI client is configured with; the proxy adds the paths
                log.warning("upstream %s: using %s (the proxy adds /v1/... itself)", url, url[:-3])
                url = url[:-3]
            out.append(url)
        if len(set(out)) != len(out):
            raise ValueError("the same upstream is listed twice")
        return out


# Every setting by the task it serves: ``serve --help`` and docs/configuration.md list them so.
# {title: (what the group is for, its settings)}; a test checks each setting is in exactly one.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Essentials": (
        "What a deployment sets: where vLLM is, where clients reach the proxy, what a long prompt "
        "is, what to do with one, and who may ask.",
        ("upstreams", "host", "port", "large_prefill_tokens", "slicing", "api_keys_file")),
    "Admission": (
        "Who waits, for how long, in what order; and what an engine that paces its own steps gets.",
        ("max_queue_wait", "on_queue_timeout", "max_queue", "max_queued_bytes", "max_large_in_flight",
         "max_decodes_for_large", "paced_admission", "class_header", "protect_non_streaming", "sse_keepalive")),
    "Slicing": (
        "In front of vLLM's own scheduling: how a long prompt is sliced into its prefix cache.",
        ("max_gap_ms", "slice_gap_ms", "slice_settle_ms", "slice_when_idle", "slice_inflight",
         "slice_inflight_capped", "min_slice_tokens", "max_slice_tokens")),
    "Closed loop": (
        "Admission next to live streams by their measured gaps (an engine that paces its steps).",
        ("itl_slo_ms", "closed_loop_start_tokens", "closed_loop_step_tokens")),
    "Estimation": (
        "How a prompt's uncached tokens are counted.",
        ("bytes_per_token", "exact_count_band", "tokenizer_json", "tiktoken_encoding", "upstream_tokenize",
         "prefix_memory_entries")),
    "Limits and auth": (
        "What one client's request or one upstream answer may cost, and the key sent upstream.",
        ("upstream_api_key", "max_body_bytes", "max_header_bytes", "max_messages", "max_json_containers",
         "max_json_depth", "offload_body_bytes", "body_workers", "max_upstream_body_bytes",
         "max_upstream_event_bytes", "max_upstream_head_bytes", "max_upstream_headers", "max_connections",
         "max_client_connections")),
    "Timeouts": (
        "Every wait has a bound.",
        ("connect_timeout", "read_timeout", "max_request_seconds", "client_header_timeout", "client_body_timeout",
         "client_idle_timeout", "health_interval", "shutdown_grace")),
    "Observability and runtime": (
        "Metrics, logs, the relay's compiled core, and the simulator.",
        ("metrics_port", "metrics_host", "log_level", "relay_core", "sim_preset")),
}


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name == "upstreams":
            values[name] = [u.strip() for u in raw.split(",") if u.strip()]
        elif field.annotation is bool:
            values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            values[name] = raw  # pydantic converts and checks
    return values


def _file_values(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting: value")
    if isinstance(data.get("upstreams"), str):
        data["upstreams"] = [data["upstreams"]]
    return data


def load_settings(
    flags: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults < file < env < flags and validate once.

    ``flags`` holds only the flags the user gave (``None`` values are dropped).
    """
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG")
    layers = [
        ("config file", _file_values(config_file) if config_file else {}),
        ("environment", _env_values(environ)),
        ("flag", {k: v for k, v in (flags or {}).items() if v is not None and v != []}),
    ]
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for where, values in layers:
        for key, value in values.items():
            merged[key] = value
            source[key] = where
    try:
        return Settings(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            where = source.get(key, "default")
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown setting {key!r} (from {where})")
            else:
                problems.append(f"setting {key} (from {where}): {err['msg']}")
        raise SettingsError("; ".join(problems)) from None
