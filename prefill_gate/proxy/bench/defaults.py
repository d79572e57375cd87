"""``prefill-gate bench defaults``: what a user gets with no flags, judged side by side.

Given a stock vLLM (``--stock``) and one running the engine patches' step pacing (``--paced``),
it serves every row the same schedules and checks each against what the defaults promise:

    direct  the stock engine, no proxy
    hold    prefill-gate --slicing off in front of it (the proxy's default before slicing auto)
    proxy   prefill-gate with no flags in front of it (slicing auto: what ``prefill-gate serve`` does)
    stack   prefill-gate with no flags in front of the paced engine (what ``docker compose up`` runs)

Each row runs three parts: ``pair`` (the seed pair: a stream B, a long prompt A arriving
when B has 64 tokens; ``--pair-runs`` runs), ``sparse`` (a few users who pause often, so long
prompts often arrive with nothing live) and ``steady`` (``bench mixed``: many users who never
pause together, a long prompt at Poisson times); on request a fourth, ``short`` (``bench
short``: what one new short prompt costs the streams live, the hybrid's hard case). A part runs
for every row before the next part starts, so each row meets the engine after the same kind of
load. The proxies are started here, one a part, with the flags above and nothing else.
``--checks hybrid`` judges the stack by what it must do on a Gated DeltaNet hybrid
(``HYBRID_CHECKS``) instead of the defaults' promises. Every part is written to ``--work`` as it ends and skipped when
it is already there: a run split over several calls (servers that outlive them) resumes.
The merged JSON holds every part, the checks (``CHECKS`` or ``HYBRID_CHECKS``) and the machine, versions, command
and commit; the table and the plot say the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .mixed import SLO, MixedShape, measure_endpoint
from .overlap import KEYS, Shape, over_runs, run_overlap
from .report import environment, table, write_json
from .services import Service
from .short import ShortShape, run_short

ROWS = ("direct", "hold", "proxy", "stack")
PARTS = ("pair", "sparse", "steady", "short")
DEFAULT_PARTS = ("pair", "sparse", "steady")
# The proxy each row runs (None: the engine itself) and the engine it is in front of.
PROXY_FLAGS = {"direct": None, "hold": ["--slicing", "off"], "proxy": [], "stack": []}
ENGINE = {"direct": "stock", "hold": "stock", "proxy": "stock", "stack": "paced"}
# What each row's proxy must have found its upstream to be (its /health's mode) before the
# row is measured: a stack row whose proxy did not see the pacing measures something else.
MODE = {"hold": "held", "proxy": "sliced", "stack": "paced"}
MODE_WAIT_S = 20.0


@dataclass(frozen=True)
class Check:
    """One promise: ``row``'s ``part`` figure ``metric`` at most ``bound`` (ms bounds in
    engine time; ``x`` bounds as a multiple of the same prompt alone on the stock engine)."""

    row: str
    part: str
    metric: str
    bound: float
    what: str


# What the defaults promise (the issue that made them the defaults, measured on the H200).
CHECKS = (
    Check("proxy", "steady", "long_x_p50", 2.0, "long prompts p50 within 2x alone"),
    Check("proxy", "steady", "long_x_p90", 3.0, "long prompts p90 within 3x alone"),
    Check("proxy", "steady", "ttft_ms_p99", 100.0, "new requests' TTFT p99 within 100 ms"),
    Check("proxy", "steady", "itl_ms_p999", 50.0, "stream gaps p99.9 within max_gap_ms (50)"),
    Check("proxy", "steady", "itl_ms_max", 75.0, "stream gaps max within 75 ms"),
    Check("proxy", "pair", "b_max_ms", 60.0, "B's worst gap within 60 ms"),
    Check("proxy", "pair", "a_x", 2.2, "A within 2.2x alone"),
    Check("stack", "steady", "itl_ms_max", 25.0, "stream gaps max within 25 ms"),
    Check("stack", "steady", "ttft_ms_p99", 100.0, "new requests' TTFT p99 within 100 ms"),
    Check("stack", "steady", "long_x_p50", 1.6, "long prompts p50 within 1.6x alone"),
    Check("stack", "pair", "b_max_ms", 20.0, "B's worst gap within 20 ms"),
    Check("stack", "pair", "a_x", 1.6, "A within 1.6x alone"),
) + tuple(Check(row, "sparse", "long_vs_direct", 2.0, "sparse users: long prompts within 2x direct's")
          for row in ("hold", "proxy", "stack"))

# What the stack must do on the report's model class, a Gated DeltaNet hybrid in align mode
# (issue 50: the 27B hybrid on the H200, against stock vLLM in the same run; decode step ~15 ms).
HYBRID_CHECKS = (
    Check("stack", "short", "short_cost_x_step_p50", 2.0, "a new short prompt costs streams <= 2x their step (p50)"),
    Check("stack", "short", "short_cost_x_step_max", 3.0, "a new short prompt costs streams <= 3x their step (max)"),
    Check("stack", "pair", "b_max_ms", 50.0, "B's worst gap within 50 ms"),
    Check("stack", "pair", "a_x", 2.0, "A within 2x alone"),
    Check("stack", "steady", "itl_p99_x_baseline", 2.0, "stream gaps p99 within 2x the users alone"),
    Check("stack", "steady", "long_x_p50", 2.0, "long prompts p50 within 2x alone"),
)
SUITES = {"defaults": CHECKS, "hybrid": HYBRID_CHECKS}


@dataclass(frozen=True)
class Plan:
    steady: MixedShape = MixedShape()
    sparse: MixedShape = MixedShape(users=3, think=2.0, duration=60.0, baseline_duration=15.0)
    pair: Shape = Shape()
    short: ShortShape = ShortShape(duration_s=45.0)
    pair_runs: int = 3
    pair_fresh_proxy: bool = False  # each pair run through a proxy of its own (every run a new proxy's first)
    seed: int = 0
    time_scale: float = 1.0


def figures(row: str, parts: dict[str, dict], direct: dict[str, dict] | None) -> dict[str, float]:
    """The figures the checks read, from one row's parts (``direct``: the direct row's).

    ``x`` figures divide by the same prompt alone on the stock engine: a row on another engine
    (stack: the paced one) is held to what its user would get alone without the product, not to
    its own engine's time alone (graphs or pacing that slow a prompt alone would flatter it).
    That row's ratio to its own engine's alone is kept beside, as ``*_own``."""
    out: dict[str, float] = {}
    foreign = ENGINE.get(row) != ENGINE["direct"] and direct is not None
    steady = parts.get("steady")
    if steady is not None:
        m = steady["mixed"]
        out.update({k: m.get(k, math.nan) for k in ("itl_ms_p99", "itl_ms_p999", "itl_ms_max", "ttft_ms_p99",
                                                    "long_x_p50", "long_x_p90", "long_ttft_s_p50",
                                                    "itl_p99_x_baseline")})
        stock = direct.get("steady", {}).get("long_alone_ttft_s_p50") if foreign else None
        if stock:
            out["long_x_p50_own"], out["long_x_p90_own"] = out["long_x_p50"], out["long_x_p90"]
            out["long_x_p50"] = m.get("long_ttft_s_p50", math.nan) / stock
            out["long_x_p90"] = m.get("long_ttft_s_p90", math.nan) / stock
    pair = parts.get("pair")
    if pair is not None:  # the worst of the runs
        runs = pair["per_run"]
        out["b_max_ms"] = max(r["overlap_itl_ms_max"] for r in runs)
        out["a_x"] = max(r["a_ttft_s"] / r["a_solo_ttft_s"] for r in runs)
        stock_runs = direct.get("pair", {}).get("per_run") if foreign else None
        if stock_runs:
            alone = statistics.median(r["a_solo_ttft_s"] for r in stock_runs)
            out["a_x_own"], out["a_x"] = out["a_x"], max(r["a_ttft_s"] for r in runs) / alone
    short = parts.get("short")
    if short is not None:
        out.update({f"short_{k}": short.get(k, math.nan)
                    for k in ("cost_ms_p50", "cost_ms_max", "step_ms_p50", "cost_x_step_p50", "cost_x_step_max")})
    sparse = parts.get("sparse")
    if sparse is not None:
        out["sparse_long_ttft_s_p50"] = sparse["mixed"].get("long_ttft_s_p50", math.nan)
        out["sparse_ttft_ms_p99"] = sparse["mixed"].get("ttft_ms_p99", math.nan)  # new requests'
        base = (direct or {}).get("sparse")
        if base is not None:
            out["long_vs_direct"] = out["sparse_long_ttft_s_p50"] / base["mixed"]["long_ttft_s_p50"]
    return out


def judge(results: dict[str, dict[str, dict]], checks: tuple[Check, ...] = CHECKS) -> list[dict]:
    """Every check whose row and part were measured: its value and whether it held."""
    direct = results.get("direct")
    verdicts = []
    for c in checks:
        if c.part not in results.get(c.row, {}):
            continue
        value = figures(c.row, results[c.row], direct).get(c.metric, math.nan)
        verdicts.append({**asdict(c), "value": value, "ok": bool(value <= c.bound)})  # NaN: not kept
    return verdicts


# ------------------------------------------------------------------ the run
class Runner:
    def __init__(self, stock: str, paced: str | None, work: Path, plan: Plan, model: str | None,
                 proxy_args: list[str], budget_s: float = 0.0, progress: bool = True):
        self.urls = {"stock": stock, "paced": paced}
        self.work, self.plan, self.model = work, plan, model
        self.proxy_args, self.progress = proxy_args, progress
        self.stop_at = time.monotonic() + budget_s if budget_s > 0 else math.inf

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.stop_at

    def path(self, row: str, part: str) -> Path:
        return self.work / f"{row}-{part}.json"

    def say(self, what: str) -> None:
        if self.progress:
            print(f"[defaults] {what}", file=sys.stderr, flush=True)

    def run(self, rows: list[str], parts: list[str]) -> None:
        """Each part for every row before the next part: every row's pair starts after another
        row's pair, every steady part after another steady part, so rows meet the engine (and
        the card) after the same kind of load. (Row by row, the proxy's first seed pair ran ~30 s
        after the direct row's steady load, the card's heaviest, and its first slices met engine
        steps ~12 ms dearer than 10-20 s later: bench/results/defaults/h100/run-9f76ea6/.)"""
        self.work.mkdir(parents=True, exist_ok=True)
        for row in rows:
            if self.urls[ENGINE[row]] is None and any(not self.path(row, p).exists() for p in parts):
                raise SystemExit(f"row {row} needs --{ENGINE[row]}")
        if all(self.path(row, p).exists() for row in rows for p in parts):
            self.say("every part done already")
            return
        for part in parts:
            for row in rows:
                if self.path(row, part).exists():
                    continue
                if self.out_of_time():
                    self.say(f"{row}: {part} left for the next call (--budget)")
                    continue
                engine = self.urls[ENGINE[row]]
                if PROXY_FLAGS[row] is None:
                    self._part(row, engine, part)
                elif part == "pair" and self.plan.pair_fresh_proxy:
                    self._fresh_pairs(row, engine)
                else:
                    with self._proxy(row, engine, f"proxy-{row}") as proxy:
                        self._part(row, proxy.url, part)

    @contextlib.contextmanager
    def _proxy(self, row: str, engine: str, name: str):
        """The row's proxy, in front of ``engine``, once it found it in the row's mode; its log
        lands in the work folder as ``name``.log."""
        wait = f"{30 * self.plan.time_scale:g}"  # the default wait bound, in the engine's time
        args = ["serve", "--upstream", engine, "--max-queue-wait", wait, "--log-level", "info", *self.proxy_args,
                *PROXY_FLAGS[row]]
        with Service(*args, name=name, timeout=60) as proxy:
            try:
                self._expect_mode(row, proxy.url, engine)
                yield proxy
            finally:
                with (self.work / f"{name}.log").open("a") as log:  # a row's proxies, one a part, in order
                    log.write(proxy.output()[-2_000_000:])

    def _fresh_pairs(self, row: str, engine: str) -> None:
        """The seed pair, each run through a new proxy: what the first long prompt after a
        proxy starts gets (its slicer has learned nothing of the engine yet)."""
        p, runs = self.plan, []
        for k in range(p.pair_runs):
            if self.out_of_time():
                self.say(f"{row}: pair left for the next call (--budget)")
                return
            with self._proxy(row, engine, f"proxy-{row}-pair{k + 1}") as proxy:
                self.say(f"{row}: pair run {k + 1} of {p.pair_runs} -> a new proxy, {proxy.url}")
                runs.append(asyncio.run(run_overlap(proxy.url, self.model, p.pair, runs=1, progress=self.progress)))
        first = {k: v for k, v in runs[0].items() if k not in (*KEYS, "spread", "per_run")}
        raw = [{**r["raw"][0], "run": k + 1} for k, r in enumerate(runs)]  # every run's timeline
        result = over_runs([r["per_run"][0] for r in runs], **{**first, "runs": len(runs), "fresh_proxy": True,
                                                              "seeds": [r["seed"] for r in runs], "raw": raw})
        write_json(self.path(row, "pair"), {"row": row, "part": "pair", "result": result, **environment()})

    def _expect_mode(self, row: str, url: str, engine: str) -> None:
        """Wait until the row's proxy has probed its upstream; fail the row unless it found
        what the row is about (``MODE``)."""
        import httpx

        deadline, mode = time.monotonic() + MODE_WAIT_S, None
        while time.monotonic() < deadline:
            up = httpx.get(url + "/health", timeout=5.0).json()["upstreams"].get(engine.rstrip("/"), {})
            mode = up.get("mode")
            if mode is not None:
                break
            time.sleep(0.2)
        if mode != MODE[row]:
            raise SystemExit(f"row {row}: the proxy found its upstream {engine} {mode or 'unprobed'}, not "
                             f"{MODE[row]} (for paced: does the engine publish prefill_gate_engine_info? the "
                             "engine patches' stat-logger plugin must be installed in its environment)")

    def _part(self, row: str, url: str, part: str) -> None:
        p = self.plan
        self.say(f"{row}: {part} -> {url}")
        if part == "pair":
            # every run's timeline stays (the plot draws the first): a bound a run misses is
            # diagnosed from its own tokens
            result = asyncio.run(run_overlap(url, self.model, p.pair, runs=p.pair_runs, progress=self.progress))
        elif part == "short":
            result = asyncio.run(run_short(url, self.model, p.short, p.seed, progress=self.progress))
        else:
            shape = p.steady if part == "steady" else p.sparse
            result = asyncio.run(measure_endpoint(url, row, shape, SLO(), p.seed, self.model, p.time_scale,
                                                  progress=self.progress))
            result["shape"] = asdict(shape)
        write_json(self.path(row, part), {"row": row, "part": part, "result": result, **environment()})


def collect(work: Path) -> dict[str, dict[str, dict]]:
    """Every part in ``work``: {row: {part: result}}."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(work.glob("*-*.json")):
        rec = json.loads(f.read_text())
        if rec.get("row") in ROWS and rec.get("part") in PARTS:
            out.setdefault(rec["row"], {})[rec["part"]] = {**rec["result"], "git_commit": rec.get("git_commit"),
                                                           "git_dirty": rec.get("git_dirty")}
    return out


