"""PREFILL_GATE_PACING_SHORT_STEP_X on the H200's measured step law: a model (CPU, no GPU).

    .venv/bin/python bench/short_step_x.py [--seeds 3] [--json F]

Issue 50's one bound the H200 missed is a short prompt's cost to live streams: 2.48x their
decode step at the median (bound 2x; bench/results/hybrid/h200/run-0bbf63f/). Lower targets met
it and slowed long prompts past 2x alone. SHORT_STEP_X lowers the aim only for steps whose
pending prefill is all short prompts. This predicts, before the card is measured, what each
setting gives on the two parts that judge it, every configuration on the same draws:

    short   4 streams; a 200-400-token prompt every ~1.2 s (Poisson), one output token, 60 s.
            cost: the longest stream gap overlapping the prompt's flight (`bench short`'s)
    steady  8 users (300-token prompts, 100-300 streamed tokens, think ~0.5 s, each on its own
            plan) and a 20k prompt every ~10 s (Poisson, its own draws), 90 s; the users alone
            for 20 s and the 20k prompt alone three times first (`bench mixed`'s schedule)
    pair    the seed pair: a stream B, then a 28.6k-token prompt A three times, one after the
            other: B's worst gap during A's flight, A's time to first token against A alone

The scheduler is vLLM 0.26's own AsyncScheduler with the plugin's pacing (PacedAsyncScheduler,
the engine tests' harness: no model), configured as the stack serves the 27B hybrid: prefix
caching in align mode with blocks of 1,568 tokens, --max-num-batched-tokens 2048,
--max-num-seqs 64, CUDA graphs to 512 tokens, adaptive pacing below the align block, short
prompts first. A fake clock gives each step what the H200 measured for steps of its size
(`--law`, step_sizes.py's medians of run-0bbf63f's steady load: a mixed step padded to a graph
size takes that size's median; a step with no prefill the streams' 15.2 ms; a step past the
graphs, or with no decodes, 15.2 ms + the 256-token graph's cost a token). Medians only by
default: no step runs slow, so maxima and p99s are the law's, not the card's. `--noise N` runs
each configuration N times instead, every step's median times a ratio drawn from what the card's
own steps of that kind did (`StepNoise`: the law run's step trace), so that the figures' range
shows how far one run of the same draws can land from another. Prompts are distinct token lists
(no prefix hits between them).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import step_sizes  # noqa: E402

from prefill_gate.proxy.bench.mixed import MixedShape, make_schedule  # noqa: E402
from prefill_gate.proxy.bench.overlap import Trace  # noqa: E402
from prefill_gate.proxy.bench.report import environment, percentile, table, write_json  # noqa: E402
from prefill_gate.proxy.bench.short import ShortShape, arrivals, costs  # noqa: E402

LAW = Path(__file__).resolve().parent / "results/hybrid/h200/run-0bbf63f/step-sizes.json"
DECODE_MS = 15.2  # the stack's decode step beside 4 streams in that run (defaults.json, short part)
GRAPH_SIZES = [1, 2, 4, *range(8, 129, 8), 160, 192, 224, 256, 320, 384, 448, 512]  # the stack's, to 512
BLOCK = 1568  # the 27B hybrid's align block
# The hybrid stack as bench/gpu/defaults_h200.sh CLASS=hybrid runs it; each configuration below
# changes only what it names.
STACK_ENV = {"PREFILL_GATE_PACING": "adaptive", "PREFILL_GATE_PACING_TARGET_ITL_MS": "44",
             "PREFILL_GATE_PACING_SUB_BLOCK": "1", "PREFILL_GATE_PACING_LOG_INTERVAL_S": "0"}
CONFIGS = {  # name -> settings over STACK_ENV; the first two are rows the H200 measured
    "as shipped (44 ms)": {},
    "target 30 ms": {"PREFILL_GATE_PACING_TARGET_ITL_MS": "30"},
    "SHORT_STEP_X=2": {"PREFILL_GATE_PACING_SHORT_STEP_X": "2"},
    "SHORT_STEP_X=1.8": {"PREFILL_GATE_PACING_SHORT_STEP_X": "1.8"},
    # new requests beside a long prompt: short ones first with no share kept for the long one
    "LONG_MIN_SHARE=0": {"PREFILL_GATE_PACING_LONG_MIN_SHARE": "0"},
    "SHORT_STEP_X=2 LONG_MIN_SHARE=0": {"PREFILL_GATE_PACING_SHORT_STEP_X": "2",
                                        "PREFILL_GATE_PACING_LONG_MIN_SHARE": "0"},
    # the H100's ~21 ms step: 1.5x it is the H200's 2x 15.2 ms, where 2 changes nothing
    "SHORT_STEP_X=1.5": {"PREFILL_GATE_PACING_SHORT_STEP_X": "1.5"},
    "SHORT_STEP_X=1.5 LONG_MIN_SHARE=0": {"PREFILL_GATE_PACING_SHORT_STEP_X": "1.5",
                                          "PREFILL_GATE_PACING_LONG_MIN_SHARE": "0"},
}
DEFAULT_CONFIGS = list(CONFIGS)[:4]
# What the cards measured, by the law's run: the H200's (run-0bbf63f's README: the stack's row,
# target30/) and an H100's (run-b088fbb's defaults.json, the stack's row).
MEASURED = {
    "run-0bbf63f": {
        "as shipped (44 ms)": {"short_cost_ms_p50": 37.7, "short_cost_x_step_p50": 2.48, "gaps_ms_p99": 43.2,
                               "gaps_x_alone_p99": 1.16, "long_x_p50": 1.76, "b_max_ms": 45.2, "a_x": 1.51},
        "target 30 ms": {"short_cost_ms_p50": 29.1, "short_cost_x_step_p50": 1.91, "gaps_ms_p99": 31.0,
                         "gaps_x_alone_p99": 1.21, "long_x_p50": 2.18},
    },
    "run-b088fbb": {
        "as shipped (44 ms)": {"short_cost_ms_p50": 37.6, "short_cost_x_step_p50": 1.80, "gaps_ms_p99": 44.3,
                               "gaps_x_alone_p99": 1.18, "long_x_p50": 1.88, "b_max_ms": 48.5, "a_x": 1.65},
        # another H100, run-7c98b03 (its as-shipped row there: 37.2 ms, 1.83x)
        "SHORT_STEP_X=1.5": {"short_cost_ms_p50": 28.7, "short_cost_x_step_p50": 1.42, "short_cost_x_step_max": 1.84,
                             "short_ttft_ms_p50": 118.8},
        "LONG_MIN_SHARE=0": {"gaps_ms_p99": 44.8, "gaps_x_alone_p99": 1.21, "ttft_ms_p99": 314.2, "long_x_p50": 1.85},
    },
}


class StepLaw:
    """A step's time on the H200 from what its steps of the same size took there (seconds)."""

    def __init__(self, path: Path, decode_ms: float = DECODE_MS):
        rows = json.loads(path.read_text())["rows"]
        self.mixed = {r["graph_size"]: r["median_ms"] / 1e3 for r in rows}
        self.decode = decode_ms / 1e3
        self.per_token = (self.mixed[256] - self.decode) / 256  # a prefill token past the graphs
        self.sizes = sorted(GRAPH_SIZES)

    def seconds(self, tokens: int, prefill: int, decodes: int) -> float:
        if not prefill:
            return self.decode
        if decodes and tokens <= self.sizes[-1]:
            padded = self.sizes[bisect.bisect_left(self.sizes, tokens)]
            if padded in self.mixed:
                return self.mixed[padded]
            below = max((s for s in self.mixed if s < padded), default=None)  # 384-512: measured rarely or never
            if below is not None:
                return self.mixed[below] + self.per_token * (padded - below)
            # smaller than any size measured (a prompt's last few tokens beside a decode or two)
        return self.decode + self.per_token * prefill

    def __call__(self, step, scheduler) -> float:
        return self.seconds(step.output.total_num_scheduled_tokens, step.prefill_tokens, len(step.decode_tokens))


