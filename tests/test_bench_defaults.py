"""`bench defaults`: the checks' arithmetic, and the defaults judged on two simulators.

The H200 run (bench/gpu/defaults_h200.sh) holds the defaults to the bounds in ``CHECKS``. Here
the same command runs CI-sized (fewer users, shorter phases, one pair run) on the simulator:
a stock engine and one that paces like the engine patches' cap mode. Its bounds are looser
than the H200's (a 2-core VM's jitter, the simulator's own step model) but each sits far from
what a worse default gives: holding waits for the wait bound (tens of times a long prompt's
time alone), vLLM's own scheduling stalls streams for whole chunks (~300 ms), and a proxy
that does not see the paced engine holds or slices there.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from prefill_gate.proxy.bench.defaults import CHECKS, HYBRID_CHECKS, Plan, Runner, collect, figures, judge, report
from prefill_gate.proxy.bench.mixed import MixedShape
from prefill_gate.proxy.bench.overlap import Shape
from prefill_gate.proxy.bench.short import ShortShape


def part(**mixed):
    return {"mixed": mixed}


def pair(*runs):
    return {"per_run": [{"overlap_itl_ms_max": b, "a_ttft_s": a, "a_solo_ttft_s": alone} for b, a, alone in runs]}


def test_figures_take_the_worst_pair_run_and_compare_sparse_rows_with_direct():
    results = {
        "direct": {"sparse": part(long_ttft_s_p50=0.7)},
        "proxy": {"pair": pair((30.0, 1.5, 1.0), (55.0, 1.2, 1.0)), "sparse": part(long_ttft_s_p50=1.4),
                  "steady": part(itl_ms_p99=40, itl_ms_p999=49, itl_ms_max=60, ttft_ms_p99=80, long_x_p50=1.9,
                                 long_x_p90=2.5, long_ttft_s_p50=1.3)},
    }
    f = figures("proxy", results["proxy"], results["direct"])
    assert f["b_max_ms"] == 55.0 and f["a_x"] == 1.5 and f["long_vs_direct"] == pytest.approx(2.0)
    verdicts = {(v["row"], v["part"], v["metric"]): v for v in judge(results)}
    assert all(v["ok"] for v in verdicts.values())  # every bound met (2.0 x direct: at the bound)
    assert {k[0] for k in verdicts} == {"proxy"}  # rows and parts not measured are not judged
    assert len(verdicts) == sum(c.row == "proxy" for c in CHECKS)
    results["proxy"]["steady"]["mixed"]["itl_ms_max"] = 75.1
    results["proxy"]["steady"]["mixed"]["long_x_p90"] = math.nan  # not measured is not kept
    failed = {v["metric"] for v in judge(results) if not v["ok"]}
    assert failed == {"itl_ms_max", "long_x_p90"}
    text, _ = report(results)
    assert "MISS proxy  steady stream gaps max within 75 ms: 75.1 (bound 75)" in text


def test_the_stack_row_is_held_to_the_prompt_alone_on_the_stock_engine():
    """The stack row runs another engine: its ``x`` figures divide by the stock engine's time
    alone (what its user gets without the product), its own engine's kept beside. A paced
    engine whose graphs make a prompt alone 20% slower must not look 20% better."""
    results = {
        "direct": {"pair": pair((300.0, 1.1, 1.0), (310.0, 1.0, 1.0), (305.0, 1.2, 1.1)),
                   "steady": {"long_alone_ttft_s_p50": 0.65, "mixed": {"long_ttft_s_p50": 0.7}}},
        "stack": {"pair": pair((18.0, 1.8, 1.2), (19.0, 1.7, 1.2)),
                  "steady": part(long_ttft_s_p50=1.04, long_ttft_s_p90=1.3, long_x_p50=1.3, long_x_p90=1.6)},
        "proxy": {"pair": pair((50.0, 1.8, 1.2)),
                  "steady": part(long_ttft_s_p50=1.04, long_ttft_s_p90=1.3, long_x_p50=1.3, long_x_p90=1.6)},
    }
    f = figures("stack", results["stack"], results["direct"])
    assert f["a_x"] == pytest.approx(1.8) and f["a_x_own"] == pytest.approx(1.5)  # median stock alone: 1.0 s
    assert f["long_x_p50"] == pytest.approx(1.6) and f["long_x_p50_own"] == 1.3
    assert f["long_x_p90"] == pytest.approx(2.0)
    verdicts = {(v["row"], v["metric"]): v["ok"] for v in judge(results)}
    assert verdicts[("stack", "a_x")] is False and verdicts[("stack", "long_x_p50")] is True  # 1.6: at the bound
    # A row on the stock engine keeps its own side-by-side alone (the same engine).
    g = figures("proxy", results["proxy"], results["direct"])
    assert g["a_x"] == pytest.approx(1.5) and "a_x_own" not in g and g["long_x_p50"] == 1.3
    # Without the direct row measured, the stack's own alone is all there is.
    assert figures("stack", results["stack"], None)["a_x"] == pytest.approx(1.5)


def test_the_hybrid_suite_judges_the_stack_by_issue_50s_bounds():
    """``--checks hybrid``: the short-prompt cost against the stream's step, the pair, and steady
    gaps against the users alone (``itl_p99_x_baseline``), on the stack row only."""
    short = {"cost_ms_p50": 28.0, "cost_ms_max": 46.0, "step_ms_p50": 15.0, "cost_x_step_p50": 28 / 15,
             "cost_x_step_max": 46 / 15}
    results = {
        "direct": {"short": {**short, "cost_ms_p50": 115.0, "cost_x_step_p50": 115 / 15},
                   "pair": pair((180.0, 3.0, 3.0))},
        "stack": {"short": short, "pair": pair((45.0, 6.5, 3.1)),
                  "steady": part(itl_ms_p99=30.0, itl_p99_x_baseline=1.9, long_x_p50=1.8, long_ttft_s_p50=1.0)},
    }
    f = figures("stack", results["stack"], results["direct"])
    assert f["short_cost_ms_p50"] == 28.0 and f["short_cost_x_step_max"] == pytest.approx(46 / 15)
    verdicts = {v["metric"]: v["ok"] for v in judge(results, HYBRID_CHECKS)}
    assert set(verdicts) == {c.metric for c in HYBRID_CHECKS} and {v["row"] for v in judge(results, HYBRID_CHECKS)} == {"stack"}
    assert [m for m, ok in verdicts.items() if not ok] == ["short_cost_x_step_max", "a_x"]  # 3.07x; 6.5 / 3.0 s
    text, _ = report(results, "hybrid")
    assert "x users alone" in text and "MISS stack  pair   A within 2x alone: 2.17 (bound 2)" in text
    assert "MISS stack  short  a new short prompt costs streams <= 3x their step (max): 3.07 (bound 3)" in text
    assert not any(v["metric"].startswith("short") for v in judge(results))  # not a promise of the defaults


def test_every_row_runs_a_part_before_any_row_runs_the_next(tmp_path, monkeypatch):
    """Rows meet the engine after the same kind of load: each part for every row, then the next
    part (row by row, the proxy's first pair followed the direct row's steady load). Parts
    already in the work folder are skipped; a pair with fresh proxies goes through its own."""
    import contextlib
    import json
    from types import SimpleNamespace

    ran = []

    def fake_part(self, row, url, part):
        ran.append((row, part, url))
        (self.work / f"{row}-{part}.json").write_text(json.dumps({"row": row, "part": part, "result": {}}))

    def fake_fresh(self, row, engine):
        ran.append((row, "pair", "fresh proxies"))
        (self.work / f"{row}-pair.json").write_text(json.dumps({"row": row, "part": "pair", "result": {}}))

    @contextlib.contextmanager
    def fake_proxy(self, row, engine, name):
        yield SimpleNamespace(url=f"proxy of {row} -> {engine}")

    monkeypatch.setattr(Runner, "_part", fake_part)
    monkeypatch.setattr(Runner, "_fresh_pairs", fake_fresh)
    monkeypatch.setattr(Runner, "_proxy", fake_proxy)
    (tmp_path / "proxy-sparse.json").write_text("{}")  # done by an earlier call
    runner = Runner("http://stock", "http://paced", tmp_path, Plan(pair_fresh_proxy=True), None, [], progress=False)
    runner.run(["direct", "proxy", "stack"], ["pair", "sparse", "steady"])
    assert [(row, part) for row, part, _ in ran] == [
        ("direct", "pair"), ("proxy", "pair"), ("stack", "pair"),
        ("direct", "sparse"), ("stack", "sparse"),
        ("direct", "steady"), ("proxy", "steady"), ("stack", "steady")]
    urls = {(row, part): url for row, part, url in ran}
    assert urls[("direct", "steady")] == "http://stock" and urls[("proxy", "pair")] == "fresh proxies"
    assert urls[("stack", "steady")] == "proxy of stack -> http://paced"
    ran.clear()
    runner.run(["direct", "proxy", "stack"], ["pair", "sparse", "steady"])
    assert ran == []  # everything done: nothing runs again


@pytest.mark.slow
def test_the_short_part_on_the_simulator(tmp_path):
    """``--parts short`` runs ``bench short`` against each row (through the row's proxy where it
    has one) and the hybrid suite's figures come out of it."""
    from prefill_gate.proxy.bench.services import Service

    plan = Plan(short=ShortShape(streams=2, every_s=0.8, duration_s=6.0, warmup_s=1.0))
    with Service("sim", name="stock") as stock, Service("sim", "--pacing-cap", "256", name="paced") as paced:
        Runner(stock.url, paced.url, tmp_path, plan, None, [], progress=False).run(["direct", "stack"], ["short"])
    results = collect(tmp_path)
    assert {row: set(parts) for row, parts in results.items()} == {"direct": {"short"}, "stack": {"short"}}
    for row in ("direct", "stack"):
        f = figures(row, results[row], results["direct"])
        assert results[row]["short"]["answered"] >= 4 and 0 < f["short_step_ms_p50"] < f["short_cost_ms_max"], f
    assert "proxy-stack.log" in {p.name for p in tmp_path.iterdir()}  # the stack row went through its proxy