COLUMNS = [("row", "row"), ("itl_ms_p99", "gaps p99 ms"), ("itl_ms_p999", "p99.9"), ("itl_ms_max", "max"),
           ("ttft_ms_p99", "TTFT p99 ms"), ("long_x_p50", "long p50 x"), ("long_x_p50_own", "own engine"),
           ("long_x_p90", "long p90 x"),
           ("b_max_ms", "pair B max ms"), ("a_x", "pair A x"), ("a_x_own", "own engine"),
           ("sparse_long_ttft_s_p50", "sparse long p50 s"),
           ("long_vs_direct", "x direct"), ("sparse_ttft_ms_p99", "sparse TTFT p99 ms")]
HYBRID_COLUMNS = [("row", "row"), ("short_step_ms_p50", "step ms"), ("short_cost_ms_p50", "short cost p50 ms"),
                  ("short_cost_ms_max", "max"), ("short_cost_x_step_p50", "x step p50"),
                  ("short_cost_x_step_max", "x step max"), ("b_max_ms", "pair B max ms"), ("a_x", "pair A x"),
                  ("itl_ms_p99", "gaps p99 ms"), ("itl_p99_x_baseline", "x users alone"), ("itl_ms_max", "max"),
                  ("ttft_ms_p99", "TTFT p99 ms"), ("long_x_p50", "long p50 x")]