class StepNoise:
    """A step's time over its kind's median, as the card's own steps had it, drawn one a step.

    From the law run's step trace (PREFILL_GATE_PACING_TRACE_FILE): every traced step with decodes
    whose two next steps have decodes too (around a prefill-only step or a request's end the
    interval between calls is not one step's time: such intervals, 3-11x a step, are left out),
    grouped as mixed or decode-only and by CUDA-graph size (groups of 5 steps or more), each
    step's time divided by its group's median. Drawn independently for every step: a host
    stall that lasts several steps on the card is here several independent draws, and the trace's
    own pacing and load decide how often each kind of step was slow. Read once; each run draws
    with a generator of its own (`drawn_with`).
    """

    def __init__(self, trace: Path):
        records = step_sizes.read(trace)
        groups: dict[tuple[bool, int | None], list[float]] = {}
        for r, nxt, after in zip(records, records[1:], records[2:]):
            if not (r.get("decode_rows") and nxt.get("decode_rows") and after.get("decode_rows")):
                continue
            seconds = after["t"] - nxt["t"]  # async scheduling: a step runs from the next call to the one after
            if 0 < seconds < step_sizes.IDLE_S:
                groups.setdefault((bool(r.get("chunks")), r.get("graph_size")), []).append(seconds)
        self.ratios: dict[bool, list[float]] = {True: [], False: []}
        for (mixed, _), times in groups.items():
            if len(times) >= 5:
                median = statistics.median(times)
                self.ratios[mixed] += [t / median for t in times]
        if not (self.ratios[True] and self.ratios[False]):
            raise ValueError(f"{trace}: too few traced steps to draw both kinds' noise from")

    def drawn_with(self, rng: random.Random) -> Callable[[bool], float]:
        """A step's ratio (mixed: it prefills) from ``rng``."""
        return lambda mixed: rng.choice(self.ratios[mixed])


