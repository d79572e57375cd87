"""The pure admission policy, driven with a fake clock."""

import pytest

from prefill_gate.proxy.admission import AdmissionPolicy, Decision, Limits, Phase, PolicyError, RequestClass, Ticket

I, L = RequestClass.INTERACTIVE, RequestClass.LARGE


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def policy(upstreams=("u1",), **limits):
    clock = Clock()
    return AdmissionPolicy(upstreams, Limits(**limits), clock), clock


def large(priority=0, tokens=30000, protected=True):
    return Ticket(L, tokens, protected=protected, priority=priority)


def small(protected=True):
    return Ticket(I, 50, protected=protected)


def decoding(p, t):
    assert p.submit(t) is Decision.ADMITTED
    p.start_decoding(t)
    return t


@pytest.mark.parametrize(
    "setup, expect",
    [
        ("idle", Decision.ADMITTED),
        ("one streaming decode", Decision.QUEUED),
        ("one non-streaming request (unprotected) decoding", Decision.ADMITTED),
        ("an interactive request still prefilling", Decision.ADMITTED),
        ("another large prefill prefilling", Decision.QUEUED),
        ("another large prefill now decoding (protected)", Decision.QUEUED),
    ],
)
def test_large_prefill_admission_rule(setup, expect):
    p, _ = policy()
    if setup == "one streaming decode":
        decoding(p, small())
    elif setup.startswith("one non-streaming"):
        decoding(p, small(protected=False))
    elif setup.startswith("an interactive request still"):
        p.submit(small())
    elif setup == "another large prefill prefilling":
        p.submit(large())
    elif setup.startswith("another large prefill now decoding"):
        decoding(p, large())
    assert p.submit(large()) is expect


def test_small_prompts_never_wait_behind_large_ones():
    p, _ = policy()
    decoding(p, small())
    for _ in range(3):
        assert p.submit(large()) is Decision.QUEUED
    assert p.submit(small()) is Decision.ADMITTED
    assert p.queue_depth == 3


def test_release_of_last_decode_admits_head_then_next_waits_for_it():
    p, _ = policy()
    b = decoding(p, small())
    a1, a2 = large(), large()
    p.submit(a1), p.submit(a2)
    admitted = p.finish(b)
    assert admitted == [a1] and a1.phase is Phase.PREFILLING
    assert a2.phase is Phase.QUEUED  # one large prefill in flight at a time
    assert p.start_decoding(a1) == []  # a1 now decodes (protected): a2 still waits
    assert p.finish(a1) == [a2]


def test_queue_orders_by_priority_then_arrival():
    p, _ = policy()
    b = decoding(p, small())
    t = [large(priority=5), large(priority=0), large(priority=5), large(priority=-1)]
    for x in t:
        p.submit(x)
    assert [x.priority for x in p.queued()] == [-1, 0, 5, 5]
    assert p.queued()[2] is t[0] and p.queued()[3] is t[2]
    assert p.finish(b) == [t[3]]


@pytest.mark.parametrize("admit_on_timeout, decision", [(True, Decision.ADMITTED), (False, Decision.REJECTED)])
def test_wait_bound(admit_on_timeout, decision):
    p, clock = policy(max_queue_wait=10.0, admit_on_timeout=admit_on_timeout)
    decoding(p, small())
    a = large()
    p.submit(a)
    assert a.deadline == 110.0
    clock.t = 109.9
    assert p.due() == []
    clock.t = 110.0
    assert p.due() == [a]
    assert p.expire(a) is decision
    assert p.queue_depth == 0
    up = p.upstreams["u1"]
    assert up.large_in_flight == (1 if admit_on_timeout else 0)
    assert a.expired is admit_on_timeout