def report(results: dict[str, dict[str, dict]], suite: str = "defaults") -> tuple[str, list[dict]]:
    direct = results.get("direct")
    rows = [{"row": row, **figures(row, results[row], direct)} for row in ROWS if row in results]
    verdicts = judge(results, SUITES[suite])
    lines = [table(rows, HYBRID_COLUMNS if suite == "hybrid" else COLUMNS), ""]
    for v in verdicts:
        lines.append(f"{'ok  ' if v['ok'] else 'MISS'} {v['row']:<6} {v['part']:<6} {v['what']}: "
                     f"{v['value']:.3g} (bound {v['bound']:g})")
    return "\n".join(lines), verdicts


def add_arguments(p) -> None:
    p.add_argument("--stock", required=True, help="a vLLM (or simulator) with its own scheduling")
    p.add_argument("--paced", help="the same engine with the engine patches' step pacing (the stack row)")
    p.add_argument("--work", required=True, help="folder for each part's JSON (a rerun skips what is there)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, of {', '.join(PARTS)} "
                   "(short: `bench short`, what one new short prompt costs live streams)")
    p.add_argument("--checks", choices=sorted(SUITES), default="defaults",
                   help="the promises judged: the defaults' (issue 49), or the stack's on a Gated DeltaNet "
                        "hybrid (issue 50)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--duration", type=float, default=120.0, help="steady: seconds of steady load")
    p.add_argument("--baseline-duration", type=float, default=30.0, help="steady: seconds of the users alone")
    p.add_argument("--users", type=int, default=12, help="steady: interactive users")
    p.add_argument("--long-every", type=float, default=4.0, help="steady: mean seconds between long prompts")
    p.add_argument("--long-prompt", type=int, default=20_000, help="steady and sparse: a long prompt's tokens")
    p.add_argument("--sparse-users", type=int, default=3)
    p.add_argument("--sparse-think", type=float, default=2.0, help="sparse: mean think time, seconds")
    p.add_argument("--sparse-duration", type=float, default=60.0)
    p.add_argument("--short-duration", type=float, default=45.0, help="short: seconds of short prompts")
    p.add_argument("--pair-runs", type=int, default=3)
    p.add_argument("--pair-long", type=int, default=28_600, help="the seed pair's A: prompt tokens")
    p.add_argument("--pair-fresh-proxy", action="store_true",
                   help="each pair run through a new proxy (rows with a proxy): every run is the first long "
                        "prompt a proxy sees")
    p.add_argument("--seed", type=int, default=0, help="the schedules' seed (every row gets the same)")
    p.add_argument("--time-scale", type=float, default=1.0, help="a simulator slowed this many times")
    p.add_argument("--proxy-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every proxy started (e.g. --proxy-arg=--relay-core=python)")
    p.add_argument("--json", help="write the merged result and the checks here")
    p.add_argument("--plot", help="steady load's CDFs per row (PNG); beside it, -pair.png: the seed pair's "
                                  "timeline per row")
    p.add_argument("--budget", type=float, default=0.0, metavar="S",
                   help="start no part after S seconds (a part runs to its end; 0: no limit); what is left "
                        "runs on the next call")
    p.add_argument("--report-only", action="store_true", help="run nothing: merge what --work holds")


