"""The plugin surface: entry point, version check, register(), telemetry."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import pytest
from prometheus_client import CollectorRegistry

from prefill_gate import engine_patches
from prefill_gate.engine_patches.config import PacingConfig, PacingConfigError
from prefill_gate.engine_patches.cost_model import StepCostModel, features
from prefill_gate.engine_patches.telemetry import PacingTelemetry


def test_entry_point_is_declared():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("prefill_gate") == "prefill_gate.engine_patches:register"


def test_register_validates_and_logs(monkeypatch, caplog):
    monkeypatch.setenv("PREFILL_GATE_PACING", "cap")
    monkeypatch.setenv("PREFILL_GATE_PACING_CAP_TOKENS", "384")
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert "at most 384 prefill tokens" in caplog.text
    monkeypatch.setenv("PREFILL_GATE_PACING", "sometimes")
    with pytest.raises(PacingConfigError, match="PREFILL_GATE_PACING='sometimes'"):
        engine_patches.register()


def test_other_vllm_versions_are_refused(monkeypatch):
    import vllm

    from prefill_gate.engine_patches import _vllm

    monkeypatch.setattr(vllm, "__version__", "0.27.0")
    with pytest.raises(ImportError, match="supports vLLM 0.26.0 only, found 0.27.0"):
        importlib.reload(_vllm)
    monkeypatch.setattr(vllm, "__version__", "0.26.0")
    importlib.reload(_vllm)


def test_telemetry_counts_and_exports():
    registry = CollectorRegistry()
    config = PacingConfig(mode="cap", cap_tokens=256, log_interval_s=0)
    telemetry = PacingTelemetry(config, StepCostModel(), registry=registry)
    telemetry.step(decode_rows=2, prefill_tokens=256, plan_cap=256, deferred=False)
    telemetry.step(decode_rows=2, prefill_tokens=0, plan_cap=None, deferred=False)
    telemetry.step(decode_rows=2, prefill_tokens=0, plan_cap=None, deferred=True)
    telemetry.step(decode_rows=0, prefill_tokens=8192, plan_cap=None, deferred=False)
    telemetry.step(decode_rows=1, prefill_tokens=256, plan_cap=256, deferred=False, unreachable=True)
    telemetry.fitted(0.012)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    for kind, n in (("mixed", 2), ("decode_only", 1), ("deferred", 1), ("prefill_only", 1)):
        assert value("prefill_gate_pacing_steps_total", kind=kind) == n
    assert value("prefill_gate_pacing_target_unreachable_steps_total") == 1
    assert value("prefill_gate_pacing_step_prefill_tokens_count") == 2
    assert value("prefill_gate_pacing_step_prefill_tokens_sum") == 512
    assert value("prefill_gate_pacing_cap_tokens") == 256
    assert value("prefill_gate_pacing_step_seconds_count") == 1
    assert value("prefill_gate_pacing_model_coefficient", term="intercept_seconds") is not None
    summary = telemetry.summary()
    assert summary["steps"]["mixed"] == 2
    assert summary["prefill_tokens_with_decodes"] == 512


def test_telemetry_logs_a_summary_on_its_interval(caplog):
    now = [0.0]
    config = PacingConfig(mode="adaptive", target_itl_s=0.015, log_interval_s=10)
    telemetry = PacingTelemetry(config, StepCostModel(), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate.pacing"):
        telemetry.step(decode_rows=1, prefill_tokens=64, plan_cap=64, deferred=False)
        assert "prefill-gate pacing" not in caplog.text
        now[0] = 11.0
        telemetry.step(decode_rows=1, prefill_tokens=64, plan_cap=64, deferred=False)
    assert '"mode": "adaptive"' in caplog.text and '"samples": 0' in caplog.text
    telemetry.model.observe(features(1, [(0, 255)]), 0.040, size=256)
    assert telemetry.summary()["model"]["graph_size_excess_ms"].keys() == {"256"}
    assert telemetry.summary()["model"]["graph_size_ms"] == {"256": 40.0}


def test_the_engine_info_plugin_is_declared():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.stat_logger_plugins")}
    assert plugins.get("prefill_gate") == "prefill_gate.engine_patches.info:EngineInfoLogger"


@pytest.mark.parametrize("scheduler_cls, pacing, published", [
    ("prefill_gate.engine_patches.pacing.PacedAsyncScheduler", "adaptive", "adaptive"),
    ("prefill_gate.engine_patches.pacing.PacedScheduler", "cap", "cap"),
    ("prefill_gate.engine_patches.pacing.PacedAsyncScheduler", "off", "off"),  # the kill switch
    (None, "adaptive", "off"),  # the variable alone paces nothing: vLLM's own scheduler runs
])
def test_vllm_serves_the_engine_info_the_proxy_reads(tiny_model, monkeypatch, scheduler_cls, pacing, published):
    """vLLM's own stat-logger machinery (the API server's) builds the plugin from its entry
    point; the page vLLM serves on /metrics then carries what the proxy parses."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories

    from prefill_gate.engine_info import parse
    from prefill_gate.proxy.capabilities import parse_metrics
    from tests.engine.harness import vllm_config

    monkeypatch.setenv("PREFILL_GATE_PACING", pacing)
    monkeypatch.setenv("PREFILL_GATE_PACING_TARGET_ITL_MS", "15")
    monkeypatch.delenv("PREFILL_GATE_PACING_CONTROL_FILE", raising=False)
    config = vllm_config(tiny_model, enable_prefix_caching=True)
    config.scheduler_config.scheduler_cls = scheduler_cls
    factories = load_stat_logger_plugin_factories()
    assert any(f.__name__ == "EngineInfoLogger" for f in factories)
    manager = StatLoggerManager(config, engine_idxs=[0], custom_stat_loggers=factories)
    manager.log_engine_initialized()
    page = generate_latest(REGISTRY)
    info = parse(page)
    assert info is not None and info.pacing == published and info.version
    assert info.bounds_steps is (published in ("cap", "adaptive"))
    assert (info.target_itl_ms == "15") is (published == "adaptive")
    block, caching, engine = parse_metrics(page)  # vLLM's own cache info beside it, as the proxy reads both
    assert (block, caching, engine) == (16, True, info)