def test_queue_full_rejects_and_retry_after_is_the_earliest_deadline():
    p, clock = policy(max_queue=2, max_queue_wait=30.0)
    decoding(p, small())
    p.submit(large())
    clock.t += 5
    p.submit(large())
    extra = large()
    assert p.submit(extra) is Decision.REJECTED
    assert extra.phase is Phase.DONE
    assert p.retry_after() == pytest.approx(25.0)
    clock.t += 29.5
    assert p.retry_after() == 1.0  # never below one second


def test_max_queue_zero_means_admit_now_or_reject():
    p, _ = policy(max_queue=0)
    assert p.submit(large()) is Decision.ADMITTED
    assert p.submit(large()) is Decision.REJECTED


def test_cancel_while_queued_leaves_the_queue_and_counts_nothing():
    p, _ = policy()
    b = decoding(p, small())
    a = large()
    p.submit(a)
    assert p.finish(a) == []
    assert p.queue_depth == 0
    p.finish(b)
    s = p.snapshot().upstreams["u1"]
    assert (s.active, s.live_decodes, s.large_in_flight, s.prefill_tokens) == (0, 0, 0, 0)


@pytest.mark.parametrize("phase", ["prefilling", "decoding"])
def test_finish_in_each_phase_releases_exactly_once(phase):
    p, _ = policy()
    a = large()
    p.submit(a)
    if phase == "decoding":
        p.start_decoding(a)
    p.finish(a)
    s = p.snapshot().upstreams["u1"]
    assert (s.active, s.live_decodes, s.large_in_flight, s.prefill_tokens) == (0, 0, 0, 0)
    with pytest.raises(PolicyError):
        p.finish(a)
    assert p.submit(large()) is Decision.ADMITTED  # nothing phantom left behind


def test_protocol_errors():
    p, _ = policy()
    a = large()
    with pytest.raises(PolicyError):
        p.start_decoding(a)  # never submitted
    p.submit(a)
    with pytest.raises(PolicyError):
        p.submit(a)
    with pytest.raises(PolicyError):
        p.expire(a)  # not queued


def test_max_decodes_for_large_allows_some_live_decodes():
    p, _ = policy(max_decodes_for_large=1)
    decoding(p, small())
    assert p.submit(large()) is Decision.ADMITTED
    p2, _ = policy(max_decodes_for_large=1)
    decoding(p2, small()), decoding(p2, small())
    assert p2.submit(large()) is Decision.QUEUED


def test_two_upstreams_large_prefill_goes_where_nobody_decodes():
    p, _ = policy(upstreams=("u1", "u2"))
    b = Ticket(I, 40, prefer="u1")
    decoding(p, b)
    assert b.upstream == "u1"
    a = large()
    assert p.submit(a) is Decision.ADMITTED and a.upstream == "u2"
    assert p.submit(large()) is Decision.QUEUED  # u1 decodes, u2 is busy with a


def test_unhealthy_upstream_is_skipped_and_its_return_pumps_the_queue():
    p, _ = policy(upstreams=("u1", "u2"))
    p.set_health("u2", False)
    decoding(p, Ticket(I, 40, prefer="u1"))
    a = large()
    assert p.submit(a) is Decision.QUEUED
    assert p.set_health("u2", True) == [a]
    assert a.upstream == "u2"


def test_with_every_upstream_down_a_large_prefill_is_not_held_for_one_to_return():
    """Health stops deciding when nothing is up (as for interactive requests): a large prefill
    goes and fails at once instead of waiting its bound (30 s by default) and failing then;
    the decode rule still holds it. Found with a refusing upstream: the first large request got
    its 502 at once, every later one after the wait bound."""
    p, _ = policy(upstreams=("u1", "u2"))
    p.set_health("u1", False)
    a = large()
    assert p.submit(a) is Decision.ADMITTED and a.upstream == "u2"
    b = large()
    assert p.submit(b) is Decision.QUEUED  # u2 is busy with a, u1 is down
    assert p.set_health("u2", False) == [b] and b.upstream == "u1"  # the last one down: b goes
    c = large()
    assert p.submit(c) is Decision.QUEUED  # both have their one large prefill
    p.finish(a), p.finish(b)
    assert c.phase is Phase.PREFILLING
    d = Ticket(I, 40, prefer=c.upstream)
    decoding(p, d)
    p.finish(c)
    e = large()
    assert p.submit(e) is Decision.ADMITTED  # the other one: nothing decodes there
    assert p.submit(large()) is Decision.QUEUED  # d decodes on one, e prefills on the other


