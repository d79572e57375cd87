"""Stalls no scheduling decision explains: long collections of Python's cycle collector.

vLLM freezes its startup heap (``gc.freeze()`` in the engine core) so that full collections
stay short, but objects made while serving still age into the oldest generation, and a full
collection in the engine core holds the step loop while it runs, so every stream waits
for it at once. On an H100 host the paced stack's worst gaps had the shape one would leave
(5-9 streams stalled 32-40 ms together where pacing's steps were predicted at ~12 ms; not
diagnosed, bench/results/defaults/h100/run-b953a47/). This says, in each vLLM process the
plugin loads in, when a collection took longer than ``PREFILL_GATE_GC_LOG_MS`` ms, so such a
moment can be named or ruled out. The watch costs two clock reads per collection. Unset, it
is 20 where pacing is on (``PREFILL_GATE_PACING`` other than off: a vLLM run as the stack)
and off elsewhere: other vLLMs in the same environment log nothing new.

The line carries the wall-clock time to the millisecond (vLLM's log format keeps seconds)
so that it can be set beside a client's record of its gaps (``bench mixed``: ``t0_unix``
plus ``worst_gaps``' times).
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping

ENV = "PREFILL_GATE_GC_LOG_MS"
DEFAULT_MS = 20.0


class StallWatchError(ValueError):
    pass


def threshold_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The collection time, in seconds, from which a collection is logged; 0 when off."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "").strip()
    if not raw:
        paced = (env.get("PREFILL_GATE_PACING") or "off").strip().lower() != "off"
        return DEFAULT_MS / 1e3 if paced else 0.0
    try:
        ms = float(raw)
    except ValueError:
        raise StallWatchError(f"{ENV}={raw!r}: expected milliseconds (0: off)") from None
    if not math.isfinite(ms) or ms < 0:
        raise StallWatchError(f"{ENV}={raw!r}: expected milliseconds >= 0 (0: off)")
    return ms / 1e3


class GcWatch:
    """A ``gc.callbacks`` entry: times each collection, logs those of at least ``threshold_s``."""

    def __init__(self, threshold_s: float, log: logging.Logger, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self.threshold_s, self.log, self.clock, self.wall = threshold_s, log, clock, wall
        self.started = 0.0
        self.long = 0  # collections logged so far in this process
        self.longest_s = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = self.clock()
            return
        took = self.clock() - self.started
        if took < self.threshold_s:
            return
        self.long += 1
        self.longest_s = max(self.longest_s, took)
        self.log.warning(
            "prefill-gate: Python's cycle collector held %s (pid %d) %.1f ms, generation %d, %s objects "
            "collected, ending at %.3f (unix s); %d such collection(s) in this process, the longest %.1f ms",
            multiprocessing.current_process().name, os.getpid(), took * 1e3, info.get("generation", -1),
            info.get("collected", "?"), self.wall(), self.long, self.longest_s * 1e3)


_installed: GcWatch | None = None


def install(threshold_s: float, log: logging.Logger) -> GcWatch | None:
    """Watch this process's collections (once: ``register()`` runs more than once in a
    process); a later call only moves the threshold. None when ``threshold_s`` is 0."""
    global _installed
    if _installed is not None:
        _installed.threshold_s = threshold_s if threshold_s > 0 else math.inf
        return _installed if threshold_s > 0 else None
    if threshold_s <= 0:
        return None
    _installed = GcWatch(threshold_s, log)
    gc.callbacks.append(_installed)
    atexit.register(uninstall)  # before logging's own exit hook closes the handlers (atexit: last in, first out)
    return _installed


def uninstall() -> None:
    global _installed
    if _installed is not None:
        gc.callbacks.remove(_installed)
        _installed = None
        atexit.unregister(uninstall)
