"""The long-prefill overlap benchmark: decode ITL while a long prompt prefills.

The seed shape, from the report: stream B (short prompt, 512 streamed tokens) is
decoding; when B has streamed 64 tokens, request A arrives (~28,600-token prompt,
58 tokens). Each run measures B alone, A alone, then the overlap, with fresh prompt
text each time so that no prefix cache helps. Works against any OpenAI endpoint
(vLLM, the proxy, the simulator). Times are taken on arrival of each content chunk.

Reported per run (then median and spread over runs):
  solo_itl_ms_p50/p99        B's gaps when alone
  overlap_itl_ms_p50/p95/p99/max B's gaps that overlap A's prefill (A sent -> A's first token,
                             or B's end if that comes first)
  overlap_b_tokens_per_s     B's tokens in that window / the window's length
  a_ttft_s, a_total_s        A's time to first token and to its end, next to B
  a_solo_ttft_s              A's time to first token alone
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from ..relay import is_token  # every generated step, empty text included (as the proxy's observer counts)
from .client_gc import ClientCollections
from .report import percentile

KEYS = ("solo_itl_ms_p50", "solo_itl_ms_p99", "overlap_itl_ms_p50", "overlap_itl_ms_p95", "overlap_itl_ms_p99",
        "overlap_itl_ms_max",
        "overlap_b_tokens_per_s", "a_ttft_s", "a_total_s", "a_solo_ttft_s", "a_solo_total_s")


@dataclass(frozen=True)
class Shape:
    b_prompt_tokens: int = 40
    b_tokens: int = 512
    a_after_b_tokens: int = 64
    long_tokens: int = 28600
    a_tokens: int = 58


@dataclass
class Trace:
    """One streamed request as the client saw it (seconds on one monotonic clock)."""

    sent: float = 0.0
    tokens: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.sent if self.tokens else float("nan")

    def gaps(self) -> list[tuple[float, float]]:
        """(end time, gap) for each inter-token gap."""
        return [(b, b - a) for a, b in zip(self.tokens, self.tokens[1:])]


async def stream_chat(client: httpx.AsyncClient, base_url: str, model: str, content: str, max_tokens: int,
                      trace: Trace, on_token=None) -> Trace:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0.0}
    trace.sent = time.monotonic()
    try:
        async with client.stream("POST", base_url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return trace
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.startswith("data: [DONE]"):
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    trace.error = str(obj["error"])[:200]
                elif is_token(obj):
                    trace.tokens.append(time.monotonic())
                    if on_token is not None:
                        on_token(len(trace.tokens))
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.end = time.monotonic()
    return trace


class PromptMaker:
    """Fresh random prompt text sized to a token count with the target's /tokenize when it has one."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, seed: int = 0):
        self.client, self.base_url, self.model = client, base_url, model
        self.rng = random.Random(seed)
        self.chars_per_token = 1.0  # learned from /tokenize
        self.overhead: int | None = None  # template tokens around the content
        self.has_tokenize = True

    def _text(self, n_chars: int) -> str:
        words, total = [], 0
        while total < n_chars:
            w = "".join(self.rng.choices(string.ascii_lowercase, k=self.rng.randint(2, 9)))
            words.append(w)
            total += len(w) + 1
        return " ".join(words)[:n_chars]

    async def count(self, content: str) -> int | None:
        if not self.has_tokenize:
            return None
        try:
            r = await self.client.post(self.base_url + "/tokenize",
                                       json={"model": self.model, "messages": [{"role": "user", "content": content}]})
            if r.status_code == 200 and isinstance(r.json().get("count"), int):
                return r.json()["count"]
        except (httpx.HTTPError, ValueError):
            pass
        self.has_tokenize = False
        return None

    async def make(self, tokens: int) -> tuple[str, int | None]:
        """Text whose chat prompt is ``tokens`` tokens (template included), and the count seen."""
        if self.overhead is None:
            self.overhead = await self.count("") or 0
        if not self.has_tokenize:
            return self._text(tokens * 4), None  # no /tokenize: ~4 characters per token of plain text
        target = max(1, tokens - self.overhead)
        text = self._text(max(1, int(target * self.chars_per_token)))
        count = None
        for _ in range(5):
            count = await self.count(text)
            if count is None or abs(count - tokens) <= max(1, tokens // 1000):
                break
            self.chars_per_token = len(text) / max(1, count - self.overhead)
            text = self._text(max(1, int(target * self.chars_per_token)))
        return text, count


def _run_metrics(b_solo: Trace, a_solo: Trace, b: Trace, a: Trace) -> dict:
    """The overlap window is A's prefill: from A's send to its first token (or B's end).
    A gap counts when it overlaps the window, so the gap that spans A's last chunk does."""
    solo_gaps = [g * 1e3 for _, g in b_solo.gaps()]
    start = a.sent
    end = min(a.tokens[0] if a.tokens else a.end, b.end)
    over = [g * 1e3 for t, g in b.gaps() if t > start and t - g < end]
    in_window = [t for t in b.tokens if start <= t <= end]
    span = end - start
    return {
        "solo_itl_ms_p50": percentile(solo_gaps, 50),
        "solo_itl_ms_p99": percentile(solo_gaps, 99),
        "overlap_itl_ms_p50": percentile(over, 50),
        "overlap_itl_ms_p95": percentile(over, 95),
        "overlap_itl_ms_p99": percentile(over, 99),
        "overlap_itl_ms_max": max(over) if over else float("nan"),
        "overlap_b_tokens_per_s": len(in_window) / span if span > 0 else float("nan"),
        "a_ttft_s": a.ttft,
        "a_total_s": a.end - a.sent,
        "a_solo_ttft_s": a_solo.ttft,
        "a_solo_total_s": a_solo.end - a_solo.sent,
    }


def _trace_json(t: Trace, t0: float) -> dict:
    return {"sent": t.sent - t0, "end": t.end - t0, "tokens": [round(x - t0, 6) for x in t.tokens],
            "error": t.error}


def normalize_base_url(url: str) -> str:
    """Accept what OpenAI clients are configured with (``.../v1``): the benches add the paths."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def discover(client: httpx.AsyncClient, base_url: str, model: str | None) -> tuple[str, str | None]:
    """The model to ask for (the first of /v1/models unless given) and the server's version."""
    if model is None:
        r = await client.get(base_url + "/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    version = None
    try:
        r = await client.get(base_url + "/version")
        version = r.json().get("version") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return model, version


async def run_overlap(base_url: str, model: str | None = None, shape: Shape = Shape(), runs: int = 1,
                      seed: int | None = None, progress: bool = True, timeout: float = 600.0) -> dict:
    """Run the seed shape ``runs`` times. ``seed`` None: fresh text on every call (an
    earlier call's prompts may still sit in the target's prefix cache)."""
    base_url = normalize_base_url(base_url)
    seed = random.SystemRandom().randrange(1 << 30) if seed is None else seed
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        model, server_version = await discover(client, base_url, model)
        maker = PromptMaker(client, base_url, model, seed)
        per_run, raw = [], []
        tty = sys.stderr.isatty()
        for i in range(runs):
            b_text, _ = await maker.make(shape.b_prompt_tokens)
            a_text, a_count = await maker.make(shape.long_tokens)
            b2_text, _ = await maker.make(shape.b_prompt_tokens)
            a2_text, _ = await maker.make(shape.long_tokens)

            def say(what: str) -> None:
                if not progress:
                    return
                if tty:  # one line rewritten in place; in a log file, one line each
                    print(f"\r[overlap] run {i + 1}/{runs}: {what:<40}", end="", file=sys.stderr, flush=True)
                else:
                    print(f"[overlap] run {i + 1}/{runs}: {what}", file=sys.stderr, flush=True)

            say("B alone")
            b_solo = await stream_chat(client, base_url, model, b_text, shape.b_tokens, Trace())
            say("A alone")
            a_solo = await stream_chat(client, base_url, model, a_text, shape.a_tokens, Trace())
            say(f"B, then A at B's token {shape.a_after_b_tokens}")
            a_started = asyncio.Event()
            a_trace = Trace()
            a_task: list[asyncio.Task] = []

            def on_b_token(n: int) -> None:
                if n == shape.a_after_b_tokens and not a_task:
                    a_task.append(asyncio.create_task(
                        stream_chat(client, base_url, model, a2_text, shape.a_tokens, a_trace)))
                    a_started.set()

            with ClientCollections() as collections:  # the client's own pauses read as B's gaps too
                b_trace = await stream_chat(client, base_url, model, b2_text, shape.b_tokens, Trace(), on_b_token)
                if a_task:
                    await a_task[0]
            errors = [t.error for t in (b_solo, a_solo, b_trace, a_trace) if t.error]
            if errors or not a_task:
                raise RuntimeError(f"run {i + 1} failed: {errors or 'B ended before A was sent'}")
            per_run.append(_run_metrics(b_solo, a_solo, b_trace, a_trace))
            t0 = b_solo.sent
            t0_unix = round(time.time() - (time.monotonic() - t0), 3)  # the times below + this = a log's
            raw.append({"run": i + 1, "t0_unix": t0_unix, "a_prompt_tokens": a_count, "b_solo": _trace_json(b_solo, t0),
                        "a_solo": _trace_json(a_solo, t0), "b": _trace_json(b_trace, t0),
                        "a": _trace_json(a_trace, t0), "client_gc": collections.summary(t0)})
        if progress and tty:
            print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
    return over_runs(per_run, bench="overlap", target=base_url, model=model, runs=runs, seed=seed,
                     server_version=server_version, shape=asdict(shape), raw=raw)


def over_runs(per_run: list[dict], **rest) -> dict:
    """The median of each figure over ``per_run``, their ``spread`` (min, max), ``rest``, and
    ``per_run`` itself."""
    result = {k: percentile([r[k] for r in per_run], 50) for k in KEYS}
    result["spread"] = {k: [min(r[k] for r in per_run), max(r[k] for r in per_run)] for k in KEYS}
    result.update(rest, per_run=per_run)
    return result
