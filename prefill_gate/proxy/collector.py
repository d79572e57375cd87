"""The cycle collector's full collections, moved to where no stream feels them.

CPython starts a full collection by itself once enough objects have survived the two
younger generations. With hundreds of live streams that happens every few seconds, and each
one stops the event loop for as long as scanning every object the requests hold takes:
tens of milliseconds at 512 streams, every stream's chunk held that long (the old docs/RESULTS.md in git history,
section 3d). The proxy makes almost no cyclic garbage (a request leaves no reference cycle
however it ends, nor does an upstream connection: tests/test_relay.py, tests/test_fasthttp.py),
so full collections have almost nothing to free. ``defer_full_collections`` turns the
automatic ones off, and ``FullCollections`` runs one when the proxy is idle (at most every
``IDLE_GAP_S``), or, under load that never pauses, ``FULL_EVERY_S`` apart, so that a cycle
that does form (a library's, a path no test covers) is still reclaimed.

The younger collections stay automatic, in small steps: CPython collects the middle
generation after ten young collections, scanning everything that survived them (new
requests' objects in a burst of arrivals): 3.2-4.2 ms each on average on the 2-core VM at
512 streams, in the streams' delay p99.9. With its threshold at 0 it is collected with every
other young collection (at most two young generations' worth), and what survives that goes
to the oldest generation, where the deferred full collections find it: the same 512 streams
saw 44-45 middle collections a turn, 41-45 of them under 1 ms, and less time in the
collector in all; on the H200 host the streams' delay p99.9 went from 1.2-3.2 to 0.8-1.6 ms
(the old docs/RESULTS.md (in git history) 3h).

The young generation, in smaller steps too: a young collection scans what was allocated and
still lives since the last one, so its pause grows with the threshold, and every chunk that
arrives during it waits that long. The objects scanned over time do not change with it (each
is scanned once young, once in the middle), only how the work is cut: with ``YOUNG_THRESHOLD``
100 instead of CPython's 700, seven times the collections at a fifth to a quarter of the pause
each (on the H200 host at 512 streams: young 27-39 us on average against 113-175, middle 44-63
against 206-344); each collection's fixed cost adds ~10 ms a turn there (24-34 ms in the
collector against 14-24), and CPU per chunk was 0.2-4.3% higher (medians of three runs;
the old docs/RESULTS.md (in git history) 3i).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from typing import Callable

FULL_EVERY_S = 300.0  # the longest a proxy that is never idle goes between full collections
IDLE_GAP_S = 10.0  # the shortest gap between two (idle moments come and go under bursty load)
CHECK_EVERY_S = 1.0
_NEVER = 1 << 30  # a third threshold no count reaches
MIDDLE_THRESHOLD = 0  # the middle generation collected with every other young collection
YOUNG_THRESHOLD = 100  # new objects (allocations less deallocations) that start a young collection


def defer_full_collections() -> Callable[[], None]:
    """Stop the interpreter from starting full collections on its own, and collect the
    young and middle generations in small steps (``YOUNG_THRESHOLD``, ``MIDDLE_THRESHOLD``).
    Returns what puts its thresholds back. Only on CPython before 3.14, whose three
    generations this knows; elsewhere (3.14's incremental collector reads the thresholds
    otherwise) nothing changes."""
    if sys.implementation.name != "cpython" or sys.version_info >= (3, 14):
        return lambda: None
    saved = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, _NEVER)
    return lambda: gc.set_threshold(*saved)


def _promoted() -> bool:
    """Objects reached the oldest generation since its last collection (CPython counts the
    middle generation's collections since then)."""
    return gc.get_count()[2] > 0


class FullCollections:
    """Runs a full collection when objects were promoted since the last one and either
    ``busy()`` is False (no request in progress) and ``gap`` seconds have passed, or
    ``every`` seconds have passed regardless."""

    def __init__(self, busy: Callable[[], bool], every: float = FULL_EVERY_S, gap: float = IDLE_GAP_S,
                 clock: Callable[[], float] = time.monotonic, collect: Callable[[], object] = gc.collect,
                 promoted: Callable[[], bool] = _promoted) -> None:
        self.busy, self.every, self.gap = busy, every, gap
        self.clock, self.collect, self.promoted = clock, collect, promoted
        self.last = clock()

    def tick(self) -> bool:
        """Collect now if it is time. True: it collected."""
        if not gc.isenabled() or not self.promoted():
            return False
        since = self.clock() - self.last
        if since < self.gap or (since < self.every and self.busy()):
            return False
        self.collect()
        self.last = self.clock()
        return True

    async def run(self, check_every: float = CHECK_EVERY_S) -> None:
        while True:
            await asyncio.sleep(check_every)
            self.tick()


def manage(busy: Callable[[], bool]) -> Callable[[], None]:
    """For a serving process, from its loop once it has started: what exists now lives as
    long as the process, so it goes out of the collector's sight (``gc.freeze``: a full
    collection then scans only what requests made); full collections are deferred and run
    by ``FullCollections(busy)``. Returns what undoes it."""
    gc.collect()
    gc.freeze()
    restore = defer_full_collections()
    task = asyncio.get_running_loop().create_task(FullCollections(busy).run())

    def stop() -> None:
        task.cancel()
        restore()

    return stop
