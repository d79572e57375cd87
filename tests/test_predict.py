"""Slicing auto's rule on a fake clock: hold when the live streams end first, slice otherwise."""

import pytest

from prefill_gate.proxy.predict import PRIOR_GAP_S, PROMISE_COOLDOWN_S, Predictor


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def predictor(clock=None, **kw):
    return Predictor(["u"], slice_gap_s=0.03, max_gap_s=0.05, min_slice_tokens=256, max_slice_tokens=4096,
                     clock=clock or Clock(), **kw)


def stream(p, key, max_tokens, done, model="m"):
    state = {"n": done}
    p.stream_started("u", key, max_tokens, model, lambda: state["n"])
    return state


def test_nothing_live_means_admit_whole_not_slice():
    c = predictor().choose("u", 20_000)
    assert not c.slice and c.hold_s == 0


def test_slice_when_idle_slices_with_nothing_live_too():
    p = predictor(slice_idle=True)
    c = p.choose("u", 20_000)
    assert c.slice and "arrivals" in c.reason


def test_streams_about_to_end_are_waited_for():
    p = predictor()
    stream(p, 1, max_tokens=100, done=90)
    c = p.choose("u", 20_000)
    assert c.hold_s == pytest.approx(10 * PRIOR_GAP_S)
    assert not c.slice and c.reason == "the live streams end first"


def test_a_long_answer_still_streaming_is_not_waited_for():
    p = predictor()
    stream(p, 1, max_tokens=2000, done=10)
    c = p.choose("u", 20_000)
    assert c.slice and c.finish_slice_s < c.finish_hold_s


@pytest.mark.parametrize("every,slices", [(0.1, True), (2.0, False)])
def test_steady_new_streams_mean_no_quiet_moment(every, slices):
    """Streams lasting 0.5 s: one every 0.1 s keeps ~5 live (busy for (e^5 - 1) x 0.1 s at
    a stretch, ~15 s: slice); one every 2 s leaves the upstream quiet most of the time
    (busy ~0.6 s at a stretch: hold)."""
    clock = Clock()
    p = predictor(clock)
    steady_streams(p, clock, every)
    c = p.choose("u", 20_000)
    assert c.slice is slices
    assert (c.hold_s > 10) is slices


def test_a_busy_period_past_the_wait_bound_is_logged_as_such():
    """Under steady load the busy period is astronomical (e^L x ...): the reason says what
    matters, not a number of days."""
    clock = Clock()
    p = predictor(clock, wait_bound_s=10.0)
    steady_streams(p, clock, 0.1)
    c = p.choose("u", 20_000)
    assert c.slice and c.hold_s > 10
    assert "busy past the wait bound" in c.reason and "busy ~" not in c.reason


def steady_streams(p, clock, every):
    """Streams of 0.5 s, one every ``every`` s, for 8 s; one live at the end."""
    live, key = [], 0
    for tick in range(int(8 / 0.05)):  # 8 s in 50 ms ticks
        for t, k in list(live):
            if clock.t - t >= 0.5 - 1e-9:
                p.stream_ended("u", k, 50, finished=True)
                live.remove((t, k))
        if tick % round(every / 0.05) == 0:
            stream(p, key, max_tokens=50, done=45)
            live.append((clock.t, key))
            key += 1
        clock.t += 0.05
    stream(p, key, max_tokens=50, done=45)  # a stream is live when the long prompt arrives


def test_remaining_length_comes_from_finished_answers_when_there_is_no_max_tokens():
    p = predictor()
    for key in range(30):  # this model's answers end near 100 tokens
        stream(p, 100 + key, None, 0)
        p.stream_ended("u", 100 + key, 95 + key % 10, finished=True)
    s = stream(p, 1, max_tokens=None, done=90)
    c = p.choose("u", 20_000)
    assert c.hold_s < 0.15 and not c.slice
    s["n"] = 10  # early in its answer: ~90 to go
    assert p.choose("u", 20_000).hold_s == pytest.approx(90 * PRIOR_GAP_S, rel=0.1)
    p.stream_ended("u", 1, 3, finished=False)  # an aborted stream says nothing about lengths
    assert len(p._lengths["m"]) == 30


def test_an_upstream_where_even_the_smallest_slice_stalls_is_held_for_a_while():
    clock = Clock()
    p = predictor(clock)
    stream(p, 1, max_tokens=5000, done=10)
    assert p.choose("u", 20_000).slice
    p.sizer("u").tokens = 256  # at its smallest
    for gap in [0.080, 0.030, 0.030, 0.090]:  # two of the smallest slices over the 50 ms promise
        w = p.window_start("u")
        p.gap("u", gap)
        assert p.window_max("u", w) == pytest.approx(gap)
    assert p.choose("u", 20_000).slice  # an outlier or two may be an interactive prompt in the step
    w = p.window_start("u")
    p.gap("u", 0.070)  # a third: even the smallest slices stall here
    p.window_max("u", w)
    c = p.choose("u", 20_000)
    assert not c.slice and "promise" in c.reason
    clock.t += PROMISE_COOLDOWN_S + 1
    assert p.choose("u", 20_000).slice
    p.sizer("u").tokens = 1024  # larger slices over the promise say nothing about the smallest
    for _ in range(5):
        w = p.window_start("u")
        p.gap("u", 0.080)
        p.window_max("u", w)
    assert p.choose("u", 20_000).slice