class Driver:
    """Requests sent at their times on the engine's fake clock; each one's tokens as a client sees
    them (a token arrives when its step's output reaches the scheduler)."""

    def __init__(self, engine, rng: random.Random):
        self.engine = engine
        self.rng = rng
        self.traces: dict[str, Trace] = {}
        self.on_done: dict[str, object] = {}
        self._events: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._seen = 0  # steps whose tokens are counted

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def send(self, prompt_tokens: int, max_tokens: int, prefix: str, sent: float, on_done=None) -> str:
        rid = f"{prefix}{next(self._ids)}"
        tokens = [self.rng.randrange(3, 250) for _ in range(prompt_tokens)]
        self.engine.add(prompt_tokens, max_tokens, rid, tokens=tokens)
        self.traces[rid] = Trace(sent=sent)
        if on_done is not None:
            self.on_done[rid] = on_done
        return rid

    def abort(self, rids: list[str]) -> None:
        """End these requests as a client that hangs up would, and run until the engine is idle."""
        from vllm.v1.request import RequestStatus

        self.engine.scheduler.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        self.run(done=lambda: not self.engine.scheduler.has_requests())
        self.engine.drain()

    def drop_pending(self) -> None:
        """Forget arrivals not yet due (a phase's users' turns past its end)."""
        self._events.clear()

    def run(self, until: float | None = None, done=None, max_steps: int = 200_000) -> None:
        """Until the clock passes ``until`` or ``done()`` holds (requests in flight keep running)."""
        engine, sched = self.engine, self.engine.scheduler
        for _ in range(max_steps):
            while self._events and self._events[0][0] <= engine.now:
                _, _, fn = heapq.heappop(self._events)
                fn()
            if (until is not None and engine.now >= until) or (done is not None and done()):
                return
            if not sched.has_requests():
                if not self._events:
                    return
                engine.now = max(engine.now, self._events[0][0])  # idle until the next arrival
                continue
            engine.step()
            self._collect()
        raise RuntimeError(f"not done after {max_steps} steps")

    def _collect(self) -> None:
        engine = self.engine
        while self._seen in engine.done_at:
            i, self._seen = self._seen, self._seen + 1
            at = engine.done_at[i]
            step = engine.steps[i]
            got = [rid for rid in step.decode_tokens] + [
                rid for rid in step.output.num_scheduled_tokens
                if rid not in step.decoding and engine.first_token.get(rid) == i]
            for rid in got:
                if rid in self.traces:
                    self.traces[rid].tokens.append(at)
            for rid in [r for r in self.on_done if engine.finished.get(r) == i]:  # the few awaited
                self.traces[rid].end = at
                self.on_done.pop(rid)(rid)