@pytest.mark.slow
def test_the_defaults_on_the_simulator(tmp_path):
    from prefill_gate.proxy.bench.services import Service

    plan = Plan(steady=MixedShape(users=6, long_every=3.0, duration=15.0, baseline_duration=4.0, long_alone_runs=1),
                # sparse: ~7 long prompts, so that their median is not one prompt's luck (with ~3,
                # the proxy's ratio to direct ran 2.65-3.04 over four runs against the bound's 3.0)
                sparse=MixedShape(users=3, think=2.0, long_every=3.0, duration=24.0, baseline_duration=3.0,
                                  long_alone_runs=1),
                pair=Shape(), pair_runs=2)
    work = Path(tmp_path)
    with Service("sim", name="stock") as stock, Service("sim", "--pacing-cap", "256", name="paced") as paced:
        Runner(stock.url, paced.url, work, plan, None, [], progress=False).run(
            ["direct", "proxy", "stack"], ["pair", "sparse", "steady"])
    results = collect(work)
    assert {row: set(parts) for row, parts in results.items()} == {
        row: {"pair", "sparse", "steady"} for row in ("direct", "proxy", "stack")}
    assert all([r["run"] for r in results[row]["pair"]["raw"]] == [1, 2] for row in results)  # every run's timeline
    logs = {row: (work / f"proxy-{row}.log").read_text() for row in ("proxy", "stack")}
    assert "large prefills are sliced while streams decode there" in logs["proxy"]
    assert "large prefills are paced while streams decode there" in logs["stack"]  # found on its /metrics
    f = {row: figures(row, results[row], results["direct"]) for row in results}
    for row in ("proxy", "stack"):
        for key in ("itl_ms_max", "b_max_ms"):  # vLLM's own scheduling: whole chunks next to the streams
            assert f[row][key] < f["direct"][key] / 2, (row, key, f[row][key], f["direct"][key])
        assert results[row]["steady"]["mixed"]["long_failed"] == 0
        assert f[row]["long_vs_direct"] < 3.0, (row, f[row])  # sparse users: nothing held for long
    assert f["proxy"]["long_x_p50"] < 5.0 and f["proxy"]["a_x"] < 4.0, f["proxy"]  # holding: the wait bound
    assert f["stack"]["long_x_p50"] < 3.0 and f["stack"]["a_x"] < 2.0, f["stack"]  # nothing held at all


