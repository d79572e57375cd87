"""The relay's per-read callback: compiled where it was built, else Python (issue 27).

While a streamed answer is under way, ``GatedExchange._pump`` hands every read of the
upstream to one callback on the upstream connection (``fasthttp.body_sink``): the read is
observed and written to the client's socket there, without waking the request's task. In
Python that callback is ``ChunkWriter.write_through`` over ``StreamObserver.take``: the
client side's readiness, the test for a read of plain content chunks (``relay.plain_events``),
the chunk's framing and the write. ``prefill_gate/proxy/_relaycore.c`` runs the same in one compiled call
(``StreamObserver.counted``'s few steps included; the splitter and ``filter`` for a read
that is not plain content stay Python), and, on the upstream connections the app then opens
(``fasthttp.FramedConnection``), takes a read that is whole chunks of the chunked body
without the HTTP parser. The read's token gaps go to the exchange's hook, which with the
compiled core is compiled too (``_relaycore.GapTally`` over the histogram children of
``prefill_gate.proxy.metrics``, ``_relaycore.Histogram``; ``gap_tally_type``): a read of plain content
takes no Python frame of its own then. What that saves a read and a chunk is measured in
``docs/results/proxy-cost.md`` (history: the old RESULTS 3l and 3m) (``bench/relay_read.py``, ``bench/relay_router.py
--python-core``). The two behave alike to the byte (``tests/test_relaycore.py``,
``tests/test_fasthttp.py``).

Which one runs is the ``relay_core`` setting: ``auto`` (the compiled one where the install
built it: ``pip install`` compiles it with a C compiler at hand, and goes on without one),
``compiled`` (refuse to start without it), ``python``.
"""

from __future__ import annotations

import functools
from typing import Callable

from .listener import ChunkWriter
from .relay import StreamObserver

ReadCallback = Callable[[bytes], bool]  # one read -> taken (True) or left for the relay's task
RelayFactory = Callable[[ChunkWriter, StreamObserver], ReadCallback]


class CoreMissing(RuntimeError):
    """``relay_core: compiled`` and the compiled core did not import."""


def python_relay(writer: ChunkWriter, observer: StreamObserver) -> ReadCallback:
    """The Python callback: one read, observed, written to the client's socket; False (left
    queued for the relay's task) while the writer is not ready."""
    return functools.partial(writer.write_through, observer.take)


def compiled_module():
    """``prefill_gate.proxy._relaycore``, or the ImportError that says why it is not there."""
    try:
        from . import _relaycore
    except ImportError as exc:
        return exc
    return _relaycore


def relay_factory(choice: str) -> tuple[RelayFactory, str]:
    """The read callbacks' factory for the ``relay_core`` setting, and which core it is
    ("compiled" or "python")."""
    if choice == "python":
        return python_relay, "python"
    core = compiled_module()
    if isinstance(core, ImportError):
        if choice == "compiled":
            raise CoreMissing(f"relay_core is 'compiled' but the compiled relay core did not import ({core}); "
                              "reinstall with a C compiler at hand (pip install .), or set relay_core to "
                              "auto or python")
        return python_relay, "python"
    direct = core.DirectRelay

    def compiled_relay(writer: ChunkWriter, observer: StreamObserver) -> ReadCallback:
        return direct(writer.cycle, observer)

    return compiled_relay, "compiled"


def gap_tally_type(core: str, child_type: type) -> type | None:
    """The compiled per-read token hook (``_relaycore.GapTally``, ``GatedExchange._tokens``
    step for step, which the compiled relay calls without a Python frame) where ``core`` is
    "compiled" and the histograms' children (``child_type``) are the compiled ones; else None."""
    if core != "compiled":
        return None
    module = compiled_module()
    if isinstance(module, ImportError) or child_type is not module.Histogram:
        return None
    return module.GapTally