def fresh_engine(settings: dict, law: StepLaw, model: Path, noise: Callable[[bool], float] | None = None):
    from prefill_gate.engine_patches.pacing import PacedAsyncScheduler
    from tests.engine.harness import Engine, build

    saved = {k: v for k, v in os.environ.items() if k.startswith("PREFILL_GATE_PACING")}
    for key in saved:  # the scheduler reads its settings once, here: only these
        del os.environ[key]
    os.environ.update({**STACK_ENV, **settings})
    try:
        scheduler = build(PacedAsyncScheduler, model, block_size=BLOCK, hybrid_align=True, enable_prefix_caching=True,
                          num_blocks=600, max_num_seqs=64, max_num_batched_tokens=2048, async_scheduling=True,
                          graph_sizes=GRAPH_SIZES, graph_mode="FULL")
    finally:
        for key in [k for k in os.environ if k.startswith("PREFILL_GATE_PACING")]:
            del os.environ[key]
        os.environ.update(saved)
    cost = law if noise is None else lambda step, sched: law(step, sched) * noise(bool(step.prefill_tokens))
    return Engine(scheduler, depth=2, cost=cost)


def warm_up(d: Driver) -> None:
    """Four streams and an 8,000-token prompt: the pacer's fit has its mixed steps (as the bench's
    warm-up gives a server that has served before)."""
    now = d.engine.now
    streams = [d.send(40, 400, "w", now) for _ in range(4)]
    d.run(done=lambda: all(d.traces[s].tokens for s in streams))
    big = d.send(8000, 1, "w", d.engine.now)
    d.run(done=lambda: big in d.engine.finished)
    d.run(done=lambda: all(s in d.engine.finished for s in streams))


