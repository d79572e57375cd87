"""The load generator's own collections during a measured phase.

A collection of Python's cycle collector in the client holds the client's event loop, so
every stream's next chunk is read late by as long as it ran: the client records a gap in
every stream at once, the shape of an engine stall. A phase runs inside ``ClientCollections``:
what exists before it is frozen out of the collector's sight (a collection then scans only
what the phase makes), and the phase's collections are counted, with each one of at least
``LONG_S`` and when it ended on the phase's clock, to set beside its ``worst_gaps``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

LONG_S = 0.005
KEPT = 50  # long collections listed per phase (all are counted)


class ClientCollections:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0 = 0.0
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self.long: list[list[float]] = []  # [ended at s, ms, generation]
        self._started = 0.0
        self._froze = False

    def __enter__(self) -> "ClientCollections":
        # A process that froze its heap already (a proxy run in it) keeps its own arrangement:
        # unfreezing at the end would give the collector that heap back.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.collect()
            gc.freeze()
        gc.callbacks.append(self._on_collection)
        self.t0 = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collection)
        if self._froze:
            gc.unfreeze()

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        now = self.clock()
        took = now - self._started
        self.count += 1
        self.total_s += took
        self.longest_s = max(self.longest_s, took)
        if took >= LONG_S and len(self.long) < KEPT:
            self.long.append([round(now - self.t0, 4), round(took * 1e3, 2), info.get("generation", -1)])

    def summary(self, t0: float, scale: float = 1.0) -> dict:
        """The phase's figures; ``t0``: the phase's zero on ``clock`` (its records' times)."""
        shift = self.t0 - t0
        return {"collections": self.count, "seconds": round(self.total_s, 4),
                "max_ms": round(self.longest_s * 1e3, 2),
                "long": [[round((end + shift) / scale, 4), ms / scale, g] for end, ms, g in self.long]}