def break_promise(p):
    p.sizer("u").tokens = 256  # at its smallest, three slices over the 50 ms promise
    for _ in range(3):
        w = p.window_start("u")
        p.gap("u", 0.150)
        p.window_max("u", w)


@pytest.mark.parametrize("remaining,slices", [(500, False), (4990, True)])
def test_a_broken_promise_still_slices_when_holding_would_end_at_the_wait_bound(remaining, slices):
    """Holding keeps the promise only if the streams end before the bound; past it the
    prompt goes whole beside them, which stalls them more than the smallest slices do."""
    p = predictor(wait_bound_s=30.0)
    stream(p, 1, max_tokens=10 + remaining, done=10)  # ends in remaining x the decode gap
    break_promise(p)
    c = p.choose("u", 20_000)
    assert "promise" in c.reason
    assert (c.hold_s > 30) is slices  # the slices' gaps raised the decode gap too: ~18 ms
    assert c.slice is slices
    assert ("wait bound" in c.reason) is slices


def test_a_broken_promise_with_nothing_live_admits_whole_even_when_slicing_idle():
    p = predictor(slice_idle=True, wait_bound_s=30.0)
    break_promise(p)
    c = p.choose("u", 20_000)
    assert not c.slice and c.hold_s == 0


def test_measured_rates_replace_the_priors():
    p = predictor()
    stream(p, 1, max_tokens=5000, done=10)
    for _ in range(50):
        p.slice_done("u", 10_000, 2.0)  # 5k tokens/s
        p.prefill_done("u", 20_000, 0.5)  # 40k tokens/s
    c = p.choose("u", 20_000)
    assert c.finish_slice_s == pytest.approx(4.0, rel=0.01)


def test_slice_when_idle_keeps_slices_sized_for_the_next_stream():
    p = predictor(slice_idle=True)
    sizer = p.sizer("u")
    before = sizer.tokens
    sizer.after(None)
    assert sizer.tokens == before
    assert not predictor().sizer("u").hold_unwatched  # without it, unwatched slices grow


def test_one_reads_gaps_count_as_single_gaps():
    """gap(u, s, n): s then n - 1 gaps of 0, as n calls would record them."""
    batched, single = predictor(), predictor()
    for gap, n in [(0.010, 1), (0.030, 4), (0.012, 2), (0.200, 1)]:
        batched.gap("u", gap, n)
        single.gap("u", gap)
        for _ in range(n - 1):
            single.gap("u", 0.0)
    assert batched.gaps_seen("u") == single.gaps_seen("u") == 8
    assert batched._ups["u"].gap_s == pytest.approx(single._ups["u"].gap_s, rel=1e-12)


def test_answers_that_all_ended_sooner_say_nothing_about_a_longer_one():
    """The seed pair's first run through `slicing auto` held A on a prediction of 1.7 s and
    A took 3.5 s: the answers this model had finished (warm-ups, A's own 58 tokens) all
    ended before B's 64th token, and the rule took that to mean B was about to end ("a
    few" tokens left) though B asked for 512. With no remembered answer longer than the
    stream so far, its own max_tokens is what is known."""
    clock = Clock()
    p = predictor(clock, wait_bound_s=30.0)
    for key in range(30):  # 30 short answers of this model, none longer than 64 tokens
        stream(p, 100 + key, 58, 0)
        clock.t += 0.3
        p.stream_ended("u", 100 + key, 58, finished=True)
    for _ in range(64):
        p.gap("u", 0.0047)
    stream(p, 1, max_tokens=512, done=64)
    c = p.choose("u", 28_600)
    assert c.hold_s >= 448 * 0.0047  # B's own 448 tokens to go, at its gap (the EWMA is still above it)
    assert c.slice  # slicing (~2.4 s) finishes A before B ends and A then prefills (~3 s)
    # Where enough remembered answers did go on longer, they still say how long (no max_tokens).
    for key in range(10):
        stream(p, 200 + key, None, 0)
        p.stream_ended("u", 200 + key, 100, finished=True)
    s = stream(p, 2, max_tokens=None, done=64)
    assert p.remaining_tokens(p._ups["u"].streams[2]) == 36
    s["n"] = 100  # past every remembered length again: back to what is known (nothing here)
    assert p.remaining_tokens(p._ups["u"].streams[2]) == 256


def test_hold_predictions_are_logged_in_finite_words():
    from prefill_gate.proxy.state import _hold_words

    assert _hold_words(0.5, 1.66, 30.0) == "hold then prefill ~1.66 s"
    for hold, finish in ((30616.6, 30617.7), (float("inf"), float("inf")), (float("nan"), float("nan"))):
        assert _hold_words(hold, finish, 30.0) == "holding would wait past the wait bound (30 s)"
