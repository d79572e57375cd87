"""The admission policy: who may start prefilling where, and who waits.

Pure state, no I/O and no asyncio: the clock is injected, so that tests drive it
with a fake one. ``gate.py`` puts the waiting (futures, timers, cancellation) on top.

The rule, per upstream: a *large* prefill is admitted only while that upstream is
healthy, has at most ``max_decodes_for_large`` live protected decodes and fewer
than ``max_large_in_flight`` large prefills still prefilling. Otherwise it waits
in one queue ordered by (priority, arrival); lower priority values go first, as
in vLLM. With every upstream down, health no longer picks (as for interactive requests): a
large prefill is not held for an upstream to come back, it goes and fails as fast as an
interactive request does. *Interactive* requests are never queued. A queued ticket leaves when the
rule lets it in, when its wait bound passes (``expire``: admit or reject), or when
its client goes away (``finish``).

Closed loop (``itl_slo`` set, for engines that pace their own steps): a large prefill
may also start next to live decodes when the upstream's in-flight prefill tokens plus its
own stay within that upstream's budget. The budget follows the streams: each window of
measured gaps (``observe_itl``) whose p95 is within the SLO adds ``step_tokens``
(additive increase); one over it halves the budget (multiplicative decrease), so a
budget that hurt the streams falls back to holding.

A *paced* upstream (its engine bounds every step while requests decode: prefill-gate's
engine patches, found by the app's health checks) admits large prefills next to live decodes,
as many as ``max_large_in_flight`` at once (with ``itl_slo`` set, within the closed loop's
budget as above): the engine keeps the streams' steps short, so waiting would only delay the
prompt.

Slicing (``slicing`` on or auto, for stock engines): a large prefill that the rule would
hold may instead be *sliced* on an upstream that can (``can_slice``: prefix caching and
``/tokenize``) and has no other slicer: the proxy warms the engine's prefix cache with
growing prefixes of the prompt, one small request at a time, then sends the request
itself, whose prefill is then only the tail. ``on`` slices whenever it would hold; ``auto``
asks ``chooser(ticket, upstream)`` (the predicted finish of holding against slicing). With
``slice_idle`` a prompt is sliced even where it could run whole (nothing protected live), so
that interactive requests arriving during its prefill are not stalled behind it. A sliced
request is never rerouted: its prefix is cached where it was sliced.

A ticket's life: QUEUED? -> SLICING? -> PREFILLING -> DECODING? -> DONE (a slicer that
cannot tokenize goes back: SLICING -> QUEUED). Every transition updates the counters of
its upstream, and ``finish`` is the single exit: calling it twice is a bug and raises.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


class RequestClass(str, enum.Enum):
    INTERACTIVE = "interactive"
    LARGE = "large"


class Phase(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    SLICING = "slicing"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"


class Decision(str, enum.Enum):
    ADMITTED = "admitted"
    SLICING = "slicing"
    QUEUED = "queued"
    REJECTED = "rejected"


class Slicing(str, enum.Enum):
    OFF = "off"
    ON = "on"
    AUTO = "auto"


@dataclass(frozen=True)
class Limits:
    max_large_in_flight: int = 1
    max_decodes_for_large: int = 0
    max_queue: int = 256
    max_queue_bytes: int = 1 << 30  # request bodies held by queued tickets
    max_queue_wait: float = 30.0
    admit_on_timeout: bool = True
    itl_slo: float | None = None  # seconds; None: no closed loop
    budget_start_tokens: int = 32768
    budget_step_tokens: int = 8192
    budget_max_tokens: int = 1 << 20
    itl_window: float = 1.0  # seconds per AIMD decision
    itl_min_samples: int = 10  # a window decides only with at least this many gaps
    slicing: Slicing = Slicing.OFF
    slice_idle: bool = False  # slice also when nothing protected is live (arrivals' first tokens)


@dataclass(eq=False)
class Ticket:
    """One request as the policy sees it. Fields after ``prefer`` belong to the policy."""

    cls: RequestClass
    tokens: int
    protected: bool = True
    bytes: int = 0  # its request body, held while it is queued
    priority: int = 0
    prefer: str | None = None
    id: int = 0
    phase: Phase = Phase.NEW
    upstream: str | None = None
    arrived: float = 0.0
    deadline: float = float("inf")
    admitted_at: float | None = None
    expired: bool = False  # admitted because its wait bound passed
    sliceable: bool = False  # its prompt can be sliced (the app decides from the request)
    sliced: bool = False  # its prefix was sliced into the cache: only the tail is prefill
    chosen: bool | None = None  # auto slicing: the chooser's last answer (slice?), for the log
    recheck_at: float = float("inf")  # auto slicing: a hold's predicted end, when the gate asks again

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.id)


@dataclass
class UpstreamState:
    name: str
    healthy: bool = True
    active: int = 0  # admitted, not done
    live_decodes: int = 0  # protected requests in their decode phase
    large_in_flight: int = 0  # large prefills still prefilling
    prefill_tokens: int = 0  # estimated prompt tokens of requests still prefilling
    prefilling: int = 0  # requests admitted here and still prefilling (no first chunk yet)
    budget_tokens: int = 0  # closed loop: in-flight prefill tokens allowed next to decodes
    itl_p95: float | None = None  # closed loop: the last decided window's p95 gap
    can_slice: bool = False  # slice here: prefix caching on and /tokenize answers (probed by the app)
    paced: bool = False  # its engine bounds every step (probed by the app): no waiting for live decodes
    slicer: int | None = None  # the ticket slicing here (one at a time)
    gaps: list[float] = field(default_factory=list, repr=False)
    window_start: float = 0.0


@dataclass
class Snapshot:
    queue_depth: int
    upstreams: dict[str, UpstreamState] = field(default_factory=dict)


class PolicyError(RuntimeError):
    """A caller broke the ticket protocol (released twice, decoded before admission)."""


Chooser = Callable[[Ticket, UpstreamState], bool]  # auto slicing: True to slice, False to hold


class AdmissionPolicy:
    def __init__(self, upstreams: Iterable[str], limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
                 chooser: Chooser | None = None):
        self.limits = limits
        self.clock = clock
        self.chooser = chooser
        start = limits.budget_start_tokens if limits.itl_slo is not None else 0
        self.upstreams = {name: UpstreamState(name, budget_tokens=start, window_start=clock())
                          for name in upstreams}
        if not self.upstreams:
            raise ValueError("the policy needs at least one upstream")
        self._queue: list[Ticket] = []  # sorted by (priority, id)
        self._queued_bytes = 0
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- queries
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def queued(self) -> list[Ticket]:
        return list(self._queue)

    def position(self, ticket: Ticket) -> int:
        """0-based place of a queued ticket (the number ahead of it)."""
        return self._queue.index(ticket)

    def retry_after(self) -> float:
        """Seconds until the queue is sure to move: the earliest deadline among queued tickets."""
        if not self._queue:
            return 1.0
        return max(1.0, min(t.deadline for t in self._queue) - self.clock())

    def due(self) -> list[Ticket]:
        now = self.clock()
        return [t for t in self._queue if t.deadline <= now]

    def snapshot(self) -> Snapshot:
        return Snapshot(
            queue_depth=len(self._queue),
            upstreams={n: UpstreamState(**{**vars(u), "gaps": []}) for n, u in self.upstreams.items()},
        )

    # ------------------------------------------------------------ transitions
    def submit(self, ticket: Ticket) -> Decision:
        if ticket.phase is not Phase.NEW:
            raise PolicyError(f"ticket {ticket.id} submitted twice")
        ticket.id = next(self._ids)
        ticket.arrived = self.clock()
        if ticket.cls is RequestClass.INTERACTIVE:
            self._admit(ticket, self._pick_any(ticket.prefer))
            return Decision.ADMITTED
        full = (len(self._queue) >= self.limits.max_queue
                or self._queued_bytes + ticket.bytes > self.limits.max_queue_bytes)
        if full and not self._can_start_now():
            ticket.phase = Phase.DONE
            return Decision.REJECTED
        ticket.deadline = ticket.arrived + self.limits.max_queue_wait
        self._enqueue(ticket)
        self._pump()
        if ticket.phase is Phase.SLICING:
            return Decision.SLICING
        return Decision.ADMITTED if ticket.phase is Phase.PREFILLING else Decision.QUEUED

    def sliced(self, ticket: Ticket, tail_tokens: int) -> list[Ticket]:
        """Slicing is over: the request goes to its upstream, with ``tail_tokens`` left to
        prefill. Returns tickets admitted by the freed slicer."""
        if ticket.phase is not Phase.SLICING:
            raise PolicyError(f"ticket {ticket.id} sliced from {ticket.phase.value}")
        up = self.upstreams[ticket.upstream]
        up.slicer = None
        ticket.sliced = True
        ticket.tokens = tail_tokens
        self._admit(ticket, up)
        return self._pump()

    def unslice(self, ticket: Ticket) -> list[Ticket]:
        """The slicer could not start (no token ids): back to the queue, in its old place
        and with its old deadline, never to be sliced again. Returns tickets admitted,
        possibly this one."""
        if ticket.phase is not Phase.SLICING:
            raise PolicyError(f"ticket {ticket.id} unsliced from {ticket.phase.value}")
        self.upstreams[ticket.upstream].slicer = None
        ticket.sliceable = False
        ticket.upstream = None
        self._enqueue(ticket)
        return self._pump()

    def _enqueue(self, ticket: Ticket) -> None:
        ticket.phase = Phase.QUEUED
        bisect.insort(self._queue, ticket, key=lambda t: t.sort_key)
        self._queued_bytes += ticket.bytes

    def _dequeue(self, ticket: Ticket) -> None:
        self._queue.remove(ticket)
        self._queued_bytes -= ticket.bytes

    def start_decoding(self, ticket: Ticket) -> list[Ticket]:
        """The first content chunk arrived: the prefill is over. Returns tickets admitted by it."""
        if ticket.phase is not Phase.PREFILLING:
            raise PolicyError(f"ticket {ticket.id} cannot start decoding from {ticket.phase.value}")
        up = self.upstreams[ticket.upstream]
        self._end_prefill(up, ticket)
        ticket.phase = Phase.DECODING
        if ticket.protected:
            up.live_decodes += 1
        return self._pump()

    def finish(self, ticket: Ticket) -> list[Ticket]:
        """The single exit for every ticket, in any phase. Returns tickets admitted by it."""
        phase = ticket.phase
        if phase in (Phase.DONE, Phase.NEW):
            raise PolicyError(f"ticket {ticket.id} finished from {phase.value}")
        ticket.phase = Phase.DONE
        if phase is Phase.QUEUED:
            self._dequeue(ticket)
            return self._pump()
        up = self.upstreams[ticket.upstream]
        if phase is Phase.SLICING:
            up.slicer = None
            return self._pump()
        up.active -= 1
        if phase is Phase.PREFILLING:
            self._end_prefill(up, ticket)
        elif ticket.protected:
            up.live_decodes -= 1
        return self._pump()

    def expire(self, ticket: Ticket) -> Decision:
        """The ticket's wait bound passed: admit it anyway or reject it, per the limits."""
        if ticket.phase is not Phase.QUEUED:
            raise PolicyError(f"ticket {ticket.id} expired from {ticket.phase.value}")
        self._dequeue(ticket)
        if not self.limits.admit_on_timeout:
            ticket.phase = Phase.DONE
            return Decision.REJECTED
        ticket.expired = True
        self._admit(ticket, self._pick_least_busy())
        return Decision.ADMITTED

    def observe_itl(self, upstream: str, seconds: float, n: int = 1) -> list[Ticket]:
        """Gaps between chunks of a protected stream on ``upstream`` (closed loop):
        ``seconds``, then ``n - 1`` of 0 (one read's chunks). Returns tickets admitted
        because the budget grew."""
        lim = self.limits
        if lim.itl_slo is None:
            return []
        up = self.upstreams[upstream]
        up.gaps.append(seconds)
        if n > 1:
            up.gaps.extend([0.0] * (n - 1))
        now = self.clock()
        if now - up.window_start < lim.itl_window or len(up.gaps) < lim.itl_min_samples:
            return []
        gaps = sorted(up.gaps)
        up.itl_p95 = gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))]
        up.gaps.clear()
        up.window_start = now
        if up.itl_p95 <= lim.itl_slo:
            up.budget_tokens = min(lim.budget_max_tokens, up.budget_tokens + lim.budget_step_tokens)
            return self._pump()
        up.budget_tokens //= 2
        return []

    def reroute(self, ticket: Ticket, tried: set[str]) -> list[Ticket] | None:
        """Move an admitted ticket that its upstream failed before answering to another
        healthy upstream not in ``tried`` (nothing reached its client yet). None: none
        left; else the queued tickets that the freed slot admitted."""
        if ticket.phase is not Phase.PREFILLING:
            raise PolicyError(f"ticket {ticket.id} rerouted from {ticket.phase.value}")
        others = [u for u in self.upstreams.values() if u.healthy and u.name not in tried]
        if not others or ticket.sliced:  # a sliced prefix is cached where it was sliced
            return None
        old = self.upstreams[ticket.upstream]
        old.active -= 1
        self._end_prefill(old, ticket)
        admitted_at = ticket.admitted_at  # (its prefill's clock started at its first admission)
        self._admit(ticket, min(others, key=lambda u: (u.large_in_flight, u.live_decodes, u.active)))
        ticket.admitted_at = admitted_at
        return self._pump()

    def recheck(self) -> list[Ticket]:
        """Ask again for the queue's head (a hold outlived its prediction): tickets admitted."""
        return self._pump()

    def set_health(self, upstream: str, healthy: bool) -> list[Ticket]:
        """Tickets admitted by the change: one that comes back may take the queue's head, and
        so may the last one going down (with none left up, health no longer decides, below)."""
        self.upstreams[upstream].healthy = healthy
        return self._pump()

    # ---------------------------------------------------------------- helpers
    def _healthy(self) -> list[UpstreamState]:
        ups = [u for u in self.upstreams.values() if u.healthy]
        return ups or list(self.upstreams.values())  # all down: try anyway, errors will tell

    def _pick_any(self, prefer: str | None) -> UpstreamState:
        ups = self._healthy()
        for u in ups:
            if u.name == prefer:
                return u
        return min(ups, key=lambda u: u.active)

    def _pick_least_busy(self) -> UpstreamState:
        return min(self._healthy(), key=lambda u: (u.large_in_flight, u.live_decodes, u.active))

    def _eligible(self, ticket: Ticket | None = None) -> UpstreamState | None:
        lim = self.limits
        tokens = ticket.tokens if ticket is not None else 0
        ok = [
            u
            for u in self._healthy()  # none healthy: all, as for interactive requests (errors will tell)
            if u.large_in_flight < lim.max_large_in_flight
            and (u.slicer is None or not lim.slice_idle)  # slice_idle: none runs whole beside a slicer
            and (u.live_decodes <= lim.max_decodes_for_large
                or (lim.itl_slo is not None and u.prefill_tokens + tokens <= u.budget_tokens)
                or (u.paced and lim.itl_slo is None))
        ]
        if not ok:
            return None
        if ticket is not None:
            for u in ok:
                if u.name == ticket.prefer:
                    return u
        return min(ok, key=lambda u: (u.live_decodes, u.active))

    def _can_start_now(self) -> bool:
        return not self._queue and self._eligible() is not None

    def _admit(self, ticket: Ticket, up: UpstreamState) -> None:
        ticket.phase = Phase.PREFILLING
        ticket.upstream = up.name
        ticket.admitted_at = self.clock()
        up.active += 1
        up.prefilling += 1
        up.prefill_tokens += ticket.tokens
        if ticket.cls is RequestClass.LARGE and not ticket.sliced:
            up.large_in_flight += 1

    def _end_prefill(self, up: UpstreamState, ticket: Ticket) -> None:
        up.prefilling -= 1
        up.prefill_tokens -= ticket.tokens
        if ticket.cls is RequestClass.LARGE and not ticket.sliced:
            up.large_in_flight -= 1

    def _slicer_for(self, ticket: Ticket) -> UpstreamState | None:
        """An upstream where this held ticket may be sliced instead, if any (and, in auto
        mode, if the chooser predicts slicing finishes it sooner than holding)."""
        mode = self.limits.slicing
        if mode is Slicing.OFF or not ticket.sliceable:
            return None
        ok = [u for u in self.upstreams.values()
              if u.healthy and u.can_slice and u.slicer is None and u.large_in_flight == 0]
        if not ok:
            return None
        up = next((u for u in ok if u.name == ticket.prefer), None) or min(ok, key=lambda u: (u.live_decodes, u.active))
        if mode is Slicing.AUTO and self.chooser is not None and not self.chooser(ticket, up):
            return None
        return up

    def _pump(self) -> list[Ticket]:
        """Admit queued tickets (or start slicing them), head first, while the rule allows.
        Strict order: the head blocks those behind it (every large prefill needs the same
        condition)."""
        admitted = []
        while self._queue:
            head = self._queue[0]
            if self.limits.slice_idle:  # slicing first: a prompt that could run whole is sliced too
                slicer = self._slicer_for(head)
                up = None if slicer is not None else self._eligible(head)
            else:
                up = self._eligible(head)
                slicer = None if up is not None else self._slicer_for(head)
            if up is not None:
                self._dequeue(head)
                self._admit(head, up)
            elif (up := slicer) is not None:
                self._dequeue(head)
                head.phase = Phase.SLICING
                head.upstream = up.name
                up.slicer = head.id
            else:
                break
            admitted.append(head)
        return admitted
