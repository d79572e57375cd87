"""Where requests may go: each upstream's health and what it can do, and the loop that
checks them.

``Routing`` holds what the health checks last found per upstream (up or down; with
slicing, whether it caches prefixes and answers ``/tokenize``) and tells the admission
policy (through the gate) and the metrics as it changes. A request's own upstream is the
policy's choice (``admission.py``: least busy, its cached prefix, a reroute when one fails
before answering); side requests that need any live upstream (exact token counts) take
``pick()``.
"""

from __future__ import annotations

import asyncio
import logging

from .admission import AdmissionPolicy
from .capabilities import MAX_METRICS_BYTES, Capabilities, choose_mode, parse_metrics
from .gate import Gate
from .labels import UpstreamMode
from .metrics import Metrics
from .settings import Settings
from .upstream import UpstreamClient, UpstreamError

log = logging.getLogger("prefill_gate")


class Routing:
    def __init__(self, settings: Settings, metrics: Metrics, gate: Gate, policy: AdmissionPolicy):
        self.settings = settings
        self.upstreams = list(settings.upstreams)
        self.metrics, self.gate, self.policy = metrics, gate, policy
        self.health: dict[str, bool] = {}  # the last check's answer; absent: not checked yet
        self.caps: dict[str, Capabilities] = {}  # what each upstream can do (its latest probe)
        self.modes: dict[str, UpstreamMode] = {}  # and so what the gate does there

    def mark_health(self, upstream: str, healthy: bool) -> None:
        if self.health.get(upstream) != healthy:
            log.info("upstream %s is %s", upstream, "up" if healthy else "down")
        self.health[upstream] = healthy
        self.metrics.upstream_up.labels(upstream).set(1 if healthy else 0)
        self.gate.set_health(upstream, healthy)

    def set_capabilities(self, upstream: str, caps: Capabilities) -> None:
        """What the latest check found the upstream can do, and so what the gate does there:
        logged once per change, exported as ``upstream_mode``."""
        settings = self.settings
        mode, why = choose_mode(caps, settings.slicing, settings.paced_admission)
        self.caps[upstream] = caps
        self.metrics.can_slice.labels(upstream).set(1 if caps.can_slice else 0)
        if self.modes.get(upstream) is mode:
            return
        log.info("upstream %s: large prefills are %s while streams decode there: %s", upstream, mode.value, why)
        for m in UpstreamMode:
            self.metrics.upstream_mode.labels(upstream, m).set(1 if m is mode else 0)
        self.modes[upstream] = mode
        up = self.policy.upstreams[upstream]
        up.can_slice = mode is UpstreamMode.SLICED
        up.paced = mode is UpstreamMode.PACED
        self.gate.set_health(upstream, up.healthy)  # a held prompt may go (or slice) now

    def passing(self) -> list[str]:
        """Upstreams whose latest health check passed (readiness)."""
        return [u for u in self.upstreams if self.health.get(u) is True]

    def pick(self) -> str:
        """An upstream for a side request: the first not known to be down (unchecked ones
        count: the first request may come before the first check)."""
        up = [u for u in self.upstreams if self.health.get(u, True)]
        return (up or self.upstreams)[0]

    async def check_forever(self, client: UpstreamClient, interval: float) -> None:
        """Every ``interval`` seconds: each upstream's health and capabilities."""
        while True:
            await self.check(client)
            await asyncio.sleep(interval)

    async def check(self, client: UpstreamClient) -> None:
        results = await asyncio.gather(*(client.healthy(u) for u in self.upstreams))
        for u, ok in zip(self.upstreams, results):
            self.mark_health(u, ok)
        up = [u for u, ok in zip(self.upstreams, results) if ok]
        for u, c in zip(up, await asyncio.gather(*(probe_capabilities(client, u, self.slicing) for u in up))):
            self.set_capabilities(u, c)

    @property
    def slicing(self) -> bool:
        return self.settings.slicing != "off"


async def metrics_page(client: UpstreamClient, upstream: str) -> tuple[int, bytes]:
    """The upstream's ``/metrics`` (status, body), bounded in size and time; raises
    ``UpstreamError`` when it cannot be asked."""
    return await client.request_bytes(upstream, "GET", "/metrics", limit=MAX_METRICS_BYTES, timeout=2.0)


async def probe_capabilities(client: UpstreamClient, upstream: str, slicing: bool = True) -> Capabilities:
    """Block size, prefix caching and the engine's pacing from vLLM's /metrics, and (where
    ``slicing`` may use it) whether /tokenize answers."""
    try:
        status, page = await metrics_page(client, upstream)
        block, caching, engine = parse_metrics(page) if status == 200 else (None, False, None)
        tokenize = False
        if slicing and not (engine is not None and engine.bounds_steps):
            status, body = await client.request_bytes(upstream, "POST", "/tokenize", b'{"prompt":"a"}',
                                                      limit=64 * 1024, timeout=2.0)
            tokenize = status == 200 and b'"tokens"' in body
    except UpstreamError:
        return Capabilities()
    return Capabilities(block, caching, tokenize, engine)
