"""The plugin surface: entry point, version check, register(), telemetry."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import pytest
from prometheus_client import CollectorRegistry

from prefill_gate import engine_patches
from prefill_gate.engine_patches.config import PacingConfig, PacingConfigError
from prefill_gate.engine_patches.cost_model import StepCostModel
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
