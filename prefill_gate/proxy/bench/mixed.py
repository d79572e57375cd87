"""Steady load: interactive users who never pause together, plus long prompts at random.

    prefill-gate bench mixed --base-url URL [--base-url URL2 ...] [--users 12] [--think 0.5]
        [--interactive-prompt 300] [--interactive-tokens 200] [--long-prompt 20000]
        [--long-every 4] [--duration 120] [--seed 0] [--seeds K] [--json F] [--plot F.png]

Three classes share one engine and each cares about something else: live streams about
every gap, new interactive requests about their first token, long prompts (agents' tool
results) about finishing in bounded time. A mode that serves one by starving another
shows here, where the one-pair overlap bench cannot show it.

- **Users** are closed loops: each starts at a random offset, sends a short prompt,
  streams its answer (a length drawn per request, 0.5x-1.5x ``interactive_tokens``),
  thinks for an exponential time, and sends again. Their send times therefore follow
  the endpoint; what is identical for every endpoint is every random draw (offsets,
  lengths, think times) and the **Poisson schedule of long-prompt arrivals**, which
  are open loop. Users never move in lockstep: synchronised users pause together and
  hand a holding proxy the idle moments that real traffic never has.
- **Prompts** are fresh text for every request and differ between endpoints (two rows
  may share one vLLM server, and shared text would hit its prefix cache). All of them
  are generated before the run, sized with the target's ``/tokenize`` once per size, so
  the bench adds no load of its own while it measures.
- **Same-run baselines**, per endpoint: the users alone (no long prompts), for the solo
  gaps and TTFTs, and the long prompt alone, for "x alone".

Every time is taken by the client on arrival of each content chunk (the same definition
of a content chunk as the overlap bench). With ``time_scale`` X (a simulator slowed by
``--time-scale X``), the schedule's times are stretched by X and every reported time is
divided by X, so rows read in the engine's own time.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from .client_gc import ClientCollections
from .overlap import PromptMaker, Trace, discover, normalize_base_url, stream_chat
from .report import percentile

# A gap longer than this is a visible stall to a reader (the "gaps > 50 ms").
STALL_MS = 50.0
# Gap histogram edges: 0.1 ms .. 100 s, 20 bins per decade (the JSON keeps the shape of
# every CDF without every gap).
HIST_EDGES_MS = [10 ** (e / 20) for e in range(-20, 101)]


@dataclass(frozen=True)
class MixedShape:
    users: int = 12
    think: float = 0.5  # mean think time, seconds (exponential)
    interactive_prompt: int = 300  # tokens, chat template included
    interactive_tokens: int = 200  # mean streamed tokens; each request draws 0.5x-1.5x
    long_prompt: int = 20_000
    long_tokens: int = 32  # streamed tokens of a long prompt's answer
    long_every: float = 4.0  # mean seconds between long prompts (Poisson)
    duration: float = 120.0  # seconds of steady load measured
    baseline_duration: float = 30.0  # seconds of the users alone
    long_alone_runs: int = 3
    start_spread: float = 2.0  # users start at uniform offsets in [0, start_spread)

    def validate(self) -> None:
        for name in ("users", "interactive_prompt", "interactive_tokens", "long_prompt", "long_tokens",
                     "long_alone_runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        for name in ("think", "long_every", "duration", "baseline_duration"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive")
        if self.start_spread < 0:
            raise ValueError("start-spread must not be negative")


@dataclass(frozen=True)
class SLO:
    """Per-request objectives. ``ttft_ms``, ``tpot_ms`` and ``e2el_ms`` make goodput in
    ``vllm bench serve --goodput``'s sense (a request counts when it meets every one set);
    ``max_gap_ms`` with ``ttft_ms`` makes the strict share (every gap within it);
    ``long_x`` bounds a long prompt's TTFT as a multiple of its time alone."""

    ttft_ms: float | None = 150.0
    tpot_ms: float | None = 15.0
    e2el_ms: float | None = None
    max_gap_ms: float = 50.0
    long_x: float = 3.0


# ------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class UserPlan:
    start: float  # seconds after the phase starts
    requests: tuple[tuple[int, float], ...]  # (tokens to stream, think time after it)


@dataclass(frozen=True)
class Schedule:
    """Every random draw of one phase: the same for every endpoint of one seed."""

    users: tuple[UserPlan, ...]
    long_arrivals: tuple[float, ...]  # seconds after the phase starts (Poisson)

    def requests_per_user(self) -> int:
        return len(self.users[0].requests) if self.users else 0