def short_part(d: Driver, seed: int, shape: ShortShape = ShortShape()) -> dict:
    t0 = d.engine.now + 1.0
    end = t0 + shape.warmup_s + shape.duration_s
    streams: list[str] = []

    def stream(_rid=None) -> None:
        if d.engine.now < end:
            streams.append(d.send(shape.stream_prompt_tokens, shape.stream_tokens, "s", d.engine.now, stream))

    offsets = random.Random(f"{seed}-streams")
    for _ in range(shape.streams):
        d.at(t0 + offsets.uniform(0, 1.0), stream)
    prompts: list[str] = []
    for at, tokens in arrivals(shape, seed):
        t = t0 + shape.warmup_s + at
        d.at(t, lambda t=t, tokens=tokens: prompts.append(d.send(tokens, 1, "p", t)))
    d.run(until=end)
    d.run(done=lambda: all(p in d.engine.finished for p in prompts))
    d.abort(streams)  # the streams end here: their tokens so far are what was measured
    cost, quiet = costs([d.traces[s] for s in streams], [d.traces[p] for p in prompts])
    step = statistics.median(quiet) * 1e3
    ms = [c * 1e3 for c in cost]
    ttft = [d.traces[p].ttft * 1e3 for p in prompts]
    return {"prompts": len(prompts), "step_ms_p50": step, "cost_ms_p50": percentile(ms, 50),
            "cost_ms_p90": percentile(ms, 90), "cost_ms_max": max(ms), "cost_x_step_p50": percentile(ms, 50) / step,
            "cost_x_step_max": max(ms) / step, "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99)}


def users_phase(d: Driver, shape: MixedShape, seed: int, duration: float, with_long: bool) -> dict:
    """One phase of `bench mixed`'s schedule; the users' gaps and TTFTs, the long prompts' TTFTs."""
    plan = make_schedule(shape, seed, duration, with_long)
    t0 = d.engine.now + 0.5
    end = t0 + duration
    user_rids: list[str] = []
    long_rids: list[str] = []

    def turn(u: int, k: int, at: float) -> None:
        if at >= end or k >= len(plan.users[u].requests):
            return
        tokens, think = plan.users[u].requests[k]

        def next_turn(_rid) -> None:
            t = d.engine.now + think
            d.at(t, lambda: turn(u, k + 1, t))

        user_rids.append(d.send(shape.interactive_prompt, tokens, "u", at, next_turn))

    for u, user in enumerate(plan.users):
        at = t0 + user.start
        d.at(at, lambda u=u, at=at: turn(u, 0, at))
    for a in plan.long_arrivals:
        t = t0 + a
        d.at(t, lambda t=t: long_rids.append(d.send(shape.long_prompt, shape.long_tokens, "L", t)))
    d.run(until=end)
    d.run(done=lambda: not d.engine.scheduler.has_requests() or all(
        r in d.engine.finished for r in user_rids + long_rids))
    d.engine.drain()
    d.drop_pending()  # turns not yet sent belong to no phase
    gaps = [(b - a) * 1e3 for r in user_rids for a, b in zip(d.traces[r].tokens, d.traces[r].tokens[1:])
            if b <= end]
    return {"gaps_ms": gaps, "ttft_ms": [d.traces[r].ttft * 1e3 for r in user_rids if d.traces[r].tokens],
            "long_ttft_s": [d.traces[r].ttft for r in long_rids if d.traces[r].tokens]}


def steady_part(d: Driver, seed: int) -> dict:
    shape = MixedShape(users=8, long_every=10.0, duration=90.0, baseline_duration=20.0)
    alone = users_phase(d, shape, seed, shape.baseline_duration, with_long=False)
    long_alone = []
    for _ in range(shape.long_alone_runs):
        rid = d.send(shape.long_prompt, 1, "A", d.engine.now)
        d.run(done=lambda rid=rid: rid in d.engine.finished)
        d.engine.drain()
        long_alone.append(d.traces[rid].ttft)
    mixed = users_phase(d, shape, seed + 1_000_003, shape.duration, with_long=True)
    alone_p99 = percentile(alone["gaps_ms"], 99)
    alone_s = statistics.median(long_alone)
    return {"users_alone_gaps_ms_p99": alone_p99, "long_alone_s": alone_s,
            "gaps_ms_p99": percentile(mixed["gaps_ms"], 99), "gaps_ms_max": max(mixed["gaps_ms"]),
            "gaps_x_alone_p99": percentile(mixed["gaps_ms"], 99) / alone_p99,
            "ttft_ms_p99": percentile(mixed["ttft_ms"], 99), "long_prompts": len(mixed["long_ttft_s"]),
            "long_x_p50": statistics.median(mixed["long_ttft_s"]) / alone_s,
            "long_x_max": max(mixed["long_ttft_s"]) / alone_s}


def pair_part(d: Driver, runs: int = 3, a_tokens: int = 28_600) -> dict:
    """The seed pair on one server: A alone, then B streaming and A ``runs`` times beside it."""
    alone = d.send(a_tokens, 10, "a", d.engine.now)
    d.run(done=lambda: alone in d.engine.finished)
    d.engine.drain()
    b = d.send(40, 100_000, "b", d.engine.now)
    d.run(done=lambda: bool(d.traces[b].tokens))
    worst, a_x = [], []
    for _ in range(runs):
        t = d.engine.now + 1.0
        sent: list[str] = []
        d.at(t, lambda t=t: sent.append(d.send(a_tokens, 10, "a", t)))
        d.run(done=lambda: bool(sent) and sent[0] in d.engine.finished)
        a = d.traces[sent[0]]
        first = a.tokens[0]
        gaps = [y - x for x, y in zip(d.traces[b].tokens, d.traces[b].tokens[1:]) if y > a.sent and x < first]
        worst.append(max(gaps) * 1e3)
        a_x.append(a.ttft / d.traces[alone].ttft)
    d.abort([b])
    return {"b_max_ms": max(worst), "b_max_ms_runs": worst, "a_x": max(a_x), "a_x_runs": a_x}


def run_one(name: str, settings: dict, seed: int, law: StepLaw, model: Path,
            noise: Callable[[bool], float] | None = None, noise_seed: int | None = None) -> dict:
    engine = fresh_engine(settings, law, model, noise)
    d = Driver(engine, random.Random(f"{seed}-tokens"))
    warm_up(d)
    short = short_part(d, seed)
    steady = steady_part(d, seed)
    pair = pair_part(d) if seed == 0 else {}  # the pair has no draws: one seed says it all
    return {"config": name, "settings": settings, "seed": seed, "noise_seed": noise_seed, "steps": len(engine.steps),
            **{f"short_{k}": v for k, v in short.items()}, **steady, **pair}


KEYS = ["short_cost_ms_p50", "short_cost_x_step_p50", "short_cost_x_step_max", "short_ttft_ms_p50",
        "gaps_ms_p99", "gaps_x_alone_p99", "ttft_ms_p99", "long_x_p50", "b_max_ms", "a_x"]
COLUMNS = [("config", "config"), ("short_cost_ms_p50", "short cost p50 ms"), ("short_cost_x_step_p50", "x step p50"),
           ("short_cost_x_step_max", "x step max"), ("short_ttft_ms_p50", "its TTFT p50 ms"),
           ("gaps_ms_p99", "steady gaps p99 ms"), ("gaps_x_alone_p99", "x users alone"),
           ("ttft_ms_p99", "TTFT p99 ms"), ("long_x_p50", "long p50 x alone"), ("b_max_ms", "pair B max ms"),
           ("a_x", "pair A x alone")]


def summarize(runs: list[dict], measured: dict) -> list[dict]:
    """Per configuration, each figure's range over the seeds ("lo-hi"), and the card's where measured."""
    rows = []
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == name]
        row = {"config": name}
        for k in KEYS:
            values = [r[k] for r in mine if k in r]
            lo, hi = min(values), max(values)
            row[k] = f"{lo:.2f}-{hi:.2f}" if hi < 10 else f"{lo:.1f}-{hi:.1f}"
        rows.append(row)
        if name in measured:
            rows.append({"config": "  the card measured", **{k: measured[name].get(k, "") for k in KEYS}})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, every configuration on each (default 3)")
    p.add_argument("--law", type=Path, default=LAW, help="step_sizes.py's JSON of the card's steps")
    p.add_argument("--decode-ms", type=float, default=DECODE_MS,
                   help="a step without prefill on that card (default: %(default)s, the H200's)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated, of: " + "; ".join(CONFIGS) + " (default: the first four)")
    p.add_argument("--noise", type=int, default=0, metavar="N",
                   help="N runs of each seed and configuration with the card's step noise (StepNoise) "
                        "instead of one on medians only (default: 0, medians only)")
    p.add_argument("--trace", type=Path,
                   help="the step trace the noise is drawn from (default: paced-trace.jsonl.gz beside --law)")
    p.add_argument("--json")
    args = p.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    law = StepLaw(args.law, args.decode_ms)
    trace = args.trace or args.law.parent / "paced-trace.jsonl.gz"
    noise = StepNoise(trace) if args.noise else None
    noise_seeds = list(range(args.noise)) or [None]
    measured = MEASURED.get(args.law.resolve().parent.name, {})
    from tests.engine.harness import model_dir

    model = model_dir(Path(tempfile.mkdtemp()))
    runs = []
    for seed in range(args.seeds):
        for name in names:
            for k in noise_seeds:
                # each configuration draws the same noise sequence for a (seed, k)
                draw = None if k is None else noise.drawn_with(random.Random(f"{seed}-{k}-noise"))
                run = run_one(name, CONFIGS[name], seed, law, model, draw, k)
                runs.append(run)
                print(f"[short_step_x] seed {seed}{'' if k is None else f' noise {k}'} {name}: short "
                      f"{run['short_cost_ms_p50']:.1f} ms ({run['short_cost_x_step_p50']:.2f}x), TTFT p99 "
                      f"{run['ttft_ms_p99']:.1f} ms, long {run['long_x_p50']:.2f}x", flush=True)
    rows = summarize(runs, measured)
    print(table(rows, COLUMNS))
    result = {"bench": "short_step_x", "model": "vLLM 0.26 AsyncScheduler + PacedAsyncScheduler on a fake clock",
              "law": str(args.law.resolve().relative_to(Path(__file__).resolve().parents[1])),
              "law_ms": {str(k): round(v * 1e3, 2) for k, v in law.mixed.items()}, "decode_ms": law.decode * 1e3,
              "noise": {"runs": args.noise, "trace": str(trace.resolve().relative_to(Path(__file__).resolve().parents[1]))}
              if args.noise else None,
              "stack_env": STACK_ENV, "measured": measured, "summary": rows, "runs": runs, **environment()}
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