def plan_from(args) -> Plan:
    steady = MixedShape(users=args.users, long_every=args.long_every, long_prompt=args.long_prompt,
                        duration=args.duration, baseline_duration=args.baseline_duration)
    sparse = replace(steady, users=args.sparse_users, think=args.sparse_think, duration=args.sparse_duration,
                     baseline_duration=min(args.baseline_duration, args.sparse_duration / 4))
    return Plan(steady=steady, sparse=sparse, pair=Shape(long_tokens=args.pair_long),
                short=ShortShape(duration_s=args.short_duration), pair_runs=args.pair_runs,
                pair_fresh_proxy=args.pair_fresh_proxy, seed=args.seed, time_scale=args.time_scale)


def main(args) -> int:
    work = Path(args.work)
    rows = [r for r in args.rows.split(",") if r]
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(rows) - set(ROWS)) + sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"prefill-gate bench defaults: unknown row or part: {', '.join(unknown)}", file=sys.stderr)
        return 2
    if not args.report_only:
        plan = plan_from(args)
        plan.steady.validate()
        plan.sparse.validate()
        plan.short.validate()
        Runner(args.stock, args.paced, work, plan, args.model, args.proxy_arg, args.budget).run(rows, parts)
    results = collect(work)
    text, verdicts = report(results, args.checks)
    print(text)
    if args.json:
        write_json(args.json, {"bench": "defaults", "suite": args.checks, "checks": verdicts, "rows": results,
                               **environment()})
    if args.plot and any("steady" in r for r in results.values()):
        from .mixed_report import plot_mixed

        steady = [row for row in ROWS if "steady" in results.get(row, {})]
        plot_mixed({"endpoints": [{"label": row, "runs": [results[row]["steady"]]} for row in steady],
                    "shape": results[steady[0]]["steady"]["shape"]}, args.plot)
    pairs = [row for row in ROWS if results.get(row, {}).get("pair", {}).get("raw")]
    if args.plot and pairs:  # the seed pair's first run per row: B's gaps over time, A's life shaded
        from .report import plot_overlap

        plot_overlap([{**results[row]["pair"], "config": row} for row in pairs],
                     str(Path(args.plot).with_name(Path(args.plot).stem + "-pair.png")),
                     title="one stream (B) and a long prompt (A), per row")
    return 0
