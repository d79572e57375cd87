"""The deployment files, checked by the tools that consume them."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from tests.deploy.conftest import ROOT, compose_binary, engine_settings, tool

DOCKERFILES = ["deploy/proxy.Dockerfile", "deploy/vllm.Dockerfile", "deploy/vllm-sm70.Dockerfile"]


def compose(*args: str, profiles: str | None = None, password: str | None = "pw") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "GRAFANA_"))}
    if profiles is not None:
        env["COMPOSE_PROFILES"] = profiles
    if password is not None:
        env["GRAFANA_ADMIN_PASSWORD"] = password
    return subprocess.run([compose_binary(), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("profiles, services", [
    (None, {"vllm", "proxy", "prometheus", "grafana"}),  # .env's default
    ("", {"proxy", "prometheus", "grafana"}),  # proxy only, in front of UPSTREAMS
    ("vllm,replicas", {"vllm", "vllm-2", "proxy", "prometheus", "grafana"}),
    ("sm70", {"vllm-sm70", "proxy", "prometheus", "grafana"}),
])
def test_compose_config_accepts_every_profile(profiles, services):
    result = compose("config", "--services", profiles=profiles)
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == services


def test_compose_resolves_settings_from_env_file():
    result = compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    proxy = config["services"]["proxy"]
    assert proxy["environment"]["PREFILL_GATE_UPSTREAMS"] == "http://vllm:8000"
    assert proxy["depends_on"]["vllm"]["condition"] == "service_healthy"
    vllm = config["services"]["vllm"]
    assert "Qwen/Qwen3-8B" in " ".join(vllm["command"])
    command = vllm["command"]
    assert command[command.index("--scheduler-cls") + 1] == "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"
    assert json.loads(command[command.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL"}
    assert vllm["environment"]["PREFILL_GATE_PACING"] == "adaptive"  # the stack's default: step pacing
    assert engine_settings(vllm["environment"])["gdn_graph"]  # a hybrid's mixed steps in whole graphs, accepted
    assert proxy["environment"]["PREFILL_GATE_SLICING"] == "auto"
    for name, service in config["services"].items():
        image = service["image"]
        assert not image.endswith(":latest") and ":" in image, f"{name}: unpinned image {image}"
        if name in ("proxy", "vllm", "prometheus", "grafana"):
            assert "healthcheck" in service or "build" in service, name


def test_the_hybrid_env_file_serves_a_hybrid_as_measured():
    """``--env-file .env --env-file deploy/hybrid.env``: .env's stack with the hybrid's pacing and
    vLLM flags (docs/results/hybrid.md), the GDN path as .env has it, the proxy unchanged."""
    result = compose("--env-file", ".env", "--env-file", "deploy/hybrid.env", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    vllm = config["services"]["vllm"]
    env, command = vllm["environment"], vllm["command"]
    assert (env["PREFILL_GATE_PACING"], env["PREFILL_GATE_PACING_TARGET_ITL_MS"], env["PREFILL_GATE_PACING_SUB_BLOCK"],
            env["PREFILL_GATE_GDN_RECURRENT"], env["PREFILL_GATE_GDN_WALK"]) == ("adaptive", "44", "1", "on", "8x1")
    assert env["PREFILL_GATE_PACING_CAP_TOKENS"] == "256"  # a host-bound engine's cap: the 256-token graph
    assert command[command.index("--max-num-batched-tokens") + 1] == "2048" and "--enable-prefix-caching" in command
    assert command[command.index("--scheduler-cls") + 1] == "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"
    assert json.loads(command[command.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL"}
    assert env["PREFILL_GATE_GDN_GRAPH"] == "on" and engine_settings(env)["gdn_graph"]  # its mixed steps in whole graphs
    assert config["services"]["proxy"]["environment"]["PREFILL_GATE_SLICING"] == "auto"


def test_every_prefill_gate_setting_in_env_reaches_the_proxy(tmp_path):
    """.env is the proxy's env_file: a setting compose does not map by name (the closed loop's
    PREFILL_GATE_ITL_SLO_MS) still reaches the container."""
    import shutil

    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    (tmp_path / ".env").write_text((ROOT / ".env").read_text() + "PREFILL_GATE_ITL_SLO_MS=20\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "PREFILL_GATE_"))}
    result = subprocess.run([compose_binary(), "config", "--format", "json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=False, env={**env, "GRAFANA_ADMIN_PASSWORD": "pw"})
    assert result.returncode == 0, result.stderr
    proxy = json.loads(result.stdout)["services"]["proxy"]["environment"]
    assert proxy["PREFILL_GATE_ITL_SLO_MS"] == "20"
    from prefill_gate.proxy.settings import load_settings

    settings = load_settings(environ={k: v for k, v in proxy.items() if v is not None})
    assert settings.itl_slo_ms == 20 and settings.slicing == "auto"


def test_compose_requires_a_grafana_password():
    result = compose("config", "-q", password=None)
    assert result.returncode != 0
    assert "GRAFANA_ADMIN_PASSWORD" in result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run([tool("hadolint"), "--failure-threshold", "info", str(ROOT / dockerfile)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_proxy_image_runs_as_a_user_with_a_healthcheck():
    text = (ROOT / "deploy/proxy.Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    assert "HEALTHCHECK" in text
    for dockerfile in DOCKERFILES:
        assert "HEALTHCHECK" in (ROOT / dockerfile).read_text(), dockerfile


def test_promtool_checks_config_and_rules():
    promtool = tool("promtool")
    for args in (["check", "config", "deploy/prometheus/prometheus.yml"],
                 ["check", "rules", "deploy/prometheus/rules.yml"]):
        result = subprocess.run([promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_cover_every_alert():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((ROOT / "deploy/prometheus/rules.test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])}
    assert alerts == tested
    result = subprocess.run([tool("promtool"), "test", "rules", "deploy/prometheus/rules.test.yml"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboards_are_generated_from_their_source():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboards",
                                                  ROOT / "deploy/grafana/build_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    uids = set()
    for name in module.DASHBOARDS:
        committed = (ROOT / "deploy/grafana/dashboards" / name).read_text()
        assert committed == module.render(name), f"run deploy/grafana/build_dashboards.py ({name})"
        board = json.loads(committed)
        uids.add(board["uid"])
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "prometheus"
            assert panel["targets"], panel["title"]
    assert uids == {"prefill-gate", "prefill-gate-vllm"}
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == "prometheus"


def test_readme_and_deploy_docs_document_the_stack():
    readme = (ROOT / "README.md").read_text()
    assert "docker compose up" in readme and "GRAFANA_ADMIN_PASSWORD" in readme
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    for name in ("GRAFANA_ADMIN_PASSWORD", "COMPOSE_PROFILES", "UPSTREAMS", "PACING", "SLICING", "env_file"):
        assert name in deploy, name


def test_the_sm70_service_routes_rows_with_the_custom_backend():
    result = compose("config", "--format", "json", profiles="sm70")
    assert result.returncode == 0, result.stderr
    sm70 = json.loads(result.stdout)["services"]["vllm-sm70"]
    command = sm70["command"]
    assert command[command.index("--attention-backend") + 1] == "CUSTOM"
    assert command[command.index("--dtype") + 1] == "half"
    env = sm70["environment"]
    assert env["PREFILL_GATE_SPEC_AS_DECODE"] == "auto" and env["PREFILL_GATE_PACING"] == "adaptive"  # merged, not replaced
    assert "--compilation-config" not in command  # full graphs with the CUSTOM backend: never measured on a V100
