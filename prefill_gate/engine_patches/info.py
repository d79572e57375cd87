"""What this engine tells the proxy: ``prefill_gate_engine_info`` on vLLM's own /metrics.

A vLLM stat-logger plugin (entry point group ``vllm.stat_logger_plugins``): vLLM builds it
in its API server, the process that serves /metrics, with the engine's configuration. It
publishes once whether the engine paces its steps: ``pacing`` is the mode of
PREFILL_GATE_PACING (its control file's where one is set) when ``--scheduler-cls`` is one of
the paced schedulers, else ``off``. prefill-gate's proxy reads it with its health checks and
then neither holds nor slices long prompts there (``prefill_gate.engine_info``).

It records nothing per step. One side effect to know: vLLM turns its stats on when any
stat-logger plugin is installed, ``--disable-log-stats`` included (it logs so); its own
Prometheus metrics then stay on as well.
"""

from __future__ import annotations

import threading

from prometheus_client import Gauge

from prefill_gate import __version__
from prefill_gate.engine_info import DOCUMENTATION, NAME, EngineInfo
from prefill_gate.engine_patches import _vllm
from prefill_gate.engine_patches.config import current_config

logger = _vllm.init_logger("vllm.prefill_gate.info")

_lock = threading.Lock()
_gauge: list[Gauge] = []  # the process's one gauge (prometheus_client's registry is the process's)


def engine_info(vllm_config, environ=None) -> EngineInfo:
    """This engine's info from its configuration and the pacing settings."""
    from prefill_gate.engine_patches.pacing import PacedAsyncScheduler, PacedScheduler

    cls = vllm_config.scheduler_config.scheduler_cls
    if isinstance(cls, str):
        cls = _vllm.resolve_obj_by_qualname(cls)
    config = current_config(environ)
    paced = isinstance(cls, type) and issubclass(cls, (PacedScheduler, PacedAsyncScheduler))
    mode = config.mode if paced else "off"
    target = "" if config.target_itl_s is None or mode != "adaptive" else f"{config.target_itl_s * 1000:g}"
    return EngineInfo(pacing=mode, target_itl_ms=target,
                      short_tokens=str(config.short_tokens) if mode in ("cap", "adaptive") else "",
                      version=__version__)


def publish(info: EngineInfo) -> Gauge:
    """Set the info gauge (registered once per process; a later call replaces its labels)."""
    with _lock:
        if not _gauge:
            # multiprocess_mode: with several API servers vLLM serves metrics from files
            # (PROMETHEUS_MULTIPROC_DIR); elsewhere it is ignored.
            _gauge.append(Gauge(NAME, DOCUMENTATION, list(info.labels()), multiprocess_mode="mostrecent"))
        gauge = _gauge[0]
        gauge.clear()
        gauge.labels(**info.labels()).set(1)
        return gauge


class EngineInfoLogger(_vllm.AggregateStatLoggerBase):
    """The plugin vLLM builds: publishes the engine's info, records nothing."""

    def __init__(self, vllm_config, engine_indexes=None) -> None:
        try:
            self.info = engine_info(vllm_config)
        except Exception as exc:  # never the reason vLLM does not start: say "not paced" instead
            logger.warning("prefill-gate engine info: %s; publishing pacing off", exc)
            self.info = EngineInfo(pacing="off", version=__version__)
        publish(self.info)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        logger.info("prefill-gate engine info on /metrics: %s (%s)", NAME, self.info.describe())
