"""What an upstream can do, and so what the gate does there: its KV block size, whether it
caches prefixes and answers ``/tokenize`` (slicing), and whether its engine paces its own
steps (prefill-gate's engine patches). Probed at start and with every health check.

vLLM publishes its cache configuration on ``/metrics`` as an info gauge,
``vllm:cache_config_info{block_size="16",enable_prefix_caching="True",...} 1.0``, and the
engine patches theirs as ``prefill_gate_engine_info{pacing="adaptive",...} 1`` (see
``prefill_gate.engine_info``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine_info import EngineInfo, info_labels
from ..engine_info import parse as parse_engine_info
from .labels import UpstreamMode

MAX_METRICS_BYTES = 4 * 1024 * 1024  # vLLM's own /metrics is ~100 KB


@dataclass(frozen=True)
class Capabilities:
    block_size: int | None = None
    prefix_caching: bool = False
    tokenize: bool = False
    engine: EngineInfo | None = None  # prefill-gate's engine patches, where the upstream runs them

    @property
    def can_slice(self) -> bool:
        return bool(self.block_size) and self.prefix_caching and self.tokenize

    @property
    def paces(self) -> bool:
        """Its engine bounds each step's prefill while requests decode."""
        return self.engine is not None and self.engine.bounds_steps

    def why_not(self) -> str:
        """Why slicing is off on this upstream ('' when it is not)."""
        if not self.block_size:
            return "no vllm:cache_config_info on /metrics (block size unknown)"
        if not self.prefix_caching:
            return "prefix caching is off"
        if not self.tokenize:
            return "/tokenize does not answer"
        return ""


def choose_mode(caps: Capabilities, slicing: str, paced_admission: str) -> tuple[UpstreamMode, str]:
    """What the gate does on an upstream with these capabilities, and why (for the log):
    ``slicing`` and ``paced_admission`` are the settings of those names."""
    why = []
    if caps.paces:
        if paced_admission == "admit":
            return UpstreamMode.PACED, (f"its engine paces its own steps ({caps.engine.describe()}): large "
                                        "prefills go to it at once, as many as max_large_in_flight")
        why.append("its engine paces its own steps, but paced_admission is gate")
    if slicing == "off":
        mode = UpstreamMode.HELD
        why.append("slicing is off")
    elif caps.can_slice:
        mode = UpstreamMode.SLICED
        why.append(f"it caches prefixes and answers /tokenize (KV blocks of {caps.block_size} tokens): "
                   f"slicing {slicing}")
    else:
        mode = UpstreamMode.HELD
        why.append(f"it cannot be sliced: {caps.why_not()}")
    return mode, "; ".join(why)


def parse_cache_config(metrics: bytes) -> tuple[int | None, bool]:
    """(block size, prefix caching on) from a Prometheus text page; (None, False) if absent."""
    labels = info_labels(metrics, "vllm:cache_config_info")
    if labels is None:
        return None, False
    try:
        block = int(labels.get("block_size", ""))
    except ValueError:
        block = None
    if block is not None and block < 1:
        block = None
    return block, labels.get("enable_prefix_caching", "").lower() == "true"


def parse_metrics(page: bytes) -> tuple[int | None, bool, EngineInfo | None]:
    """What a ``/metrics`` page says: block size, prefix caching, and the engine's info."""
    block, caching = parse_cache_config(page)
    return block, caching, parse_engine_info(page)
