"""SSE framing and stream observation."""

import json

import pytest

from prefill_gate.proxy.relay import SSESplitter, StreamObserver, event_json, is_content, is_token


def ev(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(content=None, role=None, finish=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_splitter_handles_arbitrary_cuts_and_crlf():
    stream = ev(chunk("a")) + b"data: x\r\n\r\n" + ev(chunk("b")) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        s = SSESplitter()
        events = s.feed(stream[:cut]) + s.feed(stream[cut:])
        assert b"".join(events) == stream and len(events) == 4
        assert s.flush() == b""


def test_splitter_keeps_an_incomplete_tail():
    s = SSESplitter()
    assert s.feed(b"data: {\"a\"") == []
    assert s.flush() == b"data: {\"a\""


def test_is_content():
    assert not is_content(chunk("", role="assistant"))
    assert is_content(chunk("x"))
    assert is_content(chunk(None, finish="stop"))
    assert is_content({"choices": [{"text": "t"}]})
    assert not is_content({"choices": []}) and not is_content(None)
    assert event_json(b": comment\n\n") is None


def test_observer_phases_gaps_usage_and_dropping():
    now = [0.0]
    firsts, gaps = [], []
    obs = StreamObserver(lambda: firsts.append(now[0]), lambda gap, n: gaps.append((gap, n)), drop_usage=True,
                         clock=lambda: now[0])
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}}
    out = obs.filter([ev(chunk("", role="assistant"))])
    now[0] = 1.0
    out += obs.filter([ev(chunk("a"))])
    now[0] = 1.25
    out += obs.filter([ev(chunk("b")), ev(usage), b"data: [DONE]\n\n"])
    assert firsts == [1.0] and gaps == [(0.25, 1)]
    assert obs.usage["prompt_tokens"] == 12 and obs.done and obs.tokens == 2
    assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")


def test_observer_forwards_usage_the_client_asked_for():
    obs = StreamObserver(lambda: None, lambda gap, n: None, drop_usage=False)
    usage = {"choices": [], "usage": {"prompt_tokens": 3}}
    assert obs.filter([ev(usage)]) == ev(usage)


def test_observer_sees_in_stream_errors():
    obs = StreamObserver(lambda: None, lambda gap, n: None)
    obs.filter([ev({"error": {"message": "boom"}})])
    assert obs.saw_error and obs.first_at is None


