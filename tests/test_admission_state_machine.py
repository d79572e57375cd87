"""The admission policy as a state machine (hypothesis): any sequence of submissions,
phase changes, slicing (on, and on when idle) and its ends, releases, expiries, health
flips and measured gaps keeps every counter equal to a recount from the tickets, one
slicer per upstream at most, the queue sorted, and no queued head admissible or sliceable."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefill_gate.proxy.admission import (
    AdmissionPolicy,
    Decision,
    Limits,
    Phase,
    RequestClass,
    Slicing,
    Ticket,
)

UPSTREAMS = ("u1", "u2")


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.tickets: list[Ticket] = []
        self.rerouted: set[int] = set()  # tickets moved by reroute (which may exceed the limits)
        self.policy = None

    @rule(max_large=st.integers(1, 2), max_decodes=st.integers(0, 2), max_queue=st.integers(0, 4),
          admit_on_timeout=st.booleans(), closed_loop=st.booleans(), slicing=st.booleans(),
          slice_idle=st.booleans(), can_slice=st.sampled_from([(True, True), (True, False), (False, False)]))
    @precondition(lambda self: self.policy is None)
    def configure(self, max_large, max_decodes, max_queue, admit_on_timeout, closed_loop, slicing, slice_idle,
                  can_slice):
        limits = Limits(max_large_in_flight=max_large, max_decodes_for_large=max_decodes, max_queue=max_queue,
                        max_queue_wait=10.0, admit_on_timeout=admit_on_timeout,
                        itl_slo=0.02 if closed_loop else None, budget_start_tokens=20000,
                        budget_step_tokens=8000, itl_min_samples=2, itl_window=0.5,
                        slicing=Slicing.ON if slicing else Slicing.OFF, slice_idle=slice_idle and slicing)
        self.policy = AdmissionPolicy(UPSTREAMS, limits, self.clock)
        for name, can in zip(UPSTREAMS, can_slice):
            self.policy.upstreams[name].can_slice = can

    @rule(large=st.booleans(), tokens=st.integers(1, 40000), protected=st.booleans(),
          priority=st.integers(-2, 2), prefer=st.sampled_from([None, *UPSTREAMS]), sliceable=st.booleans())
    @precondition(lambda self: self.policy is not None)
    def submit(self, large, tokens, protected, priority, prefer, sliceable):
        t = Ticket(RequestClass.LARGE if large else RequestClass.INTERACTIVE, tokens, protected=protected,
                   priority=priority, prefer=prefer, sliceable=large and sliceable)
        decision = self.policy.submit(t)
        if decision is Decision.REJECTED:
            assert t.phase is Phase.DONE and large
        else:
            self.tickets.append(t)

    @rule(data=st.data())
    @precondition(lambda self: any(t.phase is Phase.PREFILLING for t in self.tickets))
    def first_token(self, data):
        t = data.draw(st.sampled_from([t for t in self.tickets if t.phase is Phase.PREFILLING]))
        self.policy.start_decoding(t)

    @rule(data=st.data(), tail=st.integers(1, 500))
    @precondition(lambda self: any(t.phase is Phase.SLICING for t in self.tickets))
    def slicing_ends(self, data, tail):
        t = data.draw(st.sampled_from([t for t in self.tickets if t.phase is Phase.SLICING]))
        self.policy.sliced(t, tail)
        assert t.phase is Phase.PREFILLING and t.sliced and t.tokens == tail

    @rule(data=st.data())
    @precondition(lambda self: any(t.phase is Phase.SLICING for t in self.tickets))
    def slicing_cannot_start(self, data):
        t = data.draw(st.sampled_from([t for t in self.tickets if t.phase is Phase.SLICING]))
        self.policy.unslice(t)
        assert not t.sliceable and t.phase in (Phase.QUEUED, Phase.PREFILLING)

    @rule(data=st.data())
    @precondition(lambda self: any(t.phase is not Phase.DONE for t in self.tickets))
    def finish(self, data):
        t = data.draw(st.sampled_from([t for t in self.tickets if t.phase is not Phase.DONE]))
        self.policy.finish(t)

    @rule(seconds=st.floats(0.1, 12.0))
    @precondition(lambda self: self.policy is not None)
    def time_passes_and_bounds_expire(self, seconds):
        self.clock.t += seconds
        for t in self.policy.due():
            self.policy.expire(t)

    @rule(upstream=st.sampled_from(UPSTREAMS), healthy=st.booleans())
    @precondition(lambda self: self.policy is not None)
    def health(self, upstream, healthy):
        self.policy.set_health(upstream, healthy)

    @rule(upstream=st.sampled_from(UPSTREAMS), gap=st.sampled_from([0.005, 0.05]))
    @precondition(lambda self: self.policy is not None)
    def gap(self, upstream, gap):
        self.clock.t += 0.3
        self.policy.observe_itl(upstream, gap)

    @rule(data=st.data())
    @precondition(lambda self: len(UPSTREAMS) > 1 and any(t.phase is Phase.PREFILLING for t in self.tickets))
    def reroute(self, data):
        t = data.draw(st.sampled_from([t for t in self.tickets if t.phase is Phase.PREFILLING]))
        before = t.upstream
        if self.policy.reroute(t, {before}) is not None:
            assert t.upstream != before
            self.rerouted.add(t.id)

    @invariant()
    def counters_match_a_recount(self):
        if self.policy is None:
            return
        for name, u in self.policy.upstreams.items():
            mine = [t for t in self.tickets if t.upstream == name]
            prefilling = [t for t in mine if t.phase is Phase.PREFILLING]
            assert u.active == sum(t.phase in (Phase.PREFILLING, Phase.DECODING) for t in mine)
            assert u.live_decodes == sum(t.phase is Phase.DECODING and t.protected for t in mine)
            assert u.large_in_flight == sum(t.cls is RequestClass.LARGE and not t.sliced for t in prefilling)
            assert u.prefill_tokens == sum(t.tokens for t in prefilling)
            assert u.prefilling == len(prefilling)
            slicing = [t for t in mine if t.phase is Phase.SLICING]
            assert len(slicing) <= 1 and u.slicer == (slicing[0].id if slicing else None)  # one slicer
            assert all(t.sliceable and u.can_slice for t in slicing)
            assert u.budget_tokens >= 0

    @invariant()
    def queue_is_ordered_and_its_head_waits_for_a_reason(self):
        if self.policy is None:
            return
        queued = self.policy.queued()
        assert queued == sorted((t for t in self.tickets if t.phase is Phase.QUEUED), key=lambda t: t.sort_key)
        assert all(t.cls is RequestClass.LARGE for t in queued)
        if queued:  # the head waits only while it can neither start nor be sliced anywhere
            assert self.policy._eligible(queued[0]) is None and self.policy._slicer_for(queued[0]) is None

    @invariant()
    def limits_hold_except_for_expired_admissions(self):
        if self.policy is None:
            return
        for name, u in self.policy.upstreams.items():
            over = sum((t.expired or t.id in self.rerouted) and t.phase is Phase.PREFILLING and t.upstream == name
                       and t.cls is RequestClass.LARGE for t in self.tickets)
            assert u.large_in_flight <= self.policy.limits.max_large_in_flight + over
            if self.policy.limits.slice_idle and u.slicer is not None:  # none runs whole beside a slicer
                assert u.large_in_flight <= over


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