def make_schedule(shape: MixedShape, seed: int, duration: float, with_long: bool = True) -> Schedule:
    """Draws for one phase of ``duration`` seconds. A user can never send more requests
    than it has think times, so a plan of 2 x duration / think + 16 requests per user
    outlasts any phase but one where requests take no time at all."""
    rng = random.Random(seed)
    n = int(2 * duration / shape.think) + 16
    lo, hi = max(1, round(0.5 * shape.interactive_tokens)), max(1, round(1.5 * shape.interactive_tokens))
    users = []
    for _ in range(shape.users):
        start = rng.uniform(0, shape.start_spread)
        reqs = tuple((rng.randint(lo, hi), rng.expovariate(1 / shape.think)) for _ in range(n))
        users.append(UserPlan(start, reqs))
    arrivals = []
    if with_long:
        long_rng = random.Random(f"{seed}-long")  # its own stream: more users do not move it
        t = long_rng.expovariate(1 / shape.long_every)
        while t < duration:
            arrivals.append(t)
            t += long_rng.expovariate(1 / shape.long_every)
    return Schedule(tuple(users), tuple(arrivals))


def stretched(s: Schedule, factor: float) -> Schedule:
    """The same draws with every time multiplied (a simulator run ``factor`` times slower)."""
    if factor == 1:
        return s
    users = tuple(UserPlan(u.start * factor, tuple((n, th * factor) for n, th in u.requests)) for u in s.users)
    return Schedule(users, tuple(t * factor for t in s.long_arrivals))


# ------------------------------------------------------------------- the records
@dataclass
class Record:
    """One request as the client saw it; times in seconds since the phase started."""

    cls: str  # "interactive" | "long"
    user: int  # -1 for long prompts
    planned_tokens: int
    trace: Trace = field(default_factory=Trace)

    @property
    def ok(self) -> bool:
        return self.trace.error is None and bool(self.trace.tokens) and self.trace.end > 0

    @property
    def ttft(self) -> float:
        return self.trace.ttft

    @property
    def e2el(self) -> float:
        return self.trace.end - self.trace.sent

    @property
    def tpot(self) -> float:
        """vLLM's TPOT: (latency - TTFT) / (output tokens - 1), 0 for a one-token answer."""
        n = len(self.trace.tokens)
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else 0.0

    def gaps(self) -> list[float]:
        ts = self.trace.tokens
        return [b - a for a, b in zip(ts, ts[1:])]


def goodput(records: list[Record], slo: SLO, seconds: float, scale: float = 1.0) -> dict:
    """Interactive requests meeting the SLOs: vLLM's goodput (per second, and as a share of
    the requests sent) and the strict share (TTFT within ``slo.ttft_ms`` and every gap within
    ``slo.max_gap_ms``). Failed requests count as sent and never as good. ``scale`` divides
    measured times (a slowed simulator)."""
    inter = [r for r in records if r.cls == "interactive"]
    good = strict = 0
    for r in inter:
        if not r.ok:
            continue
        ttft_ms, tpot_ms, e2el_ms = (r.ttft / scale * 1e3, r.tpot / scale * 1e3, r.e2el / scale * 1e3)
        meets = ((slo.ttft_ms is None or ttft_ms <= slo.ttft_ms)
                 and (slo.tpot_ms is None or tpot_ms <= slo.tpot_ms)
                 and (slo.e2el_ms is None or e2el_ms <= slo.e2el_ms))
        good += meets
        max_gap_ms = max(r.gaps(), default=0.0) / scale * 1e3
        strict += (slo.ttft_ms is None or ttft_ms <= slo.ttft_ms) and max_gap_ms <= slo.max_gap_ms
    n = len(inter)
    return {
        "goodput_rps": good / (seconds / scale) if seconds > 0 else float("nan"),
        "goodput_share": good / n if n else float("nan"),
        "strict_share": strict / n if n else float("nan"),
    }


def no_stream_share(records: list[Record], start: float, end: float) -> float:
    """Share of [start, end) with no interactive answer streaming (first token to last):
    the moments a proxy that holds long prompts until streams end can use."""
    spans = sorted((r.trace.tokens[0], r.trace.tokens[-1]) for r in records
                   if r.cls == "interactive" and r.trace.tokens)
    covered, cursor = 0.0, start
    for a, b in spans:
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return 1 - covered / (end - start) if end > start else float("nan")