async def test_an_error_event_in_the_stream_is_not_counted_as_completed():
    import httpx

    from conftest import CHAT, chat, make_state
    from prefill_gate.proxy.app import create_app

    async def upstream(request: httpx.Request) -> httpx.Response:
        async def events():
            yield b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
            yield b'data: {"error":{"message":"engine died","type":"server_error","code":500}}\n\n'
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    state = make_state(httpx.MockTransport(upstream))
    app = create_app(state, health_checks=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
        r = await c.post(CHAT, json=chat("hi", stream=True))
    assert r.status_code == 200 and b"engine died" in r.content  # relayed as sent
    reg = state.metrics.registry
    assert reg.get_sample_value("prefill_gate_requests_total", {"class": "interactive", "outcome": "upstream_error"}) == 1
    assert reg.get_sample_value("prefill_gate_requests_total", {"class": "interactive", "outcome": "completed"}) == 0


def test_each_error_names_its_outcome_and_labels_print_as_their_values():
    from prefill_gate.proxy.errors import (BadRequest, QueueFull, QueueTimeout, ShuttingDown, UpstreamProtocolError,
                              UpstreamTimeout, UpstreamUnavailable)
    from prefill_gate.proxy.labels import ErrorKind, OutcomeKind

    assert BadRequest("x").outcome is OutcomeKind.BAD_REQUEST
    assert QueueFull("x", retry_after=1).outcome is QueueTimeout("x").outcome is OutcomeKind.REJECTED
    assert ShuttingDown("x").outcome is OutcomeKind.SHUTDOWN
    assert all(e("x").outcome is OutcomeKind.UPSTREAM_ERROR
               for e in (UpstreamUnavailable, UpstreamProtocolError, UpstreamTimeout))
    assert (UpstreamUnavailable.kind, UpstreamTimeout.kind) == (ErrorKind.CONNECT, ErrorKind.TIMEOUT)
    assert str(OutcomeKind.CLIENT_DISCONNECT) == "client_disconnect" and ErrorKind.of_status(503) == "http_5xx"


@pytest.mark.parametrize("listener", [False, True], ids=["uvicorn", "listener"])
@pytest.mark.parametrize("ending", ["finished", "client_left", "midstream", "no_done", "connect", "timeout"])
async def test_streams_leave_no_reference_cycles(fake, listener, ending):
    """Each request's objects go when it ends (reference counting), not at the next full
    collection: with hundreds of streams, those collections stall every stream, and what
    survives two young collections waits for a full one (prefill_gate/proxy/collector.py). Whether the
    stream finished, its client left mid-stream (the disconnect cancels the request) or the
    upstream failed (mid-stream, without [DONE], unreachable, silent: the error kept on the
    exchange held its traceback, whose frames held the exchange), behind uvicorn as it comes
    and behind the proxy's own listener (DisconnectWatch's callback)."""
    import asyncio
    import gc

    import httpx

    from conftest import CHAT, UPSTREAM, chat, make_state, serve
    from prefill_gate.proxy.app import create_app
    from prefill_gate.proxy.disconnect import DisconnectWatch
    from prefill_gate.proxy.exchange import GatedExchange
    from prefill_gate.proxy.relay import StreamObserver

    state = make_state(httpx.MockTransport(fake))
    app = create_app(state, health_checks=False)

    def proxys(o) -> bool:  # the test's own client makes httpx responses too
        if isinstance(o, httpx.Response):
            return str(o.request.url).startswith(UPSTREAM)
        return isinstance(o, (GatedExchange, DisconnectWatch, StreamObserver))

    async with serve(app, plain=not listener) as url, httpx.AsyncClient(base_url=url) as c:
        async def one() -> None:
            if ending != "client_left":
                r = await c.post(CHAT, json=chat(stream=True, **({} if ending == "finished" else {"fail": ending})))
                assert (b'"error"' in r.content) == (ending != "finished")  # (a 5xx or an error event)
                return
            async with httpx.AsyncClient(base_url=url) as own:  # its connection closes on leaving
                async with own.stream("POST", CHAT, json=chat(stream=True, hold=True)) as r:
                    async for data in r.aiter_raw():
                        if b'"content"' in data:
                            break

        await one()  # warm: first-use caches
        await asyncio.sleep(0.05)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                await one()
            await asyncio.sleep(0.2)  # the disconnects reach the proxy; its requests end
            gc.collect()
            cyclic = sorted({type(o).__name__ for o in gc.garbage if proxys(o)})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            fake.release.set()
    assert cyclic == [] and not state.exchanges  # (every request ended)
    if ending == "client_left":
        assert state.metrics.registry.get_sample_value(
            "prefill_gate_requests_total", {"class": "interactive", "outcome": "client_disconnect"}) == 4


def test_observer_reports_one_reads_chunks_in_one_call():
    """Per read, not per token: the chunks of one read are one call, the first after the
    gap since the previous read, the rest right behind it."""
    now = [0.0]
    calls = []
    obs = StreamObserver(lambda: None, lambda gap, n: calls.append((gap, n)), clock=lambda: now[0])
    obs.filter([ev(chunk("a"))])
    now[0] = 0.5
    obs.filter([ev(chunk("b")), ev(chunk("c")), ev(chunk("d"))])
    now[0] = 0.75
    obs.filter([ev({"choices": [], "usage": {"prompt_tokens": 1}}), b"data: [DONE]\n\n"])  # no content
    assert calls == [(0.5, 3)] and obs.tokens == 4 and obs.done
    first = StreamObserver(lambda: None, lambda gap, n: calls.append((gap, n)), clock=lambda: now[0])
    first.filter([ev(chunk("x")), ev(chunk("y"))])  # the first content and one more in one read
    assert calls[-1] == (0.0, 1) and first.tokens == 2


def test_the_first_token_may_be_empty_text():
    """A stream is decoding from its first step, whatever that token's text: an empty first
    token (a skipped special token) starts it, the role header alone does not."""
    now = [0.0]
    firsts = []
    obs = StreamObserver(lambda: firsts.append(now[0]), lambda gap, n: None, clock=lambda: now[0])
    obs.filter([ev(chunk("", role="assistant"))])
    assert firsts == [] and obs.first_at is None
    now[0] = 0.5
    obs.filter([ev(chunk(""))])
    now[0] = 0.6
    obs.filter([ev(chunk("a"))])
    assert firsts == [0.5] and obs.tokens == 2


# ------------------------------------------------- the fast paths equal the general ones
from hypothesis import given, settings, strategies as st  # noqa: E402

_EVENTS = st.sampled_from([
    ev(chunk("a")), ev(chunk("", role="assistant")), ev(chunk(None, finish="stop")), ev(chunk("x\ny")),
    ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}),
    ev({"choices": [{"index": 0, "delta": {"content": "u"}}], "usage": {"prompt_tokens": 3}}),
    ev({"choices": [{"index": 0, "delta": {"content": "u"}}], "usage": None}),
    ev({"error": {"message": "boom"}}), ev({"choices": [{"index": 0, "delta": {"content": "the \"error\" word"}}]}),
    ev({"choices": []}), b"data: [DONE]\n\n", b": a comment\n\n", b"data:{\"choices\":[{\"text\":\"t\"}]}\n\n",
    b"data: {\"choices\":[{\"text\":\"crlf\"}]}\r\n\r\n", b"event: ping\ndata: {}\n\n", b"\n\n",
    b"\ndata: {\"choices\":[{\"text\":\"after a blank line\"}]}\n\n", b"data: {\"choices\":[{\"text\":\"a\"}]}\ndata: {}\n\n",
])


