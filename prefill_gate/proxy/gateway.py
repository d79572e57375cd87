"""What an inference gateway sees of a pod whose vLLM sits behind prefill-gate.

Gateways that pick a pod per request (the Gateway API inference extension's endpoint
picker, llm-d's router) read each pod's vLLM metrics: ``vllm:num_requests_waiting``
and KV-cache usage. A long prompt that prefill-gate holds never reaches vLLM, so a pod
holding work would look idle there and attract more of it. ``GET /vllm/metrics`` on the
proxy serves the upstream's own metrics page with the requests the gate holds (queued
or being sliced) added to ``vllm:num_requests_waiting``: point the gateway's metrics
scraping at it instead of at vLLM's port.
"""

from __future__ import annotations

import re

from .routing import metrics_page
from .upstream import UpstreamClient, UpstreamError

# vllm:num_requests_waiting{labels} value: one sample line (labels hold no newline).
_WAITING = re.compile(rb"^(vllm:num_requests_waiting(?:\{[^\n]*\})?) ([^\s]+)(.*)$", re.MULTILINE)


def add_held(page: bytes, held: int) -> bytes:
    """vLLM's metrics page with ``held`` added to every ``vllm:num_requests_waiting``
    sample (one per engine; a sidecar's single upstream has one)."""
    if held <= 0:
        return page

    def plus(m: re.Match) -> bytes:
        try:
            value = float(m.group(2)) + held
        except ValueError:
            return m.group(0)
        return m.group(1) + b" " + repr(value).encode() + m.group(3)

    return _WAITING.sub(plus, page)


async def upstream_page(client: UpstreamClient, upstream: str) -> bytes | None:
    """The upstream's ``/metrics`` (bounded), or None when it does not answer 200."""
    try:
        status, page = await metrics_page(client, upstream)
    except UpstreamError:
        return None
    return page if status == 200 else None