def test_a_row_whose_proxy_does_not_find_what_the_row_is_about_is_not_measured(tmp_path):
    """The stack row in front of an engine that publishes no pacing would measure the proxy
    slicing there, not the stack's default: it stops, saying why, and writes nothing."""
    from prefill_gate.proxy.bench.services import Service

    with Service("sim", name="stock") as stock:
        runner = Runner(stock.url, stock.url, tmp_path, Plan(), None, [], progress=False)
        with pytest.raises(SystemExit, match="row stack: the proxy found its upstream .* sliced, not paced"):
            runner.run(["stack"], ["pair"])
    assert not list(tmp_path.glob("stack-*.json"))


@pytest.mark.slow
def test_the_pair_through_a_new_proxy_each_run(tmp_path):
    """``--pair-fresh-proxy``: every pair run is the first long prompt a proxy sees (its slicer
    has learned nothing yet), each through a proxy of its own, its log kept; the part's figures
    are over those runs."""
    from prefill_gate.proxy.bench.services import Service

    with Service("sim", name="stock") as stock:
        Runner(stock.url, None, tmp_path, Plan(pair=Shape(), pair_runs=2, pair_fresh_proxy=True),
               None, [], progress=False).run(["proxy"], ["pair"])
    result = collect(tmp_path)["proxy"]["pair"]
    assert result["fresh_proxy"] is True and result["runs"] == 2 and len(result["per_run"]) == 2
    assert [r["run"] for r in result["raw"]] == [1, 2] and all(r["b"]["tokens"] for r in result["raw"])  # each timeline
    assert result["spread"]["a_ttft_s"] == [min(r["a_ttft_s"] for r in result["per_run"]),
                                            max(r["a_ttft_s"] for r in result["per_run"])]
    logs = sorted(p.name for p in tmp_path.glob("proxy-proxy*.log"))
    assert logs == ["proxy-proxy-pair1.log", "proxy-proxy-pair2.log"]  # one proxy a run, no other
    for log in logs:
        text = (tmp_path / log).read_text()
        assert "large prefills are sliced while streams decode there" in text
        assert text.count("sliced request #") == 1  # the run's A, the first long prompt this proxy sliced


