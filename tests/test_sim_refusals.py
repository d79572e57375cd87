"""The simulator refuses what vLLM 0.26.0 refuses, as it does: every answer recorded from a
real vLLM server on the H200 (tests/fixtures/vllm_errors.json, bench/gpu/vllm_errors.py)
replayed against the simulator (status, error type, param, code)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from conftest import serve

from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
from prefill_gate.proxy.sim.server import create_sim_app

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_errors.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}


def test_the_fixture_is_real_vllm():
    assert FIXTURE["server_version"] == "0.26.0" and len(CASES) >= 16


@pytest.mark.parametrize("name", sorted(CASES))
async def test_the_simulator_answers_as_vllm_did(name):
    case = CASES[name]
    body = dict(case["body"])
    if name == "prompt_too_long":
        body["prompt"] = "hello " * 60_000  # (the fixture records it abbreviated)
    body = json.loads(json.dumps(body).replace('"m"', '"sim"')) if body.get("model") == "m" else body
    app = create_sim_app(Engine(EngineConfig(), CostModel(base=0.0001)), model="sim", max_model_len=32768)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post(case["path"], json=body)
    assert r.status_code == case["status"], r.text
    if r.status_code == 200:  # the controls (and a string "stream", which vLLM takes as true)
        return
    want, got = case["answer"]["error"], r.json()["error"]
    assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"])
