"""What an engine tells the proxy about itself: one info metric on its own ``/metrics``.

The engine patches publish it on vLLM's page (a stat-logger plugin in vLLM's API server,
``prefill_gate.engine_patches.info``), and the simulator on its page when it paces::

    prefill_gate_engine_info{pacing="adaptive",target_itl_ms="15",short_tokens="1024",version="0.1.0"} 1.0

The proxy reads it with its health checks (``prefill_gate.proxy.capabilities``): an upstream
whose engine bounds its own steps while streams decode needs neither holding nor slicing.
Both sides import this module, so they agree on the name and the labels by construction.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

NAME = "prefill_gate_engine_info"
DOCUMENTATION = "prefill-gate's engine patches in this vLLM: how its steps are paced (an info gauge, always 1)"
# Pacing modes that bound every step's prefill while requests decode. ``cadence`` does not:
# it interleaves decode-only steps, but its prefill steps stay whole chunks.
BOUNDED = ("cap", "adaptive")

_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineInfo:
    pacing: str = "off"  # off | cap | cadence | adaptive (PREFILL_GATE_PACING, when the paced scheduler runs)
    target_itl_ms: str = ""  # adaptive: PREFILL_GATE_PACING_TARGET_ITL_MS
    short_tokens: str = ""  # PREFILL_GATE_PACING_SHORT_TOKENS (short prompts first)
    version: str = ""  # prefill-gate's

    @property
    def bounds_steps(self) -> bool:
        """The engine bounds each step's prefill while requests decode."""
        return self.pacing in BOUNDED

    def labels(self) -> dict[str, str]:
        return asdict(self)

    def describe(self) -> str:
        if not self.bounds_steps:
            return f"pacing {self.pacing}"
        target = f" {self.target_itl_ms} ms" if self.pacing == "adaptive" and self.target_itl_ms else ""
        first = f", prompts of <= {self.short_tokens} tokens first" if self.short_tokens not in ("", "0") else ""
        return f"pacing {self.pacing}{target}{first}"


def info_labels(page: bytes, name: str) -> dict[str, str] | None:
    """The labels of the first sample of the info metric ``name`` on a Prometheus text page
    whose value is not 0; None when there is none."""
    pattern = re.compile(rb"^" + re.escape(name.encode()) + rb"\{([^}\n]*)\}\s+([^\s]+)", re.M)
    for match in pattern.finditer(page):
        try:
            if float(match.group(2)) == 0:
                continue
        except ValueError:
            continue
        return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in _LABEL.findall(match.group(1))}
    return None


def parse(page: bytes) -> EngineInfo | None:
    """The engine's info from its ``/metrics`` page; None where it publishes none (stock vLLM)."""
    labels = info_labels(page, NAME)
    if labels is None:
        return None
    known = EngineInfo.__dataclass_fields__
    return EngineInfo(**{k: v for k, v in labels.items() if k in known})