def _reads(groups, cuts, how):
    """The reads of a stream: a group of whole events each, or the bytes cut anywhere."""
    if how == "groups":
        return [b"".join(g) for g in groups]
    stream = b"".join(e for g in groups for e in g)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in zip(points, points[1:]) if b > a]


def _same_as_the_general_path(reads, drop_usage=False):
    """``take`` over ``reads`` returns and records exactly what ``filter(splitter.feed(data))`` does."""
    now = [0.0]
    log = {"fast": [], "slow": []}

    def observer(name):
        return StreamObserver(lambda: log[name].append(("first", now[0])),
                              lambda gap, n: log[name].append((gap, n)), drop_usage=drop_usage,
                              clock=lambda: now[0])

    fast_obs, slow_obs = observer("fast"), observer("slow")
    for i, data in enumerate(reads):
        now[0] = i * 0.25
        assert fast_obs.take(data) == slow_obs.filter(slow_obs.splitter.feed(data)), (i, data)
    assert fast_obs.splitter.flush() == slow_obs.splitter.flush()
    assert log["fast"] == log["slow"]
    fields = ("first_at", "last_at", "usage", "done", "saw_error", "tokens")
    assert [getattr(fast_obs, f) for f in fields] == [getattr(slow_obs, f) for f in fields]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_EVENTS, min_size=1, max_size=3), min_size=1, max_size=8),
       st.lists(st.integers(0, 10_000), max_size=8), st.sampled_from(["groups", "cuts"]), st.booleans())
def test_the_fast_path_cuts_and_observes_exactly_as_the_general_one(groups, cuts, how, drop_usage):
    """``StreamObserver.take`` counts the usual read (whole content chunks) without cutting
    it; over any events, read whole or in groups or cut anywhere, it returns and records
    exactly what ``filter(splitter.feed(data))`` does."""
    _same_as_the_general_path(_reads(groups, cuts, how), drop_usage)


_A, _B = ev(chunk("a")), ev(chunk("b"))


EDGE_READS = [
    [_A, _A + b"\n", _B],  # a read ending in a blank line and one more LF: that LF is the next event's
    [_A, _A + _B[:-1], b"\n"],  # the last event's blank line not complete: held over
    [_A, _A + _B[:-2], b"\n\n"],
    [_A, _A + b"\n" + _B],  # a blank line between events: the second starts with LF
    [_A, _A + b"\n\n" + _B],  # an empty event between two
    [_A, _A[:-1], b"\n" + _B],  # a blank line cut in two
    [_A, b"\n" + _B],
    [_A, _A + b": keep-alive\n\n" + _B],  # a comment between chunks
    [_A, _A + b"data: [DONE]\n\n"],
]


@pytest.mark.parametrize("reads", EDGE_READS)
def test_the_fast_path_at_the_edges_of_events(reads):
    """Reads whose events the fast path must not take whole: a blank line's LF in the next
    read, blank lines or comments between events, [DONE] behind a chunk."""
    _same_as_the_general_path(reads)


def test_the_fast_path_takes_runs_of_content_chunks_whole():
    """What the fast path is for: one read of several content chunks is counted as such
    without being cut (the splitter is never fed)."""
    calls = []
    fed = []

    class Recording(SSESplitter):
        def feed(self, data):
            fed.append(data)
            return super().feed(data)

    obs = StreamObserver(lambda: None, lambda gap, n: calls.append(n), clock=lambda: 1.0, splitter=Recording())
    obs.take(ev(chunk("a")))  # the first content: through filter
    fed.clear()
    read = ev(chunk("b")) + ev(chunk("c")) + ev(chunk("d"))
    assert obs.take(read) == read and obs.take(ev(chunk("e"))) == ev(chunk("e"))
    assert fed == [] and calls == [3, 1] and obs.tokens == 5


def test_is_token_counts_every_generated_step_empty_text_included():
    """vLLM streams one chunk a step; a token that decodes to nothing (a skipped special
    token under ignore_eos, half a character) is ``"content": ""``. A client timing gaps
    that counted text alone read a run of those as a stall (a 27B dummy model's 899 ms
    "gap" at run 27395ae, steps of 40 ms all along)."""
    assert is_token(chunk("")) and not is_content(chunk(""))
    assert is_token(chunk("x")) and is_token(chunk(None, finish="length"))
    assert is_token({"choices": [{"text": ""}]}) and is_token({"choices": [{"delta": {}, "token_ids": [7]}]})
    assert not is_token(chunk("", role="assistant"))  # the role header: no step
    assert not is_token({"choices": [], "usage": {"completion_tokens": 3}})
    assert not is_token({"choices": [{"delta": {}}]}) and not is_token({"choices": ["x"]}) and not is_token(None)
