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
from .capabilities import MAX_METRICS_BYTES, Capabilities, parse_cache_config
from .gate import Gate
from .metrics import Metrics
from .upstream import UpstreamClient, UpstreamError

log = logging.getLogger("prefill_gate")


class Routing:
    def __init__(self, upstreams: list[str], metrics: Metrics, gate: Gate, policy: AdmissionPolicy):
        self.upstreams = list(upstreams)
        self.metrics, self.gate, self.policy = metrics, gate, policy
        self.health: dict[str, bool] = {}  # the last check's answer; absent: not checked yet
        self.caps: dict[str, Capabilities] = {}  # slicing: what each upstream can do

    def mark_health(self, upstream: str, healthy: bool) -> None:
        if self.health.get(upstream) != healthy:
            log.info("upstream %s is %s", upstream, "up" if healthy else "down")
        self.health[upstream] = healthy
        self.metrics.upstream_up.labels(upstream).set(1 if healthy else 0)
        self.gate.set_health(upstream, healthy)

    def set_capabilities(self, upstream: str, caps: Capabilities) -> None:
        if self.caps.get(upstream) != caps:
            if caps.can_slice:
                log.info("upstream %s can be sliced (KV blocks of %d tokens)", upstream, caps.block_size)
            else:
                log.warning("upstream %s cannot be sliced, large prefills are held there: %s", upstream,
                            caps.why_not())
        self.caps[upstream] = caps
        self.policy.upstreams[upstream].can_slice = caps.can_slice
        self.metrics.can_slice.labels(upstream).set(1 if caps.can_slice else 0)
        if caps.can_slice:
            self.gate.set_health(upstream, self.policy.upstreams[upstream].healthy)  # a held prompt may slice now

    def passing(self) -> list[str]:
        """Upstreams whose latest health check passed (readiness)."""
        return [u for u in self.upstreams if self.health.get(u) is True]

    def pick(self) -> str:
        """An upstream for a side request: the first not known to be down (unchecked ones
        count: the first request may come before the first check)."""
        up = [u for u in self.upstreams if self.health.get(u, True)]
        return (up or self.upstreams)[0]

    async def check_forever(self, client: UpstreamClient, interval: float, slicing: bool) -> None:
        """Every ``interval`` seconds: each upstream's health, and (slicing) its capabilities."""
        while True:
            await self.check(client, slicing)
            await asyncio.sleep(interval)

    async def check(self, client: UpstreamClient, slicing: bool) -> None:
        results = await asyncio.gather(*(client.healthy(u) for u in self.upstreams))
        for u, ok in zip(self.upstreams, results):
            self.mark_health(u, ok)
        if slicing:
            up = [u for u, ok in zip(self.upstreams, results) if ok]
            for u, c in zip(up, await asyncio.gather(*(probe_capabilities(client, u) for u in up))):
                self.set_capabilities(u, c)


async def metrics_page(client: UpstreamClient, upstream: str) -> tuple[int, bytes]:
    """The upstream's ``/metrics`` (status, body), bounded in size and time; raises
    ``UpstreamError`` when it cannot be asked."""
    return await client.request_bytes(upstream, "GET", "/metrics", limit=MAX_METRICS_BYTES, timeout=2.0)


async def probe_capabilities(client: UpstreamClient, upstream: str) -> Capabilities:
    """Block size and prefix caching from vLLM's /metrics, and whether /tokenize answers."""
    try:
        status, page = await metrics_page(client, upstream)
        block, caching = parse_cache_config(page) if status == 200 else (None, False)
        status, body = await client.request_bytes(upstream, "POST", "/tokenize", b'{"prompt":"a"}',
                                                  limit=64 * 1024, timeout=2.0)
    except UpstreamError:
        return Capabilities()
    return Capabilities(block, caching, status == 200 and b'"tokens"' in body)