def _hist(values_ms: list[float]) -> list[int]:
    counts = [0] * (len(HIST_EDGES_MS) + 1)
    for v in values_ms:
        lo, hi = 0, len(HIST_EDGES_MS)
        while lo < hi:  # first edge above v
            mid = (lo + hi) // 2
            if HIST_EDGES_MS[mid] <= v:
                lo = mid + 1
            else:
                hi = mid
        counts[lo] += 1
    return counts


def worst_gaps(records: list[Record], scale: float = 1.0, n: int = 12) -> list[list[float]]:
    """The ``n`` largest gaps, largest first, each ``[ended at s, gap ms, user]``: to place a
    phase's worst moments beside the long prompts' arrivals (``long_arrivals_s``) and a proxy's
    or an engine's log. One slow engine step shows as the same gap in every stream it held."""
    top = heapq.nlargest(n, ((b - a, b, r.user) for r in records if r.ok
                             for a, b in zip(r.trace.tokens, r.trace.tokens[1:])))
    return [[round(end / scale, 4), round(gap / scale * 1e3, 2), user] for gap, end, user in top]


def summarize(records: list[Record], seconds: float, slo: SLO, long_alone_s: float | None,
              scale: float = 1.0) -> dict:
    """The per-class figures of one phase (every time in ms or s of engine time)."""
    inter = [r for r in records if r.cls == "interactive"]
    longs = [r for r in records if r.cls == "long"]
    gaps_ms = [g / scale * 1e3 for r in inter if r.ok for g in r.gaps()]
    ttft_ms = [r.ttft / scale * 1e3 for r in inter if r.ok]
    tpot_ms = [r.tpot / scale * 1e3 for r in inter if r.ok and len(r.trace.tokens) > 1]
    long_ttft = [r.ttft / scale for r in longs if r.ok]
    out = {
        "interactive_sent": len(inter),
        "interactive_completed": sum(r.ok for r in inter),
        "interactive_failed": sum(not r.ok for r in inter),
        "interactive_rate_rps": len(inter) / (seconds / scale),
        "interactive_gaps": len(gaps_ms),
        "itl_ms_p50": percentile(gaps_ms, 50),
        "itl_ms_p99": percentile(gaps_ms, 99),
        "itl_ms_p999": percentile(gaps_ms, 99.9),
        "itl_ms_max": max(gaps_ms, default=float("nan")),
        "gaps_over_50ms_share": (sum(g > STALL_MS for g in gaps_ms) / len(gaps_ms)) if gaps_ms else float("nan"),
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "ttft_ms_max": max(ttft_ms, default=float("nan")),
        "tpot_ms_p50": percentile(tpot_ms, 50),
        "tpot_ms_p99": percentile(tpot_ms, 99),
        "no_stream_share": no_stream_share(records, 0.0, seconds),
        "gap_hist": _hist(gaps_ms),
        "worst_gaps": worst_gaps(inter, scale),
        "ttft_ms_all": sorted(round(t, 2) for t in ttft_ms),
        **goodput(records, slo, seconds, scale),
    }
    if longs:
        out.update({
            "long_sent": len(longs),
            "long_completed": sum(r.ok for r in longs),
            "long_failed": sum(not r.ok for r in longs),
            "long_ttft_s_p50": percentile(long_ttft, 50),
            "long_ttft_s_p90": percentile(long_ttft, 90),
            "long_ttft_s_max": max(long_ttft, default=float("nan")),
            "long_total_s_p50": percentile([r.e2el / scale for r in longs if r.ok], 50),
            "long_ttft_s_all": sorted(round(t, 4) for t in long_ttft),
        })
        if long_alone_s:
            out.update({
                "long_x_p50": out["long_ttft_s_p50"] / long_alone_s,
                "long_x_p90": out["long_ttft_s_p90"] / long_alone_s,
                "long_x_max": out["long_ttft_s_max"] / long_alone_s,
                "long_within_slo_share": (sum(t <= slo.long_x * long_alone_s for t in long_ttft) / len(longs)),
            })
    errors = sorted({r.trace.error for r in records if r.trace.error})
    if errors:
        out["errors"] = errors[:10]
    return out


