"""API keys (hashed, constant-time, never forwarded) and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prefill_gate.proxy.auth import KeyCheck, KeysFileError, hash_key
from prefill_gate.proxy.bench.services import Service
from tests.conftest import CHAT, FakeVLLM, proxy_client, sample, stream_events


def keys_file(tmp_path, *keys, extra=""):
    path = tmp_path / "keys"
    path.write_text("# clients\n" + "".join(hash_key(k) + "\n" for k in keys) + extra)
    return str(path)


async def test_keys_gate_every_path_but_health_and_ready(tmp_path):
    """The code, README and docs/RELIABILITY.md agree: /health and /ready are open (probes),
    everything else, /metrics included, needs a key."""
    fake = FakeVLLM()
    async with proxy_client(fake, api_keys_file=keys_file(tmp_path, "k-alice", "k-bob")) as (c, state):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k-alice"},
                        {"authorization": "k-alice"}):
            r = await c.post(CHAT, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 401
        assert not fake.requests  # nothing unauthenticated reached the upstream
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).status_code in (200, 503)  # open, as /health (probes carry no key)
        assert (await c.get("/metrics")).status_code == 401  # its counters are an oracle for others' prompts
        assert (await c.get("/metrics", headers={"authorization": "Bearer k-bob"})).status_code == 200
        for key in ("k-alice", "k-bob"):
            r = await c.post(CHAT, json=body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        assert all("authorization" not in req.headers for req in fake.requests)  # never forwarded
        assert sample(state.metrics.registry, "prefill_gate_unauthorized_total") == 7


def test_keys_file_errors_name_the_line(tmp_path):
    with pytest.raises(KeysFileError, match=r"keys:3: expected sha256"):
        KeyCheck.from_file(keys_file(tmp_path, "a", extra="plain-text-key\n"))
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n")
    with pytest.raises(KeysFileError, match="holds no key hashes"):
        KeyCheck.from_file(str(empty))
    with pytest.raises(KeysFileError, match="No such file"):
        KeyCheck.from_file(str(tmp_path / "missing"))
    assert KeyCheck.from_file(keys_file(tmp_path, "a")).allows("bearer a")  # scheme is case-insensitive


def test_hash_key_command_and_bad_file_at_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "prefill_gate.proxy", "hash-key"], input="s3cret\n", capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == hash_key("s3cret")
    bad = tmp_path / "bad"
    bad.write_text("s3cret\n")
    r = subprocess.run([sys.executable, "-m", "prefill_gate.proxy", "serve", "--upstream", "http://127.0.0.1:9",
                        "--api-keys-file", str(bad)], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2 and "bad:1: expected sha256" in r.stderr


@pytest.mark.slow
async def test_sigterm_lets_short_streams_finish_and_ends_long_ones(tmp_path):
    with Service("sim", "--time-scale", "2", name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--shutdown-grace", "2.0", "--log-level", "warning",
                    name="proxy") as proxy:
        long = asyncio.create_task(stream_events(proxy.url, 5000))  # ~50 s of tokens
        streaming = asyncio.Event()
        short = asyncio.create_task(stream_events(proxy.url, 60, started=streaming))  # ~0.6 s of tokens
        await asyncio.wait_for(streaming.wait(), 10)
        assert not short.done()  # certainly live at SIGTERM, with most of its tokens to come
        sent = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        short_events = await short
        long_events = await long
        ended = time.monotonic()
        assert short_events[-1] == b"data: [DONE]" and len(short_events) == 60 + 1
        assert not any(b"error" in e for e in short_events)
        assert long_events[-1] == b"data: [DONE]"
        error = json.loads(long_events[-2][5:])["error"]
        assert error["code"] == "proxy_shutting_down"
        assert 1.9 <= ended - sent <= 5.0  # the grace, then the end: not uvicorn's cut
        # uvicorn re-raises the captured signal once it has shut down: the default exit for SIGTERM.
        assert proxy.proc.wait(timeout=10) in (0, -signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient() as c:
            m = (await c.get(sim.url + "/metrics")).text
        running = [ln for ln in m.splitlines() if ln.startswith("vllm:num_requests_running")]
        assert running and float(running[0].split()[-1]) == 0  # the upstream request was closed


def test_metrics_on_their_own_port():
    from prefill_gate.proxy.bench.services import free_port

    port = free_port()
    with Service("serve", "--upstream", "http://127.0.0.1:9", "--metrics-port", str(port),
                 "--log-level", "warning", name="proxy") as proxy:
        assert httpx.get(proxy.url + "/metrics").status_code == 404  # not on the API port
        r = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert r.status_code == 200 and "prefill_gate_requests_total" in r.text
        assert "_created" not in r.text  # (disabled: half the page was creation timestamps)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 404  # and only metrics there
