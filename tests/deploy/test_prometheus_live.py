"""A real Prometheus scrapes a real proxy (in front of the simulator) and a real paced
vLLM scheduler's exporter under a little load; every query of every provisioned
dashboard panel must return data, and the shipped rules must load and evaluate."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from prefill_gate.proxy.bench.services import Service, free_port
from tests.conftest import stream_events
from tests.deploy.conftest import ROOT, tool

pytestmark = pytest.mark.slow


def dashboards() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("build_dashboards",
                                                  ROOT / "deploy/grafana/build_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: json.loads(module.render(name)) for name in module.DASHBOARDS}


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


async def load(base_url: str) -> None:
    """B streams; A (large) arrives and is held until B ends (or sliced, by a proxy that
    slices); C streams while A prefills."""
    b_decoding = asyncio.Event()
    b = asyncio.create_task(stream_events(base_url, 150, "b" * 40, b_decoding))
    await b_decoding.wait()
    a = asyncio.create_task(stream_events(base_url, 20, "x" * 20_000))
    await b
    await asyncio.sleep(0.05)
    await stream_events(base_url, 60, "c" * 40)
    await a
    await asyncio.gather(*(stream_events(base_url, 20, f"{i}" * 30) for i in range(4)))


def drive_paced_scheduler(tmp_path: Path, port: int) -> None:
    """A real PacedScheduler serving its metrics on `port`, stepped through a long prompt
    next to a stream (engine_patches' own harness plays the model runner)."""
    if os.environ.get("PREFILL_GATE_REQUIRE_ENGINE") != "1":
        pytest.importorskip("vllm")
    from prefill_gate.engine_patches.pacing import PacedScheduler
    from tests.engine.harness import Engine, build, model_dir

    os.environ.update(PREFILL_GATE_PACING="adaptive", PREFILL_GATE_PACING_TARGET_ITL_MS="15",
                      PREFILL_GATE_PACING_METRICS_PORT=str(port),
                      PREFILL_GATE_PACING_LOG_INTERVAL_S="0")
    try:
        engine = Engine(build(PacedScheduler, model_dir(tmp_path)),
                        cost=lambda step, s: 0.005 + 2e-5 * step.prefill_tokens)
        for _ in range(3):
            engine.add(40, 60, "B")
            engine.run(lambda: "B" in engine.first_token)
            engine.add(4000, 4, "A")
            engine.run(lambda: "A" in engine.finished and "B" in engine.finished)
            engine.finished.clear()
            engine.first_token.clear()
            time.sleep(1.2)  # let Prometheus see the counters move
    finally:
        for key in ("PREFILL_GATE_PACING", "PREFILL_GATE_PACING_TARGET_ITL_MS",
                    "PREFILL_GATE_PACING_METRICS_PORT", "PREFILL_GATE_PACING_LOG_INTERVAL_S"):
            os.environ.pop(key, None)


def prometheus_config(path: Path, proxies: list[str], sim: str, pacing: str) -> Path:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(ROOT / "deploy/prometheus/rules.yml")]
    targets = {"prefill-gate": proxies, "vllm": [sim], "vllm-pacing": [pacing]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    out = path / "prometheus.yml"
    out.write_text(yaml.safe_dump(config))
    return out


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def has_data(result: list) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_every_dashboard_panel_has_data(tmp_path):
    prometheus = tool("prometheus")
    pacing_port, prom_port = free_port(), free_port()
    # Two proxies in front of one simulator: the default (it slices the long prompt) and one that
    # holds it (--slicing off: the queue-wait panel's data), scraped as one job.
    with Service("sim", "--time-scale", "3", name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--large-prefill-tokens", "1000",
                    "--health-interval", "0.5", "--log-level", "warning", name="proxy") as proxy, \
            Service("serve", "--upstream", sim.url, "--large-prefill-tokens", "1000", "--slicing", "off",
                    "--health-interval", "0.5", "--log-level", "warning", name="held") as held:
        config = prometheus_config(tmp_path, [proxy.url.split("//")[1], held.url.split("//")[1]],
                                   sim.url.split("//")[1], f"127.0.0.1:{pacing_port}")
        with open(tmp_path / "prometheus.log", "w") as log:
            prom_proc = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_port(prom_port)
            prom = f"http://127.0.0.1:{prom_port}"
            # Rates need a point before the load: wait for a first scrape of the zeros.
            deadline = time.monotonic() + 30
            while len(query(prom, 'up{job=~"prefill-gate|vllm"} == 1')) < 3:
                assert time.monotonic() < deadline, "Prometheus never scraped the proxy and the simulator"
                time.sleep(0.2)
            time.sleep(1.5)
            asyncio.run(load(held.url))
            asyncio.run(load(proxy.url))
            drive_paced_scheduler(tmp_path, pacing_port)
            missing: list[str] = []
            deadline = time.monotonic() + 20
            while True:
                missing = [f"{board['title']} / {panel['title']} / {t['expr']}"
                           for board in dashboards().values() for panel in board["panels"]
                           for t in panel["targets"] if not has_data(query(prom, t["expr"]))]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert not missing, "panels without data:\n" + "\n".join(missing)

            rules = httpx.get(prom + "/api/v1/rules", timeout=10).json()["data"]["groups"]
            loaded = {r["name"] for g in rules for r in g["rules"]}
            assert {"PrefillGateDecodeITLHigh", "PrefillGateUpstreamDown"} <= loaded
            assert all(r.get("health") == "ok" for g in rules for r in g["rules"]), rules
            up = query(prom, 'up{job="prefill-gate"}')
            assert len(up) == 2 and all(u["value"][1] == "1" for u in up)
            modes = {s["metric"]["mode"] for s in query(prom, "prefill_gate_upstream_mode == 1")}
            assert modes == {"sliced", "held"}  # the default slices on a sliceable upstream
        finally:
            prom_proc.terminate()
            prom_proc.wait(timeout=10)
