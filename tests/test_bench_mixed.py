"""`bench mixed`: the schedule, desynchronised users, the goodput arithmetic, one real run."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import pytest

from prefill_gate.proxy.bench.mixed import (
    SLO,
    MixedShape,
    Record,
    goodput,
    make_schedule,
    no_stream_share,
    run_mixed,
    stretched,
    summarize,
)
from prefill_gate.proxy.bench.overlap import Trace, stream_chat


def rec(cls="interactive", sent=0.0, tokens=(), end=None, error=None, user=0):
    t = Trace(sent=sent, tokens=list(tokens), end=end if end is not None else (tokens[-1] if tokens else 0.0),
              error=error)
    return Record(cls, user if cls == "interactive" else -1, len(tokens), t)


async def test_a_stream_is_timed_by_its_steps_not_its_text():
    """Every chunk vLLM sends for a step is a token the client stamps, "content": "" too
    (a special token skipped, half a character): a run of them is not a gap."""
    deltas = [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": ""}, {"content": ""},
              {"content": "b"}]
    events = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode(),
                                                                   headers={"content-type": "text/event-stream"}))
    async with httpx.AsyncClient(transport=transport) as client:
        trace = await stream_chat(client, "http://up", "m", "hi", 5, Trace())
    assert trace.error is None and len(trace.tokens) == 5  # not the role header; 5 steps, 2 of them empty


# ------------------------------------------------------------------ the schedule
def test_schedule_depends_on_the_seed_alone():
    shape = MixedShape(duration=60)
    a, b = make_schedule(shape, 7, 60), make_schedule(shape, 7, 60)
    assert a == b
    assert make_schedule(shape, 8, 60) != a
    # More users leave the long prompts' arrivals where they were (their own random stream).
    assert make_schedule(MixedShape(users=30, duration=60), 7, 60).long_arrivals == a.long_arrivals


def test_long_arrivals_are_poisson_at_the_asked_rate():
    shape = MixedShape(long_every=4.0)
    arrivals = make_schedule(shape, 3, 20_000).long_arrivals
    assert all(0 <= t < 20_000 for t in arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.mean(gaps) == pytest.approx(4.0, rel=0.05)
    # Exponential gaps: their standard deviation equals their mean (a fixed period would give 0).
    assert statistics.stdev(gaps) == pytest.approx(4.0, rel=0.1)


def test_requests_draw_lengths_around_the_mean_and_think_exponentially():
    shape = MixedShape(interactive_tokens=200, think=0.5)
    s = make_schedule(shape, 1, 300)
    tokens = [n for u in s.users for n, _ in u.requests]
    thinks = [th for u in s.users for _, th in u.requests]
    assert min(tokens) >= 100 and max(tokens) <= 300
    assert statistics.mean(thinks) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(thinks) == pytest.approx(0.5, rel=0.1)


def _closed_loop(schedule, seconds_per_token: float, horizon: float) -> list[Record]:
    """The users' streams if every token took the same time (a perfectly steady engine)."""
    out = []
    for i, u in enumerate(schedule.users):
        t = u.start
        for n, think in u.requests:
            if t >= horizon:
                break
            tokens = [t + 0.02 + k * seconds_per_token for k in range(n)]
            out.append(rec(sent=t, tokens=tokens, user=i))
            t = tokens[-1] + think
    return out


def test_users_are_desynchronised():
    """With synchronised users all pausing together, a proxy that holds long prompts until
    no stream is live gets a free moment every round; users of this bench almost never
    leave one. The same arithmetic for users in lockstep shows what the bench avoids."""
    shape = MixedShape(users=12, think=0.5, interactive_tokens=200)
    s = make_schedule(shape, 0, 120)
    starts = [u.start for u in s.users]
    assert len(set(starts)) == len(starts) and max(starts) - min(starts) > 1.0
    free = no_stream_share(_closed_loop(s, 0.005, 120), 2.0, 120)
    assert free < 0.01
    lockstep = make_schedule(shape, 0, 120)
    same = lockstep.users[0]
    lockstep = type(lockstep)(tuple(same for _ in lockstep.users), lockstep.long_arrivals)
    assert no_stream_share(_closed_loop(lockstep, 0.005, 120), 2.0, 120) > 0.2


def test_stretched_schedule_scales_every_time():
    s = make_schedule(MixedShape(), 2, 30)
    x = stretched(s, 3.0)
    assert x.long_arrivals == tuple(3 * t for t in s.long_arrivals)
    assert [u.start for u in x.users] == [3 * u.start for u in s.users]
    assert [n for n, _ in x.users[0].requests] == [n for n, _ in s.users[0].requests]


# ----------------------------------------------------------------- the arithmetic
def test_goodput_counts_requests_meeting_every_slo():
    slo = SLO(ttft_ms=100, tpot_ms=10, max_gap_ms=50)
    records = [
        rec(sent=0, tokens=[0.05, 0.055, 0.06]),  # ttft 50, tpot 5, max gap 5: good, strict
        rec(sent=0, tokens=[0.2, 0.205]),  # ttft 200: neither
        rec(sent=0, tokens=[0.05, 0.06, 0.12]),  # tpot 35: not good; gap 60: not strict
        rec(sent=0, tokens=[0.05, 0.058, 0.062, 0.07]),  # tpot 6.7, max gap 8: good, strict
        rec(sent=0, tokens=[0.05, 0.107]),  # tpot 57: not good; gap 57: not strict
        rec(sent=0, tokens=[], error="HTTP 503"),  # failed: counted as sent, never good
        rec(cls="long", sent=0, tokens=[5.0]),  # not interactive: not in goodput
    ]
    g = goodput(records, slo, seconds=10.0)
    assert g["goodput_rps"] == pytest.approx(2 / 10)
    assert g["goodput_share"] == pytest.approx(2 / 6)
    assert g["strict_share"] == pytest.approx(2 / 6)


