"""The official OpenAI SDK against the proxy (in front of the simulator, on real sockets):
what every client of the proxy actually uses. Chat and completions, streaming and not, and
errors raised as the SDK's own exception classes."""

from __future__ import annotations

import openai
import pytest
from conftest import serve
from prometheus_client import CollectorRegistry

from prefill_gate.proxy.app import build_state, create_app
from prefill_gate.proxy.settings import load_settings
from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
from prefill_gate.proxy.sim.server import create_sim_app


@pytest.fixture
async def sdk():
    engine = Engine(EngineConfig(), CostModel(base=0.001))
    async with serve(create_sim_app(engine)) as sim_url:
        state = build_state(load_settings({"upstreams": [sim_url]}, environ={}), registry=CollectorRegistry())
        async with serve(create_app(state, health_checks=False)) as url:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
            yield client, state
            await client.close()


async def test_chat_and_completions_streaming_and_not(sdk):
    client, state = sdk
    chat = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    stream = await client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert len(text) == 5
    done = await client.completions.create(model="sim", prompt="hello", max_tokens=4)
    assert len(done.choices[0].text) == 4
    stream = await client.completions.create(model="sim", prompt="hello", max_tokens=4, stream=True)
    assert len("".join([c.choices[0].text async for c in stream if c.choices])) == 4
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim"]
    reg = state.metrics.registry
    assert reg.get_sample_value("prefill_gate_requests_total", {"class": "interactive", "outcome": "completed"}) == 4


async def test_errors_arrive_as_the_sdks_exceptions(sdk):
    client, _ = sdk
    with pytest.raises(openai.NotFoundError) as e:  # the upstream's own refusal, relayed
        await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-9" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the proxy's own: a body it will not gate
        await client.chat.completions.create(model="sim", messages="not a list")  # type: ignore[arg-type]
    assert e.value.body["code"] == "invalid_request"
