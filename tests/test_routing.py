"""prefill_gate/proxy/routing.py: health as the checks found it, what each upstream can do, and the pick
for side requests; the check against a fake upstream set."""

from __future__ import annotations

import httpx
from conftest import response
from prometheus_client import CollectorRegistry

from prefill_gate.proxy.admission import AdmissionPolicy, Decision, Limits, RequestClass, Slicing, Ticket
from prefill_gate.engine_info import EngineInfo
from prefill_gate.proxy.capabilities import Capabilities
from prefill_gate.proxy.gate import Gate
from prefill_gate.proxy.metrics import Metrics
from prefill_gate.proxy.routing import Routing
from prefill_gate.proxy.settings import Settings
from prefill_gate.proxy.upstream import UpstreamClient

UPS = ["http://a.test", "http://b.test"]


def routing(slicing=Slicing.OFF, **settings):
    policy = AdmissionPolicy(UPS, Limits(slicing=slicing), clock=lambda: 0.0)
    metrics = Metrics(CollectorRegistry(), UPS)
    settings = Settings(upstreams=UPS, slicing=slicing.value, **settings)
    return Routing(settings, metrics, Gate(policy, metrics), policy), policy, metrics


def mode(metrics, upstream):
    """The upstream_mode label set to 1 (every other at 0)."""
    on = [m for m in ("paced", "sliced", "held")
          if metrics.registry.get_sample_value("prefill_gate_upstream_mode", {"upstream": upstream, "mode": m}) == 1]
    assert len(on) == 1, on
    return on[0]


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
    await r.check(client)
    assert r.health == {UPS[0]: True, UPS[1]: False} and r.passing() == [UPS[0]]
    assert probed == ["a.test"] and r.caps[UPS[0]].can_slice and UPS[1] not in r.caps
    await client.aclose()


PACED_PAGE = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True"} 1.0\n'
              'prefill_gate_engine_info{pacing="adaptive",short_tokens="1024",target_itl_ms="15",version="0.1.0"} 1.0\n')


async def test_a_paced_engine_is_found_and_neither_held_nor_sliced(caplog):
    """vLLM with the engine patches' pacing says so on its /metrics: the gate lets large
    prefills go there next to live streams, logs why once and exports the mode."""
    tokenized = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return response(200, text=PACED_PAGE if request.url.host == "a.test" else PACED_PAGE.split("\n")[0])
        if request.url.path == "/tokenize":
            tokenized.append(request.url.host)
            return response(200, {"tokens": [1], "count": 1})
        return response(200)

    r, policy, metrics = routing(Slicing.AUTO)
    client = UpstreamClient(UPS, transport=httpx.MockTransport(upstream))
    with caplog.at_level("INFO", logger="prefill_gate"):
        await r.check(client)
        await r.check(client)
    await client.aclose()
    assert r.caps[UPS[0]].engine == EngineInfo("adaptive", "15", "1024", "0.1.0") and r.caps[UPS[0]].paces
    assert policy.upstreams[UPS[0]].paced and not policy.upstreams[UPS[0]].can_slice
    assert not policy.upstreams[UPS[1]].paced and policy.upstreams[UPS[1]].can_slice
    assert (mode(metrics, UPS[0]), mode(metrics, UPS[1])) == ("paced", "sliced")
    assert tokenized == ["b.test", "b.test"]  # a paced engine is never asked for slicing's /tokenize
    said = [rec.getMessage() for rec in caplog.records if "large prefills are" in rec.getMessage()]
    assert len(said) == 2  # once per upstream, not once per check
    assert "paced while streams decode there: its engine paces its own steps (pacing adaptive 15 ms, " \
           "prompts of <= 1024 tokens first)" in said[0]
    # A live stream on the paced upstream does not hold a large prefill there.
    b = Ticket(RequestClass.INTERACTIVE, 10, prefer=UPS[0])
    policy.submit(b)
    policy.start_decoding(b)
    a = Ticket(RequestClass.LARGE, 20_000, sliceable=True, prefer=UPS[0])
    assert policy.submit(a) is Decision.ADMITTED and a.upstream == UPS[0]


def test_each_mode_and_its_reason():
    paced = Capabilities(16, True, False, EngineInfo("adaptive", "15", "1024"))
    cadence = Capabilities(16, True, True, EngineInfo("cadence"))
    for caps, settings, expected, words in [
        (paced, {}, "paced", "paces its own steps"),
        (paced, {"paced_admission": "gate"}, "held", "paced_admission is gate; it cannot be sliced: /tokenize"),
        (cadence, {}, "sliced", "slicing auto"),  # decode-only steps between whole chunks bound nothing
        (Capabilities(16, True, True), {"slicing": Slicing.OFF}, "held", "slicing is off"),
        (Capabilities(16, False, True), {}, "held", "prefix caching is off"),
        (Capabilities(), {}, "held", "block size unknown"),
    ]:
        slicing = settings.pop("slicing", Slicing.AUTO)
        r, policy, metrics = routing(slicing, **settings)
        r.set_capabilities(UPS[0], caps)
        assert mode(metrics, UPS[0]) == expected
        assert policy.upstreams[UPS[0]].paced is (expected == "paced")
        assert policy.upstreams[UPS[0]].can_slice is (expected == "sliced")
        from prefill_gate.proxy.capabilities import choose_mode

        assert words in choose_mode(caps, slicing.value, settings.get("paced_admission", "admit"))[1]
