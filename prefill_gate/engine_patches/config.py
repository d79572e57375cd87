"""Step-pacing settings, read from PREFILL_GATE_PACING* environment variables.

Environment variables and not vLLM's `--additional-config`: that one enters vLLM's
compile-cache hash, so flipping a pacing knob would recompile the model. Every value is
validated when the scheduler is built; an error names the variable and what it accepts.

    PREFILL_GATE_PACING              off | cap | cadence | adaptive       (off)
    PREFILL_GATE_PACING_CAP_TOKENS   cap: prefill tokens per step while a request
                                     decodes; adaptive: the cap before the first fit, and
                                     while the target is out of reach (256)
    PREFILL_GATE_PACING_INTERVAL     cadence: decode-only steps between prefill steps (1)
    PREFILL_GATE_PACING_MAX_DEFERRED cadence: bound on consecutive steps without prefill,
                                     vLLM's own throttle included (= INTERVAL)
    PREFILL_GATE_PACING_TARGET_ITL_MS adaptive: the step time to hold while a request
                                     decodes (required for adaptive)
    PREFILL_GATE_PACING_MIN_TOKENS   adaptive: the least prefill per step, so a prefill
                                     always advances (16)
    PREFILL_GATE_PACING_GRAPH_CLAMP  1: keep decode tokens + cap within the largest
                                     CUDA-graph capture size; 0: do not (1)
    PREFILL_GATE_PACING_GRAPH_ALIGN  1: lower the cap so decode tokens + cap is a
                                     CUDA-graph capture size, which vLLM would pad the
                                     step up to anyway; 0: do not (1)
    PREFILL_GATE_PACING_STEP_QUANTUM lower decode tokens + cap to a multiple of this
                                     when it is at least this large (GEMM and attention
                                     tiles: 128 rows on Hopper); 0: off (0)
    PREFILL_GATE_PACING_SHORT_TOKENS  while a step's prefill is bounded, prompts with at most
                                     this many prompt tokens left to compute (cached prefix
                                     excluded) are prefilled before a longer prompt's next
                                     chunk; 0: arrival order, as vLLM (1024)
    PREFILL_GATE_PACING_SHORT_STEP_X adaptive: a step whose pending prefill is all short prompts
                                     (SHORT_TOKENS left to compute, as short-first counts them: a
                                     long prompt's last ones too) aims at this many times the predicted step
                                     without prefill where that is below TARGET_ITL_MS: a short
                                     prompt takes a step more and costs the streams less, while
                                     long prompts' steps keep the target (where a prefill step
                                     is bound by compute and a decode step by memory, as the
                                     27B hybrid on the H200: 38 ms against 15); 0: off (0)
    PREFILL_GATE_PACING_LONG_MIN_SHARE the least share of a bounded step's prefill tokens a
                                     longer prompt keeps while short ones go first (0.5)
    PREFILL_GATE_PACING_SUB_BLOCK    hybrid models in prefix caching's align mode: 1 lets a
                                     bounded step carry part of a KV block of a long prompt
                                     (chunks still end on every block boundary they reach,
                                     where the recurrent state is cached); 0: whole blocks,
                                     as vLLM (0)
    PREFILL_GATE_PACING_HOST_SHARE   adaptive: a mixed step whose host work (schedule() to its
                                     launch) is at least this share of its time is the
                                     host's; while the latest are, the cap is CAP_TOKENS
                                     lowered past graph sizes measured over the target;
                                     0: never (0.8)
    PREFILL_GATE_PACING_LOG_INTERVAL_S seconds between decision summaries in the log;
                                     0: none (30)
    PREFILL_GATE_PACING_METRICS_PORT serve the decisions as Prometheus metrics from the
                                     engine process on this port; 0: off (0)
    PREFILL_GATE_PACING_CONTROL_FILE a file of KEY=VALUE lines (these names, and the GDN
                                     patch's: engine_patches.gdn) read over the
                                     environment, re-read when it changes: retune pacing
                                     without restarting vLLM (sweeps, operators). A bad
                                     file is logged and the running settings kept. (unset)
    PREFILL_GATE_PACING_TRACE_FILE   append one JSON line per engine step (pacing on):
                                     decode rows, prefill chunks (start, tokens), cap,
                                     aim and the model's prediction; for diagnosis, not
                                     for production (unset)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prefill_gate._env import read_settings_file
from prefill_gate.engine_patches.gdn import control_key

Mode = Literal["off", "cap", "cadence", "adaptive"]
MODES: tuple[Mode, ...] = ("off", "cap", "cadence", "adaptive")
PREFIX = "PREFILL_GATE_PACING"


class PacingConfigError(ValueError):
    """A PREFILL_GATE_PACING* variable holds a value pacing cannot use."""


@dataclass(frozen=True)
class PacingConfig:
    mode: Mode = "off"
    cap_tokens: int = 256
    interval: int = 1
    max_deferred: int = 1
    target_itl_s: float | None = None
    min_tokens: int = 16
    graph_clamp: bool = True
    graph_align: bool = True
    step_quantum: int = 0
    short_tokens: int = 1024
    short_step_x: float = 0.0
    long_min_share: float = 0.5
    sub_block: bool = False
    short_when_idle: bool = False
    host_share: float = 0.8
    log_interval_s: float = 30.0
    metrics_port: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PacingConfig:
        env = os.environ if environ is None else environ
        mode = env.get(PREFIX, "off").strip().lower() or "off"
        if mode not in MODES:
            raise PacingConfigError(
                f"{PREFIX}={env[PREFIX]!r}: expected one of {', '.join(MODES)}"
            )
        interval = _number(env, "INTERVAL", 1, low=1, high=1000)
        target_ms = _number(env, "TARGET_ITL_MS", None, low=0.1, high=60_000.0, cast=float)
        if mode == "adaptive" and target_ms is None:
            raise PacingConfigError(
                f"{PREFIX}=adaptive needs {PREFIX}_TARGET_ITL_MS (the step time to hold, "
                "in milliseconds, e.g. 3x the solo inter-token gap)"
            )
        short_step_x = _number(env, "SHORT_STEP_X", 0.0, low=0.0, high=100.0, cast=float)
        if 0 < short_step_x <= 1:
            raise PacingConfigError(
                f"{PREFIX}_SHORT_STEP_X={short_step_x}: expected 0 (off) or more than 1 (a step "
                "with a prefill in it takes longer than one without)"
            )
        max_deferred = _number(env, "MAX_DEFERRED", interval, low=1, high=1000)
        if max_deferred < interval:
            raise PacingConfigError(
                f"{PREFIX}_MAX_DEFERRED={max_deferred} is below {PREFIX}_INTERVAL="
                f"{interval}: the cadence could never be kept"
            )
        return cls(
            mode=mode,  # type: ignore[arg-type]
            cap_tokens=_number(env, "CAP_TOKENS", 256, low=1, high=1 << 20),
            interval=interval,
            max_deferred=max_deferred,
            target_itl_s=None if target_ms is None else target_ms / 1000.0,
            min_tokens=_number(env, "MIN_TOKENS", 16, low=1, high=1 << 20),
            graph_clamp=_number(env, "GRAPH_CLAMP", 1, low=0, high=1) == 1,
            graph_align=_number(env, "GRAPH_ALIGN", 1, low=0, high=1) == 1,
            step_quantum=_number(env, "STEP_QUANTUM", 0, low=0, high=1 << 16),
            short_tokens=_number(env, "SHORT_TOKENS", 1024, low=0, high=1 << 20),
            short_step_x=short_step_x,
            long_min_share=_number(env, "LONG_MIN_SHARE", 0.5, low=0.0, high=1.0, cast=float),
            sub_block=_number(env, "SUB_BLOCK", 0, low=0, high=1) == 1,
            short_when_idle=_number(env, "SHORT_WHEN_IDLE", 0, low=0, high=1) == 1,
            host_share=_number(env, "HOST_SHARE", 0.8, low=0.0, high=1.0, cast=float),
            log_interval_s=_number(env, "LOG_INTERVAL_S", 30.0, low=0.0, high=86_400.0, cast=float),
            metrics_port=_number(env, "METRICS_PORT", 0, low=0, high=65535),
        )

    def describe(self) -> str:
        if self.mode == "off":
            return "pacing off: vLLM's own scheduling"
        return self._describe_mode() + self._describe_short_first()

    def _describe_short_first(self) -> str:
        if self.mode == "cadence":
            return ""
        if not self.short_tokens:
            return "; prompts in arrival order"
        return (f"; prompts of <= {self.short_tokens} uncached tokens first, longer ones keep "
                f">= {self.long_min_share:.0%} of a step's prefill"
                + (", also with nothing decoding" if self.short_when_idle else "")
                + (f"; steps with only such prompts to prefill aim at <= {self.short_step_x:g}x the "
                   "step without prefill" if self.short_step_x and self.mode == "adaptive" else ""))

    def _describe_mode(self) -> str:
        if self.mode == "cap":
            return f"pacing cap: at most {self.cap_tokens} prefill tokens per step while a request decodes"
        if self.mode == "cadence":
            return (
                f"pacing cadence: {self.interval} decode-only step(s) between prefill steps "
                f"while a request decodes (at most {self.max_deferred} in a row)"
            )
        assert self.target_itl_s is not None
        return (
            f"pacing adaptive: prefill tokens per step from a fitted step-time model, "
            f"target {self.target_itl_s * 1000:.1f} ms while a request decodes "
            f"(start {self.cap_tokens}, floor {self.min_tokens})"
        )


def read_control_file(path: str, environ: Mapping[str, str]) -> PacingConfig:
    """Settings from a control file's KEY=VALUE lines layered over `environ`."""
    return PacingConfig.from_env({**environ, **read_settings_file(path, control_key, PacingConfigError)})


def current_config(environ: Mapping[str, str] | None = None) -> PacingConfig:
    """The settings a paced scheduler runs with now: the control file's where one is set and
    readable, else the environment's (a bad control file is ignored, as the scheduler does)."""
    env = os.environ if environ is None else environ
    path = env.get(f"{PREFIX}_CONTROL_FILE") or None
    if path is not None:
        try:
            return read_control_file(path, env)
        except (OSError, PacingConfigError):
            pass
    return PacingConfig.from_env(env)


def _raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(f"{PREFIX}_{name}")
    return None if value is None or not value.strip() else value.strip()


def _number(env: Mapping[str, str], name: str, default, *, low, high, cast=int):
    """PREFIX_<name> as ``cast`` (int or float) within low..high; ``default`` when unset."""
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        value = cast(raw)
    except ValueError:
        what = "an integer" if cast is int else "a number"
        raise PacingConfigError(f"{PREFIX}_{name}={raw!r}: expected {what}") from None
    if not low <= value <= high:
        raise PacingConfigError(f"{PREFIX}_{name}={value}: expected {low}..{high}")
    return value
