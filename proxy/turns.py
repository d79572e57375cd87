"""New requests' setup takes turns with the relay of the streams already under way.

One event loop does both. Each loop iteration polls the sockets, relays every chunk that
arrived (in the upstream connections' read callbacks), then runs the tasks that are ready,
the setups of new requests among them: parsing a body, estimating its prompt, admission,
opening the upstream request (a few hundred microseconds each). When many requests arrive
in one poll, their setups run back to back in that iteration, and every chunk that arrives
meanwhile waits for all of them: the tail of the streams' delay (issue 27's p99.9) is made
of such bursts.

``SetupTurns.wait()`` bounds them: the setups of one iteration share a budget of wall time
(``budget_s``, from the first setup to start); a setup that finds it spent waits for the
next iteration, after the loop has polled and relayed again. The first setup of an
iteration always goes, so none waits on the others for more than the iterations the ones
ahead of it need (FIFO: a deferred task runs again in the order it yielded). Cost: about a
microsecond where the budget is not spent; a loop iteration per deferral where it is.
"""

from __future__ import annotations

import asyncio
import time

SETUP_BUDGET_S = 0.0002  # the wall time setups may take in one loop iteration before the rest wait


class SetupTurns:
    def __init__(self, budget_s: float = SETUP_BUDGET_S, deferrals=None, clock=time.perf_counter) -> None:
        self.budget_s = budget_s
        self.deferrals = deferrals  # a counter (its inc()) of the waits for a later iteration, or None
        self.clock = clock
        self._opened: float | None = None  # when this iteration's first setup started

    async def wait(self) -> None:
        """Return once this setup may run in the current loop iteration."""
        while True:
            now = self.clock()
            if self._opened is None:  # the iteration's first setup: it goes, and opens the window
                self._opened = now
                asyncio.get_running_loop().call_soon(self._close)
                return
            if now - self._opened < self.budget_s:
                return
            if self.deferrals is not None:
                self.deferrals.inc()
            await asyncio.sleep(0)  # resumes next iteration, behind _close (queued earlier)

    def _close(self) -> None:
        self._opened = None
