"""Start the simulator and the proxy as real processes, for the demo, benches and tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """``python -m prefill_gate.proxy ARGS --port P`` in its own process (or ``argv``, another program
    listening on ``port``); ``url`` once /health answers. ``cwd``: run the ``proxy`` of
    another checkout (``python -m`` imports from the working directory first)."""

    def __init__(self, *args: str, name: str = "service", timeout: float = 30.0, env: dict | None = None,
                 cpus: set[int] | None = None, port: int | None = None, argv: list[str] | None = None,
                 cwd: str | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"prefill-gate-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "prefill_gate.proxy", *args, "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd,
        )
        if cpus:
            os.sched_setaffinity(self.proc.pid, cpus)
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.output()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:g} s: {self.output()[-2000:]}")

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL: the abrupt death of an upstream, for fault tests."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