def test_interactive_goes_to_least_active_healthy_upstream():
    p, _ = policy(upstreams=("u1", "u2"))
    t1, t2, t3 = small(), small(), small()
    p.submit(t1), p.submit(t2)
    assert {t1.upstream, t2.upstream} == {"u1", "u2"}
    p.set_health("u1", False)
    p.submit(t3)
    assert t3.upstream == "u2"


def test_prefill_token_gauge_follows_phases():
    p, _ = policy()
    a = large(tokens=28000)
    s = small()
    p.submit(a), p.submit(s)
    assert p.upstreams["u1"].prefill_tokens == 28050
    p.start_decoding(s)
    assert p.upstreams["u1"].prefill_tokens == 28000
    p.start_decoding(a)
    assert p.upstreams["u1"].prefill_tokens == 0


# ------------------------------------------------------------- closed loop (AIMD)
def feed(p, clock, upstream, gap, seconds=1.0, n=16):
    """n gaps of `gap` s spread over `seconds` of the fake clock; returns admitted tickets."""
    admitted = []
    for _ in range(n):
        clock.t += seconds / n
        admitted += p.observe_itl(upstream, gap)
    return admitted


def test_closed_loop_is_off_by_default():
    p, clock = policy()
    assert p.upstreams["u1"].budget_tokens == 0
    assert feed(p, clock, "u1", 0.005) == []
    assert p.upstreams["u1"].itl_p95 is None


def test_closed_loop_admits_next_to_decodes_within_the_budget():
    p, clock = policy(itl_slo=0.020, budget_start_tokens=32768, budget_step_tokens=8192)
    b = decoding(p, small())
    a = large(tokens=28600)
    assert p.submit(a) is Decision.ADMITTED  # 28,600 <= 32,768: next to the live decode
    a2 = large(tokens=28600)
    assert p.submit(a2) is Decision.QUEUED  # max_large_in_flight = 1 still holds
    p.start_decoding(a)
    assert a2.phase is Phase.PREFILLING  # A's prefill ended: budget and slot free again
    p.finish(b)


def test_closed_loop_aimd_grows_on_good_windows_and_halves_on_bad_ones():
    p, clock = policy(itl_slo=0.020, budget_start_tokens=16384, budget_step_tokens=8192)
    decoding(p, small())
    a = large(tokens=28600)
    assert p.submit(a) is Decision.QUEUED  # 28,600 > 16,384: held
    assert feed(p, clock, "u1", 0.010) == []  # one good window: 24,576
    assert p.upstreams["u1"].budget_tokens == 24576
    assert feed(p, clock, "u1", 0.010) == [a]  # 32,768: A fits, admitted by the loop
    assert p.upstreams["u1"].itl_p95 == pytest.approx(0.010)
    feed(p, clock, "u1", 0.050)  # the streams suffer: halve
    assert p.upstreams["u1"].budget_tokens == 16384
    assert p.upstreams["u1"].itl_p95 == pytest.approx(0.050)


def test_closed_loop_needs_enough_gaps_and_a_whole_window():
    p, clock = policy(itl_slo=0.020, budget_start_tokens=0, budget_step_tokens=8192,
                      itl_min_samples=10, itl_window=1.0)
    feed(p, clock, "u1", 0.010, seconds=2.0, n=5)  # too few gaps
    assert p.upstreams["u1"].budget_tokens == 0
    feed(p, clock, "u1", 0.010, seconds=0.5, n=8)  # 13 gaps, a window complete
    assert p.upstreams["u1"].budget_tokens == 8192
    feed(p, clock, "u1", 0.010, seconds=0.5, n=32)  # half a window: no decision yet
    assert p.upstreams["u1"].budget_tokens == 8192