@pytest.mark.slow
def test_a_new_proxy_slices_past_the_engines_graph_step_without_locking_at_the_smallest_slice(tmp_path):
    """The seed pair through a new proxy, on a simulator whose steps past 512 tokens run
    without CUDA graphs and cost 30 ms more (the H200's step, `CostModel.graph_tokens`). Before
    the slicer found such steps, its first cost model put the step on the context term and sent
    the rest of the prompt in 256-token slices: ~98 slices for 28.6k tokens (A 8.0 s against 5.3
    s here; on the H200, 79 slices). Now: the largest slice below the step."""
    import re

    from prefill_gate.proxy.bench.services import Service

    with Service("sim", "--cost-graph-tokens", "512", "--cost-eager", "0.030", name="stock") as stock:
        Runner(stock.url, None, tmp_path, Plan(pair=Shape(), pair_runs=1, pair_fresh_proxy=True), None, [],
               progress=False).run(["proxy"], ["pair"])
    line = next(x for x in (tmp_path / "proxy-proxy-pair1.log").read_text().splitlines() if "sliced request" in x)
    sizes = [int(n) for n in re.search(r"slice tokens \[([^\]]*)\]", line).group(1).split(",")]
    assert sum(sizes) == 28_592 and len(sizes) <= 75, line
    assert sum(n <= 256 for n in sizes[:-1]) <= 5, line  # not locked at the smallest slice
    assert "a step at " in line  # and the log says where it found the step