# -------------------------------------------------------------------- the run
class Prompts:
    """Fresh prompt texts, sized once per size with the target's /tokenize, then made with
    the learned characters per token (no /tokenize calls while anything is measured)."""

    def __init__(self, maker: PromptMaker):
        self.maker = maker
        self.sized: dict[int, dict] = {}  # tokens -> {"chars_per_token", "counted"}

    async def calibrate(self, tokens: int) -> None:
        _, count = await self.maker.make(tokens)
        self.sized[tokens] = {"chars_per_token": self.maker.chars_per_token, "counted": count}

    def make(self, tokens: int) -> str:
        cpt = self.sized[tokens]["chars_per_token"] if self.maker.has_tokenize else 4.0
        overhead = self.maker.overhead or 0
        return self.maker._text(max(1, int(max(1, tokens - overhead) * cpt)))


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class PhaseRun:
    """One phase against one endpoint: users in closed loops, long prompts on schedule."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, shape: MixedShape, scale: float = 1.0):
        self.client, self.url, self.model, self.shape = client, url, model, shape
        self.scale = scale
        self.t0_unix = math.nan  # the last run's start on the wall clock: its times + this = a log's
        self.collections: dict = {}  # the last run's own collections (ClientCollections.summary)

    async def run(self, schedule: Schedule, user_prompts: list[list[str]], long_prompts: list[str],
                  seconds: float, drain: float) -> list[Record]:
        records: list[Record] = []
        with ClientCollections() as collections:
            t0, self.t0_unix = time.monotonic(), time.time()
            stop_at = t0 + seconds
            tasks = [asyncio.create_task(self._user(i, plan, user_prompts[i], t0, stop_at, records))
                     for i, plan in enumerate(schedule.users)]
            tasks += [asyncio.create_task(self._long(at, prompt, t0, records))
                      for at, prompt in zip(schedule.long_arrivals, long_prompts)]
            done, pending = await asyncio.wait(tasks, timeout=seconds + drain)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.collections = collections.summary(t0, self.scale)
        for r in records:  # times relative to the phase's start
            tr = r.trace
            if tr.error is None and (not tr.end or not tr.tokens):
                tr.error = "unfinished when the drain bound passed" if not tr.end else "no content"
            tr.sent -= t0
            tr.end = tr.end - t0 if tr.end else 0.0
            tr.tokens = [x - t0 for x in tr.tokens]
        return records

    async def _user(self, i: int, plan: UserPlan, prompts: list[str], t0: float, stop_at: float,
                    records: list[Record]) -> None:
        await _sleep_until(t0 + plan.start)
        for (tokens, think), prompt in zip(plan.requests, prompts):
            if time.monotonic() >= stop_at:
                return
            rec = Record("interactive", i, tokens)
            records.append(rec)
            await stream_chat(self.client, self.url, self.model, prompt, tokens, rec.trace)
            await asyncio.sleep(think)

    async def _long(self, at: float, prompt: str, t0: float, records: list[Record]) -> None:
        await _sleep_until(t0 + at)
        rec = Record("long", -1, self.shape.long_tokens)
        records.append(rec)
        await stream_chat(self.client, self.url, self.model, prompt, self.shape.long_tokens, rec.trace)


def _prompt_pools(prompts: Prompts, shape: MixedShape, schedule: Schedule) -> tuple[list[list[str]], list[str]]:
    users = [[prompts.make(shape.interactive_prompt) for _ in u.requests] for u in schedule.users]
    longs = [prompts.make(shape.long_prompt) for _ in schedule.long_arrivals]
    return users, longs


async def measure_endpoint(url: str, label: str, shape: MixedShape, slo: SLO, seed: int,
                           model: str | None = None, time_scale: float = 1.0, progress: bool = True,
                           timeout: float = 600.0) -> dict:
    """Warm-up, the long prompt alone, the users alone, then steady load, on one endpoint."""
    url = normalize_base_url(url)
    scale = time_scale

    def say(what: str) -> None:
        if progress:
            print(f"[mixed] {label} (seed {seed}): {what}", file=sys.stderr, flush=True)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        model, server_version = await discover(client, url, model)
        # Fresh text for every endpoint and call; the schedule depends on the seed alone.
        prompts = Prompts(PromptMaker(client, url, model, seed=random.SystemRandom().randrange(1 << 30)))
        say("sizing prompts with /tokenize")
        await prompts.calibrate(shape.interactive_prompt)
        await prompts.calibrate(shape.long_prompt)
        base = stretched(make_schedule(shape, seed, shape.baseline_duration, with_long=False), scale)
        mixed = stretched(make_schedule(shape, seed + 1_000_003, shape.duration), scale)
        base_pools = _prompt_pools(prompts, shape, base)
        mixed_pools = _prompt_pools(prompts, shape, mixed)
        alone_prompts = [prompts.make(shape.long_prompt) for _ in range(shape.long_alone_runs)]
        warm = [prompts.make(shape.interactive_prompt) for _ in range(shape.users)]
        warm_long = prompts.make(shape.long_prompt)

        say("warm-up")
        phase = PhaseRun(client, url, model, shape, scale)
        warm_traces = [Trace() for _ in range(len(warm) + 1)]
        await stream_chat(client, url, model, warm_long, shape.long_tokens, warm_traces[-1])
        await asyncio.gather(*(stream_chat(client, url, model, p, shape.interactive_tokens, t)
                               for p, t in zip(warm, warm_traces)))
        failed = [t.error for t in warm_traces if t.error]
        if failed:
            raise RuntimeError(f"{label}: warm-up failed: {failed[0]}")

        say(f"the long prompt alone x{shape.long_alone_runs}")
        alone = []
        for p in alone_prompts:
            t = await stream_chat(client, url, model, p, shape.long_tokens, Trace())
            if t.error:
                raise RuntimeError(f"{label}: the long prompt alone failed: {t.error}")
            alone.append(t.ttft / scale)
        long_alone_s = percentile(alone, 50)

        say(f"the users alone for {shape.baseline_duration:g} s")
        drain = max(60.0, shape.duration) * scale
        base_records = await phase.run(base, *base_pools, shape.baseline_duration * scale, drain)
        base_t0, base_collections = phase.t0_unix, phase.collections
        say(f"steady load for {shape.duration:g} s ({len(mixed.long_arrivals)} long prompts)")
        mixed_records = await phase.run(mixed, *mixed_pools, shape.duration * scale, drain)

    result = {
        "label": label, "target": url, "model": model, "server_version": server_version, "seed": seed,
        "prompt_sizing": {str(k): v for k, v in prompts.sized.items()},
        "long_alone_ttft_s": alone, "long_alone_ttft_s_p50": long_alone_s,
        "baseline": summarize(base_records, shape.baseline_duration * scale, slo, None, scale),
        "mixed": summarize(mixed_records, shape.duration * scale, slo, long_alone_s, scale),
        "long_arrivals_s": list(make_schedule(shape, seed + 1_000_003, shape.duration).long_arrivals),
    }
    b, m = result["baseline"], result["mixed"]
    b["t0_unix"], m["t0_unix"] = round(base_t0, 3), round(phase.t0_unix, 3)  # worst_gaps' and arrivals' zero
    b["client_gc"], m["client_gc"] = base_collections, phase.collections  # the client's own pauses
    result["mixed"]["itl_p99_x_baseline"] = m["itl_ms_p99"] / b["itl_ms_p99"] if b["itl_ms_p99"] else float("nan")
    return result


async def run_mixed(urls: list[str], labels: list[str], shape: MixedShape = MixedShape(), slo: SLO = SLO(),
                    seeds: list[int] = (0,), model: str | None = None, time_scale: float = 1.0,
                    progress: bool = True) -> dict:
    shape.validate()
    if time_scale <= 0:
        raise ValueError("time-scale must be positive")
    endpoints = []
    for url, label in zip(urls, labels):
        runs = [await measure_endpoint(url, label, shape, slo, s, model, time_scale, progress) for s in seeds]
        endpoints.append({"label": label, "target": normalize_base_url(url), "runs": runs,
                          "range": spread(runs)})
    return {"bench": "mixed", "shape": asdict(shape), "slo": asdict(slo), "seeds": list(seeds),
            "time_scale": time_scale, "endpoints": endpoints}


RANGE_KEYS = ("itl_ms_p50", "itl_ms_p99", "itl_ms_p999", "itl_ms_max", "gaps_over_50ms_share", "ttft_ms_p50",
              "ttft_ms_p99", "long_ttft_s_p50", "long_ttft_s_p90", "long_ttft_s_max", "long_x_p50", "long_x_p90",
              "goodput_rps", "goodput_share", "strict_share", "interactive_rate_rps")


def spread(runs: list[dict]) -> dict:
    """[min, max] of each headline figure over the runs (seeds) of one endpoint."""
    out = {}
    for k in RANGE_KEYS:
        vals = [r["mixed"].get(k) for r in runs if isinstance(r["mixed"].get(k), (int, float))]
        vals = [v for v in vals if not math.isnan(v)]
        if vals:
            out[k] = [min(vals), max(vals)]
    return out


# ------------------------------------------------------------------ reporting
