"""New requests' setup takes turns with the relay of the streams already under way.

One event loop does both. Each loop iteration polls the sockets, relays every chunk that
arrived (in the upstream connections' read callbacks), then runs the tasks that are ready,
the setups of new requests among them: parsing a body, estimating its prompt, admission,
opening the upstream request (a few hundred microseconds each). When many requests arrive
in one poll, their setups run back to back in that iteration, and every chunk that arrives
meanwhile waits for all of them: the tail of the streams' delay (issue 27's p99.9) is made
of such bursts.

``SetupTurns.wait()`` bounds them. The setups that start in one iteration share a budget
of wall time (``budget_s``, counted from the first); a setup that finds it spent joins a
queue, and the queue is served one setup an iteration, in arrival order, each after the
loop has polled and relayed again. While anyone is queued, new setups queue behind them.
So a burst of N arrivals costs the streams at most the budget plus one setup per
iteration, and the setups themselves O(N) loop iterations, not the O(N^2) of each
deferred setup retrying every iteration. A setup cancelled while queued (its client left)
is skipped; one cancelled after its turn came hands the turn on.
"""

from __future__ import annotations

import asyncio
import collections
import time

SETUP_BUDGET_S = 0.0002  # the wall time setups may take in one loop iteration before the rest queue


class SetupTurns:
    def __init__(self, budget_s: float = SETUP_BUDGET_S, deferrals=None, clock=time.perf_counter) -> None:
        self.budget_s = budget_s
        self.deferrals = deferrals  # a counter (its inc()) of the setups that queued, or None
        self.clock = clock
        self._opened: float | None = None  # when this iteration's first setup started
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self._handed = False  # the turn is with a queued setup that has not run yet

    async def wait(self) -> None:
        """Return once this setup may run (now, or on its turn)."""
        if not self._queue and not self._handed:
            now = self.clock()
            if self._opened is None:  # the iteration's first setup: it goes
                self._open(now)
                return
            if now - self._opened < self.budget_s:
                return
        if self.deferrals is not None:
            self.deferrals.inc()
        turn = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # its turn came, but it will not use it
                self._handed = False
                self._hand_on()
            raise  # (cancelled while queued: its future is done, and skipped)
        self._handed = False
        self._open(self.clock())
        self._hand_on()  # the next queued setup goes in the next iteration

    def _open(self, now: float) -> None:
        self._opened = now
        asyncio.get_running_loop().call_soon(self._close)  # runs first thing next iteration

    def _close(self) -> None:
        self._opened = None
        self._hand_on()

    def _hand_on(self) -> None:
        if self._handed:
            return
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)  # its task runs in the next iteration
                self._handed = True
                return
