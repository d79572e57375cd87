"""Cancel the work of an ASGI response the moment its client disconnects.

Uvicorn does not cancel a response that is still waiting (in a queue, for an
upstream, between tokens) when its client goes away; it only delivers an
``http.disconnect`` message to ``receive()``. ``DisconnectWatch`` listens for it and
cancels the task running the response, so that every ``async with`` on the way out
closes what it holds. Once the response is ``closing`` (its last byte is on the way)
a disconnect is no longer news. Our own cancellation is absorbed at the block's end
(``gone`` says it happened); any other cancellation propagates.
"""

from __future__ import annotations

import asyncio


class DisconnectWatch:
    def __init__(self, receive) -> None:
        self._receive = receive
        self.closing = False
        self.gone = False

    async def _watch(self, task: asyncio.Task) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.closing:
            self.gone = True
            task.cancel()

    async def __aenter__(self) -> "DisconnectWatch":
        self._watcher = asyncio.create_task(self._watch(asyncio.current_task()))
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self._watcher.cancel()
        # The cancelled watcher will hold its CancelledError, whose traceback holds _watch's
        # frame and so this object: without this line, a reference cycle per request that
        # only the cycle collector frees (long full collections with many streams).
        self._watcher = None
        if exc_type is asyncio.CancelledError and self.gone:
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python 3.11+; on 3.10 a caught cancel is spent
                task.uncancel()
            return True
        return False
