"""The floor of a relay in Python: a TCP pipe on uvloop, for bench/relay_router.py --floor.

    python3 bench/relay_floor.py --upstream http://127.0.0.1:PORT --port P

Each client connection gets its own upstream connection and the bytes are copied in the
read callbacks both ways: no HTTP parsing, no task, no bookkeeping. No proxy written in
Python on uvloop can relay a chunk for less CPU than this; the gap between it and a real
relay is what HTTP, SSE and the gate cost, and vllm-router's CPU beside it says how much a
compiled router spends on the same syscalls. (A measuring instrument, not a proxy: one
connection per client, no limits.) Answers GET /health itself, so that bench's Service can
wait for it.
"""

from __future__ import annotations

import argparse
import asyncio

HEALTH = b"GET /health "
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _Upstream(asyncio.Protocol):
    def __init__(self, client: "_Client") -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def connection_lost(self, exc) -> None:
        self.client.transport.close()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.upstream: _Upstream | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, self.upstream = await asyncio.get_running_loop().create_connection(
                lambda: _Upstream(self), self.host, self.port)
        except OSError:
            self.transport.close()
            return
        for data in self.pending:
            self.upstream.transport.write(data)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if data.startswith(HEALTH):
            self.transport.write(OK)
            self.transport.close()
        elif self.upstream is None:
            self.pending.append(data)
        else:
            self.upstream.transport.write(data)

    def connection_lost(self, exc) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()


async def _serve(upstream: str, port: int) -> None:
    host, up_port = upstream.split("//", 1)[1].rstrip("/").split(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, int(up_port)), "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        raise SystemExit("relay_floor needs uvloop (uvicorn[standard] installs it)") from None
    uvloop.run(_serve(args.upstream, args.port))


if __name__ == "__main__":
    main()
