"""``prefill-gate bench short``: what one new short prompt costs the streams already live.

A few streams decode (short prompts, long answers, each restarted when it ends, started at
different times); short prompts (fresh text, uniformly --min-tokens..--max-tokens long, one
output token) arrive at Poisson times, --every seconds apart on average, from one seed. For
each short prompt:

    cost  the longest gap of any stream that overlaps the prompt's flight (sent to its
          first token): what a reader of a live answer sees when someone starts a turn
    ttft  the prompt's own time to first token

and for the streams, their decode step: the median gap that overlaps no short prompt's
flight. The table gives each figure's median, p90, p99 and max, and the cost against the
step. This is the hybrid model's hard case (issue 50): there the cost is a whole eager
prefill step, several times a decode step, for every prompt anyone sends.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from .overlap import PromptMaker, Trace, discover, normalize_base_url, stream_chat
from .report import environment, percentile, table, write_json


@dataclass(frozen=True)
class ShortShape:
    streams: int = 4
    stream_prompt_tokens: int = 40
    stream_tokens: int = 2048
    every_s: float = 1.2
    min_tokens: int = 200
    max_tokens: int = 400
    duration_s: float = 60.0
    warmup_s: float = 5.0

    def validate(self) -> None:
        if self.streams < 1:
            raise ValueError("--streams must be at least 1: the cost is measured on live streams")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("--min-tokens must be at least 1 and at most --max-tokens")
        if self.every_s <= 0 or self.duration_s <= 0:
            raise ValueError("--every and --duration must be positive")


def arrivals(shape: ShortShape, seed: int) -> list[tuple[float, int]]:
    """(seconds after the warm-up, prompt tokens) of each short prompt: Poisson times."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / shape.every_s)
        if t >= shape.duration_s:
            return out
        out.append((t, rng.randint(shape.min_tokens, shape.max_tokens)))


def costs(streams: list[Trace], prompts: list[Trace]) -> tuple[list[float], list[float]]:
    """Each answered prompt's cost (s): the longest stream gap overlapping its flight; and the
    gaps (s) that overlap no prompt's flight."""
    flights = sorted((p.sent, p.tokens[0]) for p in prompts if p.tokens)
    starts = [f[0] for f in flights]
    gaps = [(a, b) for s in streams for a, b in zip(s.tokens, s.tokens[1:])]
    worst = [0.0] * len(flights)
    quiet = []
    for a, b in gaps:
        hit = False
        # flights that start before the gap ends and end after it starts
        for i in range(bisect.bisect_left(starts, b) - 1, -1, -1):
            sent, first = flights[i]
            if first > a:
                worst[i] = max(worst[i], b - a)
                hit = True
            elif sent < a - 300.0:
                break  # flights end within the client's 300 s timeout: none earlier reaches it
        if not hit:
            quiet.append(b - a)
    return [w for w in worst if w > 0], quiet


def _stats(prefix: str, values_s: list[float]) -> dict:
    ms = [v * 1e3 for v in values_s]
    return {f"{prefix}_ms_p50": percentile(ms, 50), f"{prefix}_ms_p90": percentile(ms, 90),
            f"{prefix}_ms_p99": percentile(ms, 99), f"{prefix}_ms_max": max(ms, default=float("nan"))}


def summarize(streams: list[Trace], prompts: list[Trace]) -> dict:
    cost, quiet = costs(streams, prompts)
    answered = [p for p in prompts if p.tokens]
    out = {"prompts": len(prompts), "answered": len(answered),
           "errors": sorted({p.error for p in prompts + streams if p.error})[:5]}
    out.update(_stats("step", quiet))
    out.update(_stats("cost", cost))
    out.update(_stats("ttft", [p.ttft for p in answered]))
    step = out["step_ms_p50"]
    out["cost_x_step_p50"] = out["cost_ms_p50"] / step if step else float("nan")
    out["cost_x_step_max"] = out["cost_ms_max"] / step if step else float("nan")
    return out


