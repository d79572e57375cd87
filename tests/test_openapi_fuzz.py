"""schemathesis against the proxy's own OpenAPI document (`/openapi.json`), in process.

Every operation there (the two gated endpoints, /health, /ready, /metrics) gets generated requests,
schema-valid and not, and schemathesis' checks: no 5xx, status codes, content types and
bodies as documented, invalid data rejected. The upstream is the fake that answers like
vLLM (tests/test_http_fuzz.py).
"""

from __future__ import annotations

import httpx
import schemathesis
from conftest import make_state
from hypothesis import HealthCheck, settings
from test_http_fuzz import LikeVLLM

from prefill_gate.proxy.app import create_app

UPSTREAM = LikeVLLM()
STATE = make_state(httpx.MockTransport(UPSTREAM))
STATE.mark_health(STATE.settings.upstreams[0], True)  # as a passing health check would (GET /ready: 200)
APP = create_app(STATE, health_checks=False)


async def without_lifespan(scope, receive, send):
    """The app for the whole module: schemathesis' client runs a lifespan per call, and the
    app's shutdown closes its upstream client."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await APP(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", without_lifespan)


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_documented_operation(case):
    case.call_and_validate()