def test_the_engine_info_follows_the_control_file(tiny_model, monkeypatch, tmp_path):
    from prefill_gate.engine_patches.info import engine_info
    from tests.engine.harness import vllm_config

    control = tmp_path / "pacing.env"
    control.write_text("PREFILL_GATE_PACING=cap\n")
    config = vllm_config(tiny_model)
    config.scheduler_config.scheduler_cls = "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"
    env = {"PREFILL_GATE_PACING": "adaptive", "PREFILL_GATE_PACING_TARGET_ITL_MS": "15",
           "PREFILL_GATE_PACING_CONTROL_FILE": str(control)}
    assert engine_info(config, env).pacing == "cap"
    control.write_text("PREFILL_GATE_PACING=sometimes\n")  # a bad file is ignored, as the scheduler does
    assert engine_info(config, env).pacing == "adaptive"


def test_the_engine_info_plugin_never_stops_vllm(tiny_model, monkeypatch, caplog):
    """A scheduler class it cannot resolve (or a pacing setting it cannot read) publishes
    "not paced" with a warning: the proxy then treats the engine as stock."""
    from prometheus_client import REGISTRY

    from prefill_gate.engine_patches.info import EngineInfoLogger
    from tests.engine.harness import vllm_config

    config = vllm_config(tiny_model)
    config.scheduler_config.scheduler_cls = "no.such.module.Scheduler"
    monkeypatch.setenv("PREFILL_GATE_PACING", "adaptive")
    with caplog.at_level(logging.WARNING):
        logger = EngineInfoLogger(config, [0])
    assert logger.info.pacing == "off" and "publishing pacing off" in caplog.text
    assert REGISTRY.get_sample_value("prefill_gate_engine_info", logger.info.labels()) == 1