async def run_short(base_url: str, model: str | None, shape: ShortShape = ShortShape(), seed: int = 0,
                    progress: bool = True, timeout: float = 300.0) -> dict:
    shape.validate()
    base_url = normalize_base_url(base_url)
    rng = random.Random(seed)
    say = (lambda what: print(f"[short] {what}", file=sys.stderr, flush=True)) if progress else (lambda _: None)
    limits = httpx.Limits(max_connections=shape.streams + 64, max_keepalive_connections=shape.streams + 64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        model, server_version = await discover(client, base_url, model)
        maker = PromptMaker(client, base_url, model, seed)
        plan = arrivals(shape, seed)
        say(f"sizing {len(plan)} short prompts")
        texts = [(await maker.make(n))[0] for _, n in plan]
        stream_texts = [(await maker.make(shape.stream_prompt_tokens))[0] for _ in range(shape.streams)]
        say("warm-up")
        await stream_chat(client, base_url, model, texts[0] if texts else "warm up", 1, Trace())
        t0 = time.monotonic()
        stop_at = t0 + shape.warmup_s + shape.duration_s
        streams: list[Trace] = []

        async def stream(i: int) -> None:
            await asyncio.sleep(rng.uniform(0, min(1.0, shape.warmup_s)))  # never in lockstep
            while time.monotonic() < stop_at:
                trace = Trace()
                streams.append(trace)
                await stream_chat(client, base_url, model, stream_texts[i], shape.stream_tokens, trace)
                if trace.error:
                    return

        async def short(at: float, text: str, trace: Trace) -> None:
            await asyncio.sleep(max(0.0, t0 + shape.warmup_s + at - time.monotonic()))
            await stream_chat(client, base_url, model, text, 1, trace)

        prompts = [Trace() for _ in plan]
        say(f"{shape.streams} streams, {len(plan)} short prompts over {shape.duration_s:.0f} s")
        stream_tasks = [asyncio.create_task(stream(i)) for i in range(shape.streams)]
        await asyncio.gather(*(short(at, text, p) for (at, _), text, p in zip(plan, texts, prompts)))
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        for task in stream_tasks:  # a stream still decoding is cut: its gaps so far count
            task.cancel()
        await asyncio.gather(*stream_tasks, return_exceptions=True)
    result = summarize(streams, prompts)
    result.update(bench="short", target=base_url, model=model, seed=seed, server_version=server_version,
                  shape=asdict(shape),
                  raw={"prompts": [{"sent": p.sent - t0, "ttft": p.ttft, "tokens": n}
                                   for p, (_, n) in zip(prompts, plan)]})
    return result


COLUMNS = [("config", "config"), ("step_ms_p50", "step p50 ms"), ("cost_ms_p50", "cost p50 ms"),
           ("cost_ms_p90", "p90"), ("cost_ms_p99", "p99"), ("cost_ms_max", "max"),
           ("cost_x_step_p50", "cost/step p50"), ("cost_x_step_max", "max"), ("ttft_ms_p50", "TTFT p50 ms"),
           ("ttft_ms_max", "TTFT max ms"), ("answered", "prompts")]


def add_arguments(p) -> None:
    d = ShortShape()
    p.add_argument("--base-url", required=True, help="an OpenAI-compatible server (with or without /v1)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--streams", type=int, default=d.streams, help="live streams")
    p.add_argument("--stream-tokens", type=int, default=d.stream_tokens, help="tokens each stream asks for")
    p.add_argument("--every", type=float, default=d.every_s, help="mean seconds between short prompts (Poisson)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens, help="shortest short prompt")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="longest short prompt")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of short prompts")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds of streams alone first")
    p.add_argument("--seed", type=int, default=0, help="arrival times, lengths and text")
    p.add_argument("--label", help="config name recorded in the JSON (default: the base URL)")
    p.add_argument("--json", help="write the result here")


def main(args) -> int:
    shape = ShortShape(streams=args.streams, stream_tokens=args.stream_tokens, every_s=args.every,
                       min_tokens=args.min_tokens, max_tokens=args.max_tokens, duration_s=args.duration,
                       warmup_s=args.warmup)
    try:
        result = asyncio.run(run_short(args.base_url, args.model, shape, args.seed))
    except ValueError as exc:
        print(f"bench short: {exc}", file=sys.stderr)
        return 2
    result["config"] = args.label or result["target"]
    result.update(environment())
    print(table([result], COLUMNS))
    if result["errors"]:
        print("errors:", *result["errors"], sep="\n  ", file=sys.stderr)
    if args.json:
        write_json(args.json, result)
    return 0 if result["answered"] and not result["errors"] else 1