@pytest.mark.slow
def test_slices_settle_under_the_eager_steps_that_stall_streams():
    """The H100 host's case on the simulator: steps past the 512-token graph cost 20 ms more and
    some of them 80 ms more again (`--cost-eager-tail`). Seed pairs through one proxy that
    slices every time (`--slicing on`): once the streams have seen eager slices stall them past
    1.5x max_gap_ms, the proxy logs a ceiling within the graph, and every later prompt's slices
    stay under it, at the largest size under it, not the floor.

    The tail here is 1 in 4 eager steps, 10% a break. Where the breaks come is chance (which
    slices a stream sees, which eager step stalls): in 8 local tries the ceiling was in the
    graph after the first or second prompt, in one CI run only during the third (its slices
    before it at 656 tokens), and at 1 in 15, as first written, often not after three. So
    the ceiling may take up to four prompts here, and the fifth is the one judged; `--slicing
    on` because under `auto` a prompt after the ceiling may be held instead (slices of 460
    tokens predicted 3.25 s against holding's 3.21 s). The host's own rate, 1 in ~20, is
    `tests/test_slice_cost.py::h100_world`'s, where the ceiling settles over more slices."""
    import asyncio
    import re

    from prefill_gate.proxy.bench.overlap import run_overlap
    from prefill_gate.proxy.bench.services import Service

    with (Service("sim", "--cost-graph-tokens", "512", "--cost-eager", "0.020", "--cost-eager-tail", "0.25",
                  "--cost-eager-tail-s", "0.080", name="stock") as stock,
          Service("serve", "--upstream", stock.url, "--slicing", "on", name="proxy") as gate):
        asyncio.run(run_overlap(gate.url, shape=Shape(), runs=5, progress=False))
        lines = [x for x in gate.output().splitlines() if "sliced request" in x]
    assert len(lines) == 5, lines
    ceilings = [re.search(r"slices of at most (\d+) tokens", x) for x in lines]
    first = next((i for i, c in enumerate(ceilings) if c and int(c.group(1)) <= 512), None)
    assert first is not None and first < 4, lines  # a ceiling within the graph after at most four prompts
    ceiling = int(ceilings[first].group(1))
    for later in lines[first + 1:]:
        sizes = [int(n) for n in re.search(r"slice tokens \[([^\]]*)\]", later).group(1).split(",")]
        assert max(sizes) <= ceiling and sum(sizes) == 28_592, later
        assert sum(n <= 256 for n in sizes[:-1]) <= 5, later  # the largest size under it, not the floor


@pytest.mark.slow
def test_the_hybrid_stack_on_its_simulator(tmp_path):
    """The report's model class, CI-sized: the stock hybrid (align-mode blocks of 1,568 tokens,
    2,048-token chunks, short prompts' steps outside the graphs) against the stack's (graphs to
    512 and the GDN path, paced below the block) as `CLASS=hybrid DRY_RUN=1 defaults_h200.sh`
    serves them. A stack whose pacing stepped in whole blocks, or whose proxy held or sliced in
    front of the paced engine, leaves the stream its ~150-300 ms block steps and fails here."""
    from prefill_gate.proxy.bench.services import Service

    plan = Plan(pair=Shape(), pair_runs=1, short=ShortShape(streams=2, every_s=0.8, duration_s=6.0, warmup_s=1.0))
    stock_args = ("--preset", "h200-27b-hybrid")
    paced_args = ("--preset", "h200-27b-hybrid-stack", "--pacing-cap", "320", "--pacing-sub-block")
    with Service("sim", *stock_args, name="stock") as stock, Service("sim", *paced_args, name="paced") as paced:
        Runner(stock.url, paced.url, tmp_path, plan, None, [], progress=False).run(["direct", "stack"],
                                                                                  ["short", "pair"])
    results = collect(tmp_path)
    assert "large prefills are paced while streams decode there" in (tmp_path / "proxy-stack.log").read_text()
    f = {row: figures(row, results[row], results["direct"]) for row in results}
    assert f["direct"]["b_max_ms"] > 150, f["direct"]  # whole blocks next to the stream
    assert f["stack"]["b_max_ms"] < f["direct"]["b_max_ms"] / 2, f
    assert f["stack"]["a_x"] < 2.0, f["stack"]  # paced, not held
    assert f["stack"]["short_cost_ms_p50"] < f["direct"]["short_cost_ms_p50"] / 1.5, f
