"""What an upstream can do for slicing: its KV block size, whether it caches prefixes, and
whether it answers ``/tokenize``. Probed at start and with every health check.

vLLM publishes its cache configuration on ``/metrics`` as an info gauge,
``vllm:cache_config_info{block_size="16",enable_prefix_caching="True",...} 1.0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INFO = re.compile(rb"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
MAX_METRICS_BYTES = 4 * 1024 * 1024  # vLLM's own /metrics is ~100 KB


@dataclass(frozen=True)
class Capabilities:
    block_size: int | None = None
    prefix_caching: bool = False
    tokenize: bool = False

    @property
    def can_slice(self) -> bool:
        return bool(self.block_size) and self.prefix_caching and self.tokenize

    def why_not(self) -> str:
        """Why slicing is off on this upstream ('' when it is not)."""
        if not self.block_size:
            return "no vllm:cache_config_info on /metrics (block size unknown)"
        if not self.prefix_caching:
            return "prefix caching is off"
        if not self.tokenize:
            return "/tokenize does not answer"
        return ""


def parse_cache_config(metrics: bytes) -> tuple[int | None, bool]:
    """(block size, prefix caching on) from a Prometheus text page; (None, False) if absent."""
    match = _INFO.search(metrics)
    if match is None:
        return None, False
    labels = {k.decode(): v.decode() for k, v in _LABEL.findall(match.group(1))}
    try:
        block = int(labels.get("block_size", ""))
    except ValueError:
        block = None
    if block is not None and block < 1:
        block = None
    return block, labels.get("enable_prefix_caching", "").lower() == "true"
