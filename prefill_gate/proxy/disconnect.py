"""Cancel the work of an ASGI response the moment its client disconnects.

Uvicorn does not cancel a response that is still waiting (in a queue, for an
upstream, between tokens) when its client goes away; it only delivers an
``http.disconnect`` message to ``receive()``. ``DisconnectWatch`` learns of it and
cancels the task running the response, so that every ``async with`` on the way out
closes what it holds. Once the response is ``closing`` (its last byte is on the way)
a disconnect is no longer news. Our own cancellation is absorbed at the block's end
(``gone`` says it happened); any other cancellation propagates.

How it learns: behind the proxy's own listener (``prefill_gate.proxy.listener``, whose protocol
``prefill_gate.proxy.http1`` hands each request's ``send`` a list of callbacks to run when the
connection is lost) by a callback; anywhere else (another server, uvicorn's own protocols,
an in-memory transport) by a task that waits on ``receive()``. The callback spares each
request a task, its wake-ups and its cancellation.
"""

from __future__ import annotations

import asyncio

ON_LOST = "prefill_gate_on_lost"  # the attribute of a send's cycle that lists the callbacks


class DisconnectWatch:
    def __init__(self, receive, send=None) -> None:
        self._receive = receive
        self._send = send
        self.closing = False
        self.gone = False
        self._task: asyncio.Task | None = None
        self._hooks: list | None = None  # the connection's callbacks, with ours among them
        self._watcher: asyncio.Task | None = None

    def _lost(self) -> None:
        if not self.closing and not self.gone:
            self.gone = True
            self._task.cancel()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._lost()

    async def __aenter__(self) -> "DisconnectWatch":
        self._task = asyncio.current_task()
        cycle = getattr(self._send, "__self__", None)
        hooks = getattr(cycle, ON_LOST, None)
        if type(hooks) is list:
            self._hooks = hooks
            hooks.append(self._lost)
            if getattr(cycle, "disconnected", False):  # gone already: the callback ran before we listened
                self._lost()
        else:
            self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if self._hooks is not None:
            self._hooks.remove(self._lost)
            self._hooks = None
        else:
            self._watcher.cancel()
            # The cancelled watcher will hold its CancelledError, whose traceback holds
            # _watch's frame and so this object: without this line, a reference cycle per
            # request that only the cycle collector frees (long full collections with many
            # streams).
            self._watcher = None
        task, self._task = self._task, None
        if exc_type is asyncio.CancelledError and self.gone:
            if hasattr(task, "uncancel"):  # Python 3.11+; on 3.10 a caught cancel is spent
                task.uncancel()
            return True
        return False
