"""prefill_gate/proxy/routing.py: health as the checks found it, what each upstream can do, and the pick
for side requests; the check against a fake upstream set."""

from __future__ import annotations

import httpx
from conftest import response
from prometheus_client import CollectorRegistry

from prefill_gate.proxy.admission import AdmissionPolicy, Decision, Limits, RequestClass, Slicing, Ticket
from prefill_gate.proxy.capabilities import Capabilities
from prefill_gate.proxy.gate import Gate
from prefill_gate.proxy.metrics import Metrics
from prefill_gate.proxy.routing import Routing
from prefill_gate.proxy.upstream import UpstreamClient

UPS = ["http://a.test", "http://b.test"]


def routing(slicing=Slicing.OFF):
    policy = AdmissionPolicy(UPS, Limits(slicing=slicing), clock=lambda: 0.0)
    metrics = Metrics(CollectorRegistry(), UPS)
    return Routing(UPS, metrics, Gate(policy, metrics), policy), policy, metrics


def test_health_is_what_the_last_check_found():
    r, policy, metrics = routing()
    assert r.passing() == [] and r.pick() == UPS[0]  # unchecked: not passing, but may be picked
    r.mark_health(UPS[0], False)
    assert r.pick() == UPS[1] and not policy.upstreams[UPS[0]].healthy
    assert metrics.registry.get_sample_value("prefill_gate_upstream_up", {"upstream": UPS[0]}) == 0
    r.mark_health(UPS[1], True)
    assert r.passing() == [UPS[1]]
    r.mark_health(UPS[1], False)
    assert r.pick() == UPS[0]  # all down: try the first anyway, errors will tell


def test_capabilities_reach_the_policy_and_free_a_held_prompt():
    r, policy, _ = routing(Slicing.ON)
    b = Ticket(RequestClass.INTERACTIVE, 10, prefer=UPS[0])
    policy.submit(b)
    policy.start_decoding(b)
    r.mark_health(UPS[1], False)
    a = Ticket(RequestClass.LARGE, 20_000, sliceable=True, prefer=UPS[0])
    assert policy.submit(a) is Decision.QUEUED  # nowhere can slice yet
    r.set_capabilities(UPS[0], Capabilities(16, True, True))
    assert policy.upstreams[UPS[0]].can_slice and a.upstream == UPS[0]  # now it is sliced there
    r.set_capabilities(UPS[0], Capabilities(16, False, True))
    assert not policy.upstreams[UPS[0]].can_slice and "prefix caching" in r.caps[UPS[0]].why_not()


async def test_a_check_marks_each_upstream_and_probes_the_live_ones():
    probed = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "b.test":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/metrics":
            probed.append(host)
            return response(200, text='vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0\n')
        if request.url.path == "/tokenize":
            return response(200, {"tokens": [1], "count": 1})
        return response(200)

    r, policy, _ = routing(Slicing.ON)
    client = UpstreamClient(UPS, transport=httpx.MockTransport(upstream))
    await r.check(client, slicing=True)
    assert r.health == {UPS[0]: True, UPS[1]: False} and r.passing() == [UPS[0]]
    assert probed == ["a.test"] and r.caps[UPS[0]].can_slice and UPS[1] not in r.caps
    await client.aclose()
