"""The overhead benchmark's stamping upstream (`prefill-gate bench-upstream --procs N`)."""

from __future__ import annotations

import os
import socket
import time

import httpx

from conftest import alive, children_of
from prefill_gate.proxy.bench.services import Service


def test_forked_servers_die_with_a_killed_parent():
    """A SIGKILLed parent runs no cleanup: its forked servers must still go, and free the port."""
    up = Service("bench-upstream", "--procs", "3", name="stamp")
    kids = children_of(up.proc.pid)
    try:
        assert len(kids) == 2
        for _ in range(6):  # every process answers on the shared socket
            assert httpx.get(up.url + "/health", timeout=2.0).status_code == 200
        up.kill()
        deadline = time.monotonic() + 5
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(k) for k in kids)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", up.port)) != 0  # nobody listens any more
    finally:
        for k in kids:  # a failed run must not leave them serving
            if alive(k):
                os.kill(k, 9)
        up.stop()
