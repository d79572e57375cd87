"""The async side of admission: waiting, wait bounds, cancellation, release.

``AdmissionPolicy`` decides; ``Gate`` lets coroutines wait for its decisions. One
future per queued ticket is resolved when the policy admits it; the wait bound is
the ticket's own deadline; a cancelled waiter (the client went away) leaves the
queue. ``Gate.admission()`` is the only way in, and its ``finally`` is the only way
out, so every exit path (normal, error, cancel, timeout) releases exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

from .admission import AdmissionPolicy, Decision, Phase, Ticket
from .errors import QueueFull, QueueTimeout
from .labels import AdmissionLabel
from .metrics import Metrics


def _field(policy: AdmissionPolicy, upstream: str, name: str) -> float:
    return getattr(policy.upstreams[upstream], name)


class Lease:
    """What an admitted request holds: its upstream, and the two later transitions."""

    def __init__(self, gate: "Gate", ticket: Ticket):
        self._gate = gate
        self.ticket = ticket
        # Read per upstream read of the stream: its upstream's state, found once (again on a
        # reroute; its large_in_flight says whether a large prefill runs where this stream
        # decodes), and whether its gaps feed the closed loop at all.
        self.upstream_state = gate.policy.upstreams[ticket.upstream]
        self.closed_loop = ticket.protected and gate.policy.limits.itl_slo is not None

    @property
    def upstream(self) -> str:
        return self.ticket.upstream

    def decoding(self) -> None:
        """The first content chunk arrived. Idempotent."""
        if self.ticket.phase is Phase.PREFILLING:
            self._gate._wake(self._gate.policy.start_decoding(self.ticket))

    def reroute(self, tried: set[str]) -> bool:
        """Our upstream failed before answering: move to another. False: none left."""
        admitted = self._gate.policy.reroute(self.ticket, tried)
        if admitted is None:
            return False
        self.upstream_state = self._gate.policy.upstreams[self.ticket.upstream]
        self._gate._wake(admitted)  # the slot it left may start a queued request
        return True

    def token_gap(self, seconds: float, n: int = 1) -> None:
        """Gaps between content chunks of this stream, ``seconds`` then ``n - 1`` of 0 (one
        read's chunks; feeds the closed loop, where ``closed_loop``). On the per-read path:
        the gate wakes only when a window moved the budget."""
        if not self.closed_loop:
            return
        up = self.upstream_state
        budget = up.budget_tokens
        admitted = self._gate.policy.observe_itl(up.name, seconds, n)
        if admitted or up.budget_tokens != budget:
            self._gate._wake(admitted)

    @property
    def slicing(self) -> bool:
        """Admitted to slice its prompt into the upstream's cache before it is sent."""
        return self.ticket.phase is Phase.SLICING

    def sliced(self, tail_tokens: int) -> None:
        """Slicing is over; the request itself goes to this lease's upstream."""
        self._gate._wake(self._gate.policy.sliced(self.ticket, tail_tokens))

    async def hold(self) -> None:
        """Slicing could not start: wait in the queue as a held request would (the wait
        bound counts from its arrival)."""
        gate = self._gate
        gate._wake(gate.policy.unslice(self.ticket))
        if self.ticket.phase is Phase.QUEUED:
            await gate._wait(self.ticket)

    def _release(self) -> None:
        if self.ticket.phase is not Phase.DONE:  # a wait inside the lease may have ended it
            self._gate._wake(self._gate.policy.finish(self.ticket))


class Gate:
    def __init__(self, policy: AdmissionPolicy, metrics: Metrics | None = None):
        self.policy = policy
        self.metrics = metrics
        self._waiters: dict[int, asyncio.Future] = {}
        self._settle_waiters: dict[str, list[asyncio.Future]] = {}  # prefills_settled()
        if metrics is not None:  # the policy's counters, read when scraped (not copied per transition)
            metrics.queue_depth.set_function(lambda: policy.queue_depth)
            for name in policy.upstreams:
                for gauge, field in ((metrics.live_decodes, "live_decodes"), (metrics.large_in_flight, "large_in_flight"),
                                     (metrics.prefill_tokens, "prefill_tokens"),
                                     (metrics.budget_tokens, "budget_tokens")):
                    gauge.labels(name).set_function(functools.partial(_field, policy, name, field))

    def waiting(self, ticket: Ticket) -> tuple[int, float] | None:
        """(place in the queue, seconds until its wait bound) while queued; else None."""
        if ticket.phase is not Phase.QUEUED:
            return None
        return self.policy.position(ticket), max(0.0, ticket.deadline - self.policy.clock())

    def admission(self, ticket: Ticket) -> "_Admission":
        """``async with gate.admission(ticket) as lease``: in once admitted (QueueFull or
        QueueTimeout instead); the lease is released when the block ends, however it ends."""
        return _Admission(self, ticket)

    async def _acquire(self, ticket: Ticket) -> None:
        decision = self.policy.submit(ticket)
        if decision is Decision.REJECTED:
            self._count(ticket, AdmissionLabel.REJECTED_QUEUE_FULL)
            raise QueueFull(
                f"{self.policy.queue_depth} large prefills ({self.policy.queued_bytes} bytes) are already "
                "queued; retry later (max_queue, max_queued_bytes)",
                retry_after=self.policy.retry_after(),
            )
        if decision in (Decision.ADMITTED, Decision.SLICING):
            self._count(ticket, AdmissionLabel.IMMEDIATE if decision is Decision.ADMITTED else AdmissionLabel.SLICING)
            self._sync()
            return
        self._sync()
        await self._wait(ticket)

    async def _wait(self, ticket: Ticket) -> None:
        """Wait while queued: until admitted (or slicing), the wait bound, or cancellation."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = fut
        policy = self.policy
        try:
            while not fut.done():
                now = policy.clock()
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, min(ticket.deadline, ticket.recheck_at) - now))
                except asyncio.TimeoutError:
                    if ticket.phase is not Phase.QUEUED:
                        break
                    if policy.clock() < ticket.deadline:  # a hold outlived its prediction: decide again
                        ticket.recheck_at = float("inf")
                        self._wake(policy.recheck())
                        continue
                    if policy.expire(ticket) is Decision.REJECTED:
                        self._count(ticket, AdmissionLabel.REJECTED_TIMEOUT, waited=True)
                        raise QueueTimeout(
                            f"waited {policy.limits.max_queue_wait:g} s for live decodes to finish "
                            "(max_queue_wait; set on_queue_timeout=admit to admit instead)"
                        ) from None
                    break
            decision = AdmissionLabel.AFTER_TIMEOUT if ticket.expired else AdmissionLabel.AFTER_WAIT
            self._count(ticket, AdmissionLabel.SLICING if ticket.phase is Phase.SLICING else decision, waited=True)
        except asyncio.CancelledError:
            # The client went away while queued (or just as it was admitted).
            self._count(ticket, AdmissionLabel.CANCELLED, waited=True)
            if ticket.phase is not Phase.DONE:
                self._wake(self.policy.finish(ticket))
            raise
        finally:
            self._waiters.pop(ticket.id, None)
            self._sync()

    async def prefills_settled(self, upstream: str, timeout: float) -> float:
        """Wait until no request admitted to ``upstream`` is still prefilling, at most
        ``timeout`` seconds; returns the seconds waited. A slicer waits here before each
        slice so that a slice and an interactive prompt's prefill do not share an engine
        step (their costs add up in the streams' gap)."""
        if self.policy.upstreams[upstream].prefilling <= 0 or timeout <= 0:
            return 0.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        fut = loop.create_future()
        self._settle_waiters.setdefault(upstream, []).append(fut)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            waiters = self._settle_waiters.get(upstream, [])
            if fut in waiters:
                waiters.remove(fut)
        return loop.time() - start

    def set_health(self, upstream: str, healthy: bool) -> None:
        """An upstream came back (queued tickets may start there) or went away."""
        self._wake(self.policy.set_health(upstream, healthy))

    def _wake(self, admitted: list[Ticket]) -> None:
        for t in admitted:
            fut = self._waiters.get(t.id)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._sync()

    def _count(self, ticket: Ticket, decision: AdmissionLabel, waited: bool = False) -> None:
        if self.metrics is None:
            return
        self.metrics.admissions.labels(ticket.cls.value, decision).inc()
        if waited:
            self.metrics.queue_wait.labels(decision).observe(self.policy.clock() - ticket.arrived)

    def _sync(self) -> None:
        """After every transition: wake the slicers waiting for their upstream's prefills
        to settle."""
        for name, waiters in self._settle_waiters.items():
            if waiters and self.policy.upstreams[name].prefilling <= 0:
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)


class _Admission:
    """``Gate.admission``'s context (a class, not a generator: one per request)."""

    __slots__ = ("_gate", "_ticket", "_lease")

    def __init__(self, gate: Gate, ticket: Ticket) -> None:
        self._gate, self._ticket, self._lease = gate, ticket, None

    async def __aenter__(self) -> Lease:
        await self._gate._acquire(self._ticket)
        self._lease = Lease(self._gate, self._ticket)
        return self._lease

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._lease._release()
