"""What the proxy learns per upstream to choose between holding and slicing a long prompt.

Pure state with an injected clock, fed by the exchanges (stream starts and ends, the
gaps of protected streams, slices and whole prefills as they finish) and read by the
admission policy's chooser in ``slicing: auto``:

    hold:   wait until no protected stream is live, then prefill the prompt alone. The
            wait is the longer of: the live streams' end (each one's remaining tokens x
            the decode gap; remaining from its max_tokens and, once enough answers have
            ended, the distribution of this model's streamed lengths), and the expected
            busy period of the streams still to come: with streams starting at rate L
            and lasting D on average, an upstream seen as an M/G/inf queue is busy for
            (exp(L D) - 1) / L at a stretch. Under steady load (L D of a few) that is
            far beyond the wait bound: holding would wait for the bound, not a quiet moment.
    slice:  the prompt's tokens at the rate slicing has reached on this upstream.

Slice when slicing is predicted to finish first and it keeps the gap promise
(``max_gap_ms``): slices at their smallest size that still saw protected gaps over the
promise (``PROMISE_BROKEN`` of the last ``PROMISE_WINDOWS``) disqualify slicing there for
``PROMISE_COOLDOWN_S``, unless holding cannot keep it either: a hold predicted to last past
the wait bound ends with the prompt prefilled whole beside the streams, every chunk step
back to back, where the smallest slices stall them one step at a time with decodes between
(on the H200's align-mode hybrid, one 1,568-token block either way: worst gaps 173 ms sliced,
262-302 ms whole; the old docs/RESULTS.md (in git history) section 14b). With
``slice_when_idle``, slice also when nothing protected is live (holding would admit the
prompt at once, whole, and stall the first tokens of requests arriving meanwhile).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .slicer import SliceSizer

# Priors, from the H200 measurements (the old docs/RESULTS.md, in git history): a decode gap, what slicing and a
# whole prefill reach in prompt tokens per second; measured values replace them.
PRIOR_GAP_S = 0.01
PRIOR_SLICE_TOKENS_PER_S = 12_000.0
PRIOR_PREFILL_TOKENS_PER_S = 25_000.0
EWMA = 0.2
GAP_EWMA = EWMA * 0.1  # the decode gap's average moves slower: a sample per chunk
LENGTHS_KEPT = 512  # streamed lengths remembered per model
MIN_LENGTHS = 20  # before this many, a stream's remaining length comes from max_tokens alone
# ... and from them only where at least this many of them went on longer than this stream has
# already streamed: answers that all ended sooner (warm-ups, other clients' short answers)
# say nothing about how long this one goes on.
MIN_LONGER = 5
UNKNOWN_REMAINING = 256  # no max_tokens, no history: assume this many tokens remain
MAX_LOAD = 50.0  # L x D beyond this: exp() would only say "forever" at more cost
PROMISE_COOLDOWN_S = 30.0
# ... once this many of the last PROMISE_WINDOWS smallest slices went over it: one gap over
# (an interactive prompt in the slice's step, a hiccup) says nothing about the slices.
PROMISE_BROKEN = 3
PROMISE_WINDOWS = 8


@dataclass(frozen=True)
class Choice:
    slice: bool
    hold_s: float  # predicted wait before holding would admit it (inf: not before the bound)
    finish_hold_s: float
    finish_slice_s: float
    reason: str


@dataclass
class _Stream:
    max_tokens: int | None
    model: str
    progress: Callable[[], int]
    started: float


class GapWindow:
    """The largest protected gap on an upstream while one slice ran (None: none yet)."""

    __slots__ = ("largest",)

    def __init__(self) -> None:
        self.largest: float | None = None


# Open gap windows kept per upstream at most (a slicer cancelled mid-slice leaves its own).
MAX_WINDOWS = 8


@dataclass
class _Upstream:
    gap_s: float = PRIOR_GAP_S
    slice_rate: float = PRIOR_SLICE_TOKENS_PER_S
    prefill_rate: float = PRIOR_PREFILL_TOKENS_PER_S
    start_interval_s: float = math.inf
    last_start: float | None = None
    duration_s: float = 0.0  # how long a protected stream lasts, on average (0: none ended yet)
    streams: dict[int, _Stream] = field(default_factory=dict)
    gaps: int = 0  # protected gaps seen so far (a slicer waits for the one its slice caused)
    windows: list[GapWindow] = field(default_factory=list)  # open: one per slice in flight
    broken_until: float = -math.inf
    smallest_over: deque[bool] = field(default_factory=lambda: deque(maxlen=PROMISE_WINDOWS))
    sizer: SliceSizer | None = None


class Predictor:
    def __init__(self, upstreams, *, slice_gap_s: float, max_gap_s: float, min_slice_tokens: int,
                 max_slice_tokens: int, slice_idle: bool = False, wait_bound_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.wait_bound_s = wait_bound_s  # a held prompt is admitted whole after this long
        self.slice_idle = slice_idle  # slice also when nothing protected is live
        self.max_gap_s = max_gap_s
        self._ups = {u: _Upstream(sizer=SliceSizer(slice_gap_s, min_slice_tokens, max_slice_tokens,
                                                   tokens=max(min_slice_tokens, min(512, max_slice_tokens)),
                                                   hold_unwatched=slice_idle, max_gap_s=max_gap_s))
                     for u in upstreams}
        self._lengths: dict[str, deque[int]] = {}
        self._sorted: dict[str, list[int]] = {}

    def sizer(self, upstream: str) -> SliceSizer:
        return self._ups[upstream].sizer

    # ------------------------------------------------------------------ streams
    def stream_started(self, upstream: str, key: int, max_tokens: int | None, model: str,
                       progress: Callable[[], int]) -> None:
        up = self._ups[upstream]
        now = self.clock()
        if up.last_start is not None:
            dt = now - up.last_start
            up.start_interval_s = dt if math.isinf(up.start_interval_s) else (
                up.start_interval_s + EWMA * (dt - up.start_interval_s))
        up.last_start = now
        up.streams[key] = _Stream(max_tokens, model, progress, now)

    def stream_ended(self, upstream: str, key: int, streamed: int, finished: bool) -> None:
        """``finished``: the answer ended by itself (its length says something about the
        model's answers), not by an error or a client that left."""
        up = self._ups[upstream]
        stream = up.streams.pop(key, None)
        if stream is None or not finished or streamed <= 0:
            return
        took = self.clock() - stream.started
        up.duration_s = took if up.duration_s == 0 else up.duration_s + EWMA * (took - up.duration_s)
        kept = self._lengths.setdefault(stream.model, deque(maxlen=LENGTHS_KEPT))
        kept.append(streamed)
        self._sorted.pop(stream.model, None)

    def gap(self, upstream: str, seconds: float, n: int = 1) -> None:
        """Gaps between chunks of a protected stream: ``seconds``, then ``n - 1`` of 0 (one
        read's chunks; the per-read path: O(1))."""
        up = self._ups[upstream]
        up.gaps += n
        up.gap_s += GAP_EWMA * (seconds - up.gap_s)
        if n > 1:
            up.gap_s *= (1 - GAP_EWMA) ** (n - 1)
        for w in up.windows:  # none unless a slice runs
            if w.largest is None or seconds > w.largest:
                w.largest = seconds

    def live(self, upstream: str) -> int:
        return len(self._ups[upstream].streams)

    def gaps_seen(self, upstream: str) -> int:
        return self._ups[upstream].gaps

    # ------------------------------------------------------------------ slicing
    def window_start(self, upstream: str) -> GapWindow:
        """Open a gap window for a slice about to be sent (``window_max`` closes it)."""
        up = self._ups[upstream]
        w = GapWindow()
        up.windows.append(w)
        del up.windows[:-MAX_WINDOWS]
        return w

    def window_max(self, upstream: str, window: GapWindow) -> float | None:
        """Close ``window``: the largest protected gap since it opened (None: no stream
        chunk came)."""
        up = self._ups[upstream]
        with contextlib.suppress(ValueError):
            up.windows.remove(window)
        sizer = up.sizer
        if window.largest is not None and sizer.tokens <= sizer.min_tokens:
            up.smallest_over.append(window.largest > self.max_gap_s)
            if sum(up.smallest_over) >= PROMISE_BROKEN:  # even the smallest slices stall
                up.broken_until = self.clock() + PROMISE_COOLDOWN_S
                up.smallest_over.clear()
        return window.largest

    def slice_done(self, upstream: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            up = self._ups[upstream]
            up.slice_rate += EWMA * (tokens / seconds - up.slice_rate)

    def prefill_done(self, upstream: str, tokens: int, seconds: float) -> None:
        """A large prefill that ran whole with no protected stream live: the alone rate."""
        if tokens > 0 and seconds > 0:
            up = self._ups[upstream]
            up.prefill_rate += EWMA * (tokens / seconds - up.prefill_rate)

    # ------------------------------------------------------------------- choice
    def remaining_tokens(self, stream: _Stream) -> float:
        done = stream.progress()
        cap = None if stream.max_tokens is None else max(0, stream.max_tokens - done)
        lengths = self._lengths.get(stream.model)
        if lengths is not None and len(lengths) >= MIN_LENGTHS:
            ranked = self._sorted.get(stream.model)
            if ranked is None:
                ranked = self._sorted[stream.model] = sorted(lengths)
            longer = ranked[bisect.bisect_right(ranked, done):]
            if len(longer) >= MIN_LONGER:  # the median of what answers longer than this one went on for
                guess = longer[len(longer) // 2] - done
                return guess if cap is None else min(cap, guess)
        return cap if cap is not None else max(UNKNOWN_REMAINING, done)

    def choose(self, upstream: str, tokens: int) -> Choice:
        up = self._ups[upstream]
        now = self.clock()
        alone_s = tokens / up.prefill_rate
        slice_s = tokens / up.slice_rate
        if not up.streams:
            if self.slice_idle and now >= up.broken_until:
                return Choice(True, 0.0, alone_s, slice_s, "no protected stream live: slicing keeps arrivals fast")
            return Choice(False, 0.0, alone_s, slice_s, "no protected stream live")
        live_end_s = max(self.remaining_tokens(s) for s in up.streams.values()) * up.gap_s
        hold_s = max(live_end_s, self.busy_period_s(upstream))
        finish_hold = hold_s + alone_s
        past_bound = hold_s >= self.wait_bound_s  # holding would end with the prompt whole
        if now < up.broken_until:
            if not past_bound:
                return Choice(False, hold_s, finish_hold, slice_s, "slicing broke the gap promise here recently")
            return Choice(True, hold_s, finish_hold, slice_s, "slicing broke the gap promise here recently, but "
                          "holding would too: past the wait bound the prompt goes whole")
        if slice_s < finish_hold:
            busy = "busy past the wait bound" if past_bound else f"busy ~{hold_s:.1f} s at a stretch"
            why = "slicing finishes first" if hold_s == live_end_s else \
                f"streams keep coming ({busy}): slicing finishes first"
            return Choice(True, hold_s, finish_hold, slice_s, why)
        return Choice(False, hold_s, finish_hold, slice_s, "the live streams end first")

    def busy_period_s(self, upstream: str) -> float:
        """The expected stretch with at least one protected stream live, from the recent
        start rate and stream duration (an M/G/inf queue's busy period)."""
        up = self._ups[upstream]
        if math.isinf(up.start_interval_s) or up.duration_s <= 0 or up.last_start is None:
            return 0.0
        interval = max(up.start_interval_s, self.clock() - up.last_start, 1e-3)
        load = min(MAX_LOAD, up.duration_s / interval)
        return (math.exp(load) - 1) * interval