def test_goodput_without_a_bound_ignores_it_and_scales_time():
    records = [rec(sent=0, tokens=[0.4, 0.42]), rec(sent=0, tokens=[0.1, 0.3])]
    assert goodput(records, SLO(ttft_ms=None, tpot_ms=None, max_gap_ms=1000), 4.0)["goodput_share"] == 1.0
    # Twice as slow: 0.4 s of a time-scale-2 run is 200 ms of engine time, within 250.
    assert goodput(records, SLO(ttft_ms=250, tpot_ms=None), 4.0, scale=2.0)["goodput_share"] == 1.0
    assert goodput(records, SLO(ttft_ms=250, tpot_ms=None), 4.0, scale=2.0)["goodput_rps"] == pytest.approx(1.0)


def test_tpot_is_vllms():
    r = rec(sent=1.0, tokens=[1.1, 1.2, 1.4], end=1.45)
    assert r.tpot == pytest.approx((0.45 - 0.1) / 2)
    assert rec(sent=0, tokens=[0.1]).tpot == 0.0


def test_summarize_per_class_and_against_alone():
    records = [rec(sent=0, tokens=[0.02 + 0.005 * k for k in range(100)]),
               rec(sent=0, tokens=[0.03, 0.035, 0.3, 0.305]),
               rec(cls="long", sent=1.0, tokens=[2.0, 2.1], end=2.1),
               rec(cls="long", sent=2.0, tokens=[5.0], end=5.0),
               rec(cls="long", sent=3.0, tokens=[], error="HTTP 503")]
    s = summarize(records, 10.0, SLO(long_x=2.0), long_alone_s=1.0)
    assert s["interactive_completed"] == 2 and s["long_completed"] == 2 and s["long_failed"] == 1
    assert s["itl_ms_max"] == pytest.approx(265)
    assert s["gaps_over_50ms_share"] == pytest.approx(1 / 102)
    assert s["long_ttft_s_max"] == pytest.approx(3.0)
    assert s["long_x_max"] == pytest.approx(3.0)
    assert s["long_within_slo_share"] == pytest.approx(1 / 3)  # one of three within 2x alone
    assert sum(s["gap_hist"]) == 102
    assert s["worst_gaps"][0] == [0.3, pytest.approx(265), 0] and len(s["worst_gaps"]) == 12
    assert [g for _, g, _ in s["worst_gaps"]] == sorted((g for _, g, _ in s["worst_gaps"]), reverse=True)
    assert s["errors"] == ["HTTP 503"]


def test_no_stream_share_merges_overlapping_streams():
    records = [rec(sent=0, tokens=[1.0, 3.0]), rec(sent=0, tokens=[2.0, 4.0]), rec(sent=0, tokens=[6.0, 7.0])]
    assert no_stream_share(records, 0.0, 10.0) == pytest.approx(1 - 4 / 10)


# ------------------------------------------------------------------ one real run
@pytest.mark.slow
def test_a_short_run_on_the_simulator_measures_both_phases(tmp_path):
    from prefill_gate.proxy.bench.services import Service

    shape = MixedShape(users=3, think=0.2, interactive_prompt=60, interactive_tokens=20, long_prompt=3000,
                       long_tokens=4, long_every=1.0, duration=3.0, baseline_duration=1.5, long_alone_runs=1)
    import time

    with Service("sim", name="sim") as sim:
        began = time.time()
        result = asyncio.run(run_mixed([sim.url + "/v1"], ["sim"], shape, SLO(), seeds=[5], progress=False))
        ended = time.time()
    run = result["endpoints"][0]["runs"][0]
    # Each phase's zero on the wall clock, to set its times beside a server's log lines.
    assert began < run["baseline"]["t0_unix"] < run["mixed"]["t0_unix"] - 1.5 < ended
    for phase in ("baseline", "mixed"):  # the client's own collections, beside its gaps
        assert set(run[phase]["client_gc"]) == {"collections", "seconds", "max_ms", "long"}
    assert run["target"] == sim.url  # the /v1 an OpenAI client is configured with is accepted
    assert run["long_arrivals_s"] == list(make_schedule(shape, 5 + 1_000_003, 3.0).long_arrivals)
    m, b = run["mixed"], run["baseline"]
    assert m["interactive_failed"] == 0 and m["long_failed"] == 0 and m["long_sent"] == len(run["long_arrivals_s"])
    assert m["interactive_completed"] >= 3 and b["interactive_completed"] >= 3 and "long_sent" not in b
    # One character is one token on the simulator: the sized prompts hit their counts.
    assert run["prompt_sizing"]["3000"]["counted"] == pytest.approx(3000, abs=3)
    assert 0 < run["long_alone_ttft_s_p50"] < 2.0