def test_p95_ignores_a_rare_stall_but_not_a_frequent_one():
    p, clock = policy(itl_slo=0.020, budget_start_tokens=8192, budget_step_tokens=8192)
    for i in range(32):
        clock.t += 1 / 32
        p.observe_itl("u1", 0.300 if i == 7 else 0.010)  # 1 of 32: under 5%
    assert p.upstreams["u1"].budget_tokens == 16384
    for i in range(32):
        clock.t += 1 / 32
        p.observe_itl("u1", 0.300 if i % 8 == 0 else 0.010)  # 12.5%
    assert p.upstreams["u1"].budget_tokens == 8192


# ---------------------------------------------------------------- reroute
def test_reroute_moves_counters_to_another_healthy_upstream():
    p, _ = policy(("u1", "u2", "u3"))
    a = large()
    p.submit(a)
    first = a.upstream
    p.set_health("u3", False)
    assert p.reroute(a, {first}) == []
    assert a.upstream not in (first, "u3")
    assert p.upstreams[first].active == 0 and p.upstreams[first].large_in_flight == 0
    assert p.upstreams[a.upstream].large_in_flight == 1
    assert p.upstreams[a.upstream].prefill_tokens == a.tokens
    assert p.reroute(a, {"u1", "u2"}) is None  # none left (u3 is down)
    p.finish(a)
    assert all(u.active == 0 and u.prefill_tokens == 0 for u in p.upstreams.values())


def test_reroute_only_while_prefilling():
    p, _ = policy(("u1", "u2"))
    t = decoding(p, small())
    with pytest.raises(PolicyError):
        p.reroute(t, {t.upstream})


def test_reroute_frees_a_slot_that_starts_a_queued_prefill():
    # Found by the state machine: moving a large prefill away must pump the queue.
    p, _ = policy(("u1", "u2"))
    a = large()
    p.submit(a)
    b = large()
    p.submit(b)
    c = large()
    assert p.submit(c) is Decision.QUEUED  # both upstreams have their one large prefill
    p.set_health(b.upstream, True)
    failed = a.upstream
    p.finish(b)  # b's upstream is free again
    assert c.phase is Phase.PREFILLING
    d = large()
    assert p.submit(d) is Decision.QUEUED
    admitted = p.reroute(a, {failed})  # a moves onto c's upstream; its own slot frees
    assert admitted == [d] and d.upstream == failed


async def test_a_lease_reads_its_own_upstreams_large_prefills_and_follows_a_reroute():
    """The per-read question (is a large prefill in flight where this stream decodes?) is
    answered from the live state of the lease's upstream, the one it moved to included."""
    from prefill_gate.proxy.gate import Gate

    p, _ = policy(("u1", "u2"))
    ticket = small()
    ticket.prefer = "u1"
    async with Gate(p).admission(ticket) as lease:
        assert lease.upstream == "u1" and not lease.upstream_state.large_in_flight > 0
        p.upstreams["u1"].large_in_flight = 1
        assert lease.upstream_state.large_in_flight > 0
        assert lease.reroute({"u1"}) and lease.upstream == "u2"
        assert not lease.upstream_state.large_in_flight > 0
        p.upstreams["u2"].large_in_flight = 1
        assert lease.upstream_state.large_in_flight > 0
        p.upstreams["u1"].large_in_flight = p.upstreams["u2"].large_in_flight = 0
    assert not lease.closed_loop  # no itl_slo: the stream's gaps feed nothing
    p2, _ = policy(("u1",), itl_slo=0.05)
    async with Gate(p2).admission(small()) as lease2:
        assert lease2.closed_loop
