"""What pacing decided, for people: a periodic log line and optional Prometheus metrics.

The scheduler runs in vLLM's engine-core process, not in the API server that serves
vLLM's /metrics, so pacing serves its own registry on PREFILL_GATE_PACING_METRICS_PORT
(off by default) and logs a one-line JSON summary every PREFILL_GATE_PACING_LOG_INTERVAL_S.
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from prefill_gate.engine_patches.config import PacingConfig
from prefill_gate.engine_patches.cost_model import StepCostModel

logger = logging.getLogger("vllm.prefill_gate.pacing")  # vLLM's handlers cover "vllm.*"

STEP_KINDS = ("decode_only", "mixed", "prefill_only", "deferred")
TERMS = ("intercept_seconds", "per_decode_row_seconds", "per_1k_prefill_tokens_seconds",
         "per_1m_attention_pairs_seconds")


class PacingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.steps = Counter(
            "prefill_gate_pacing_steps_total",
            "Engine steps by what they scheduled while pacing was on",
            ["kind"], registry=registry,
        )
        for kind in STEP_KINDS:
            self.steps.labels(kind)
        self.prefill_tokens = Histogram(
            "prefill_gate_pacing_step_prefill_tokens",
            "Prefill tokens scheduled in a step that also ran decodes",
            buckets=(16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192),
            registry=registry,
        )
        self.cap = Gauge(
            "prefill_gate_pacing_cap_tokens",
            "The prefill cap applied to the latest capped step", registry=registry,
        )
        self.step_seconds = Histogram(
            "prefill_gate_pacing_step_seconds",
            "Measured step durations fed to the adaptive model",
            buckets=(0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.unreachable = Counter(
            "prefill_gate_pacing_target_unreachable_steps_total",
            "Adaptive mode: steps that fell back to CAP_TOKENS because the model predicts "
            "a step without prefill already exceeds the target",
            registry=registry,
        )
        self.short_first = Counter(
            "prefill_gate_pacing_short_first_total",
            "Bounded steps in which a short prompt was prefilled ahead of a long one",
            registry=registry,
        )
        self.aim = Gauge(
            "prefill_gate_pacing_aim_ratio",
            "Adaptive mode: the fraction of the target the model's prediction is aimed at",
            registry=registry,
        )
        self.coefficient = Gauge(
            "prefill_gate_pacing_model_coefficient",
            "Fitted step-time model coefficients (adaptive mode)",
            ["term"], registry=registry,
        )


class PacingTelemetry:
    def __init__(
        self,
        config: PacingConfig,
        model: StepCostModel,
        *,
        registry: CollectorRegistry | None = None,
        clock=time.monotonic,
    ) -> None:
        self.config = config
        self.model = model
        self.clock = clock
        self.counts = dict.fromkeys(STEP_KINDS, 0)
        self.prefill_tokens_with_decodes = 0
        self.last_cap: int | None = None
        self.unreachable_steps = 0
        self.short_first_steps = 0
        self.aim = 1.0
        self.host_bound = False
        self._next_log = clock() + config.log_interval_s
        self.metrics: PacingMetrics | None = None
        if registry is not None or config.metrics_port:
            self.registry = registry or CollectorRegistry()
            self.metrics = PacingMetrics(self.registry)
            if config.metrics_port and registry is None:
                start_http_server(config.metrics_port, registry=self.registry)
                logger.info("prefill-gate pacing metrics on :%d/metrics", config.metrics_port)

    def step(self, *, decode_rows: int, prefill_tokens: int, plan_cap: int | None,
             deferred: bool, unreachable: bool = False, short_first: bool = False) -> None:
        if deferred:
            kind = "deferred"
        elif decode_rows and prefill_tokens:
            kind = "mixed"
        elif decode_rows:
            kind = "decode_only"
        elif prefill_tokens:
            kind = "prefill_only"
        else:
            kind = None
        if kind:
            self.counts[kind] += 1
        if decode_rows and prefill_tokens:
            self.prefill_tokens_with_decodes += prefill_tokens
        if plan_cap is not None:
            self.last_cap = plan_cap
        self.unreachable_steps += unreachable
        self.short_first_steps += short_first
        if self.metrics is not None:
            if unreachable:
                self.metrics.unreachable.inc()
            if short_first:
                self.metrics.short_first.inc()
            if kind:
                self.metrics.steps.labels(kind).inc()
            if decode_rows and prefill_tokens:
                self.metrics.prefill_tokens.observe(prefill_tokens)
            if plan_cap is not None:
                self.metrics.cap.set(plan_cap)
        if self.config.log_interval_s and self.clock() >= self._next_log:
            self._next_log = self.clock() + self.config.log_interval_s
            logger.info("prefill-gate pacing %s", json.dumps(self.summary(), sort_keys=True))

    def fitted(self, seconds: float, aim: float = 1.0, host_bound: bool = False) -> None:
        self.aim = aim
        self.host_bound = host_bound
        if self.metrics is not None:
            self.metrics.step_seconds.observe(seconds)
            self.metrics.aim.set(aim)
            for term, value in zip(TERMS, self.model.coefficients):
                self.metrics.coefficient.labels(term).set(value)

    def summary(self) -> dict:
        out: dict = {
            "mode": self.config.mode,
            "steps": dict(self.counts),
            "prefill_tokens_with_decodes": self.prefill_tokens_with_decodes,
            "last_cap_tokens": self.last_cap,
            "short_first_steps": self.short_first_steps,
        }
        if self.config.mode == "adaptive":
            out["model"] = {
                "samples": self.model.samples,
                "aim": round(self.aim, 4),
                # the latest mixed steps were the host's: caps from sizes' measured steps, not the line
                "host_bound": self.host_bound,
                "target_unreachable_steps": self.unreachable_steps,
                **{t: round(c, 7) for t, c in zip(TERMS, self.model.coefficients)},
                # how far the latest mixed steps of every size ran above the line (a slowdown)
                "drift_ms": round(self.model.drift * 1e3, 1),
                # how far each CUDA-graph size's mixed steps run above the line, less that drift
                "graph_size_excess_ms": {str(size): round(e * 1e3, 1) for size, e in self.model.size_excess().items()},
                # what each size's recent mixed steps took (the median): a host-bound engine's caps
                "graph_size_ms": {str(size): round(m * 1e3, 1) for size, m in self.model.size_measured().items()},
            }
        return out
