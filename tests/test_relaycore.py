"""The relay's compiled core (prefill_gate/proxy/_relaycore.c) against the Python it compiles: its
``plain_events`` against ``relay.plain_events``, its ``DirectRelay`` against
``ChunkWriter.write_through`` over ``StreamObserver.take``, over the same reads; its errors,
its references, and the ``relay_core`` setting that chooses it."""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import tracemalloc
import types

import httptools
import pytest
from hypothesis import given, settings, strategies as st

from conftest import compiled_core, make_state
from prefill_gate.proxy import cli, relaycore
from prefill_gate.proxy.listener import ChunkWriter
from prefill_gate.proxy.relay import StreamObserver, plain_events
from test_relay import _EVENTS, EDGE_READS, _reads, chunk, ev


@pytest.fixture(scope="module")
def core():
    return compiled_core()


# ------------------------------------------------------------------ plain_events
_SIGNIFICANT = st.sampled_from([b"data: {", b"\n", b"\n\n", b"\r", b"\r\n", b'"usage"', b'"error"',
                                b'"choices":[]', b'"choices":[{}]', b"\n\ndata: {", b"data: [DONE]", b"x", b"}",
                                b'"', b"usage", b"data:", b" "])


@settings(max_examples=600, deadline=None)
@given(st.one_of(
    st.lists(st.lists(_EVENTS, min_size=1, max_size=4), min_size=1, max_size=6).flatmap(
        lambda groups: st.tuples(st.just(groups), st.lists(st.integers(0, 10_000), max_size=6),
                                 st.sampled_from(["groups", "cuts"]))).map(lambda a: _reads(*a)),
    st.lists(st.tuples(st.sampled_from([b"data: {", b"data: {", b"data: ", b""]),
                       st.lists(_SIGNIFICANT, max_size=24).map(b"".join),
                       st.sampled_from([b"}\n\n", b"}\n\n", b"\n", b"", b"\r\n\r\n", b"\n\n\n"])).map(b"".join),
             min_size=1, max_size=4),
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),
))
def test_plain_events_counts_as_the_python_rule(core, reads):
    """Over whole events, events cut anywhere, soups of the bytes the rule looks for (mostly
    between an event's start and end) and random bytes: the same count as ``relay.plain_events``, from bytes and from a bytearray."""
    for data in reads:
        assert core.plain_events(data) == plain_events(data), data
        assert core.plain_events(bytearray(data)) == plain_events(data), data


@pytest.mark.parametrize("data, n", [
    (ev(chunk("a")), 1),
    (ev(chunk("a")) + ev(chunk("b")) + ev(chunk("c")), 3),
    (ev(chunk("a")) + b"\n", 0),  # a third LF: the next event's
    (ev(chunk("a"))[:-1], 0),  # no blank line yet
    (ev(chunk("a")).replace(b"\n\n", b"\r\n\r\n"), 0),
    (ev(chunk("a")).replace(b"\n\n", b"\r\n\n"), 0),  # a CR: a line ends there
    (ev(chunk("a")) + ev(chunk("\r")).replace(b"\\r", b"\r"), 0),
    (ev(chunk("a")) + b"data: [DONE]\n\n", 0),
    (ev({"choices": [], "usage": {"prompt_tokens": 1}}), 0),
    (ev({"error": {"message": "boom"}}), 0),
    (b'data: {"choices":[{"text":"a"}]}\ndata: {}\n\n', 0),  # one event of two lines
    (ev(chunk("a")) + b"\n\n" + ev(chunk("b")), 0),  # an empty event between two
    (b"", 0), (b"data: {", 0), (b"\n\n", 0), (b"data: {\n\n", 1),
])
def test_plain_events_at_the_edges(core, data, n):
    assert plain_events(data) == n and core.plain_events(data) == n


def test_plain_events_takes_only_bytes_like_reads(core):
    with pytest.raises(TypeError):
        core.plain_events("data: {}\n\n")


# ---------------------------------------------------------------- chunk_payloads
class _Body:
    """httptools' account of a chunked body fed from between two chunks: the body bytes, and
    whether it stands between two chunks again (every chunk it began, it completed)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        self.body, self.open_chunks, self.complete = [], 0, False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_chunk_header(self) -> None:
        self.open_chunks += 1

    def on_chunk_complete(self) -> None:
        self.open_chunks -= 1

    def on_message_complete(self) -> None:
        self.complete = True


def _frame(payload: bytes, spelling: str) -> bytes:
    size = {"lower": b"%x", "upper": b"%X", "zeros": b"000%x"}[spelling] % len(payload)
    return size + b"\r\n" + payload + b"\r\n"


_PAYLOADS = st.binary(min_size=1, max_size=300) | st.sampled_from([b"\r\n", b"0\r\n\r\n", b"data: {}\n\n"])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(_PAYLOADS, st.sampled_from(["lower", "upper", "zeros"])), min_size=1, max_size=6),
       st.lists(st.integers(0, 3000), max_size=4), st.lists(st.booleans(), min_size=7, max_size=7), st.booleans())
def test_chunk_payloads_takes_whole_chunks_as_the_parser_does(core, frames, cuts, at_ends, last):
    """A chunked body (any payloads, sizes in either case or with leading zeros, the last
    chunk or not) cut anywhere, each read from between two chunks (where the connection
    offers one): a read that is whole non-final chunks is taken, any other left (None); and
    httptools reads what was taken to the same body and ends between two chunks, not at the
    body's end."""
    wire = b"".join(_frame(p, how) for p, how in frames) + (b"0\r\n\r\n" if last else b"")
    ends = {0}  # where each whole chunk ends on the wire (the last chunk's excluded)
    for p, how in frames:
        ends.add(max(ends) + len(_frame(p, how)))
    cuts = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts),
                   *(e for e, cut in zip(sorted(ends), at_ends) if cut)})
    for a, b in zip(cuts, cuts[1:]):
        if a not in ends:
            continue  # (read from inside a chunk: never offered; the parser takes it)
        data = wire[a:b]
        payloads = core.chunk_payloads(data)
        assert (payloads is not None) == (b in ends), (a, b, data)
        if payloads is not None:
            parsed = _Body()
            parsed.parser.feed_data(data)
            assert payloads == b"".join(parsed.body) and parsed.open_chunks == 0 and not parsed.complete


@pytest.mark.parametrize("data", [
    b"", b"0\r\n\r\n", b"00\r\n\r\n", b"3\r\nabc\r\n0\r\n\r\n",  # nothing, the last chunk, one behind it
    b"3;ext=1\r\nabc\r\n", b"3 \r\nabc\r\n", b" 3\r\nabc\r\n", b"0x3\r\nabc\r\n", b"+3\r\nabc\r\n",
    b"3\nabc\r\n", b"3\r\nabc\n", b"3\r\nabcXY", b"3\r\nabc\n\n", b"3\r\nabc\r\n1\r\nxY\n", b"3\r\nabcd\r\n", b"3\r\nab\r\n", b"3\r\nabc\r", b"3\r\nabc",  # framing off
    b"\r\n3\r\nabc\r\n", b"3\r\nabc\r\n\r\n", b"g\r\nabc\r\n", b"3\r\n",
    b"f" * 16 + b"\r\n", b"1" + b"0" * 15 + b"\r\n" + b"x" * 64,  # sizes past any read (and size_t's range)
])
def test_chunk_payloads_leaves_anything_but_whole_chunks_to_the_parser(core, data):
    assert core.chunk_payloads(data) is None


def test_chunk_payloads_at_its_bounds(core):
    assert core.chunk_payloads(b"1\r\n\x00\r\n") == b"\x00"
    assert core.chunk_payloads(b"0000000000000a\r\n" + b"x" * 10 + b"\r\n") == b"x" * 10  # 14 digits: taken
    big = b"y" * 70_000
    assert core.chunk_payloads(b"%x\r\n%s\r\n" % (len(big), big) * 2) == big * 2
    with pytest.raises(TypeError):
        core.chunk_payloads(bytearray(b"1\r\na\r\n"))
    with pytest.raises(TypeError):
        core.chunk_payloads("1\r\na\r\n")


# ------------------------------------------------------------------ DirectRelay
def _cycle(writes: list, **fields):
    state = dict(response_started=True, chunked_encoding=True, response_complete=False, disconnected=False)
    state.update(fields)
    return types.SimpleNamespace(**state, flow=types.SimpleNamespace(write_paused=fields.get("paused", False)),
                                 transport=types.SimpleNamespace(write=writes.append))


def _observer(log: list, now: list, drop_usage: bool) -> StreamObserver:
    return StreamObserver(lambda: log.append(("first", now[0])), lambda gap, n: log.append((gap, n)),
                          drop_usage=drop_usage, clock=lambda: now[0])


def _relays_alike(core, reads, states=("ready",), drop_usage=False):
    """Read for read, ``DirectRelay(cycle, observer)`` returns, writes and records exactly what
    ``ChunkWriter(cycle).write_through(observer.take, data)`` does; the client's side in
    ``states`` in turn (a read not taken goes to the relay's task: there, ``take`` as well)."""
    now = [0.0]
    logs = {"python": [], "compiled": []}
    writes = {"python": [], "compiled": []}
    cycles = {k: _cycle(writes[k]) for k in logs}
    observers = {k: _observer(logs[k], now, drop_usage) for k in logs}
    python = functools.partial(ChunkWriter(cycles["python"]).write_through, observers["python"].take)
    compiled = core.DirectRelay(cycles["compiled"], observers["compiled"])
    for i, data in enumerate(reads):
        now[0] = i * 0.25
        for c in cycles.values():
            c.flow.write_paused = states[i % len(states)] == "paused"
            c.response_complete = states[i % len(states)] == "complete"
        taken = python(data)
        assert compiled(data) is taken
        if not taken:
            assert observers["compiled"].take(data) == observers["python"].take(data)
        assert writes["compiled"] == writes["python"], i
    assert logs["compiled"] == logs["python"]
    fields = ("first_at", "last_at", "usage", "done", "saw_error", "tokens")
    assert [getattr(observers["compiled"], f) for f in fields] == [getattr(observers["python"], f) for f in fields]
    assert observers["compiled"].splitter.flush() == observers["python"].splitter.flush()


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_EVENTS, min_size=1, max_size=3), min_size=1, max_size=10),
       st.lists(st.integers(0, 10_000), max_size=10), st.sampled_from(["groups", "cuts"]), st.booleans(),
       st.lists(st.sampled_from(["ready", "paused", "complete"]), min_size=10, max_size=10))
def test_direct_relay_takes_writes_and_records_as_write_through(core, groups, cuts, how, drop_usage, states):
    """Over any events, read whole, in groups or cut anywhere, with the client's side ready,
    paused or complete in turn: the compiled callback is the Python one."""
    _relays_alike(core, _reads(groups, cuts, how), states, drop_usage)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_EVENTS, min_size=1, max_size=3), min_size=1, max_size=8),
       st.lists(st.integers(0, 10_000), max_size=8), st.sampled_from(["groups", "cuts"]),
       st.lists(st.integers(1, 3), min_size=8, max_size=8),
       st.lists(st.sampled_from(["ready", "paused", "complete"]), min_size=8, max_size=8))
def test_direct_relay_takes_whole_chunks_as_their_payloads(core, groups, cuts, how, pieces, states):
    """``chunked(wire)``, where the wire is whole chunks, relays their payloads as the call
    with the payloads does (the same return, writes and records), or returns the payloads
    untouched where the client's side is not ready; a wire that is not whole chunks (the last
    chunk behind) is None, nothing done."""
    now = [0.0]
    logs, writes = {"wire": [], "payloads": []}, {"wire": [], "payloads": []}
    cycles = {k: _cycle(writes[k]) for k in logs}
    observers = {k: _observer(logs[k], now, False) for k in logs}
    relays = {k: core.DirectRelay(cycles[k], observers[k]) for k in logs}
    for i, data in enumerate(_reads(groups, cuts, how)):
        now[0] = i * 0.25
        for c in cycles.values():
            c.flow.write_paused = states[i % len(states)] == "paused"
            c.response_complete = states[i % len(states)] == "complete"
        step = -(-len(data) // pieces[i % len(pieces)])
        wire = b"".join(b"%x\r\n%s\r\n" % (len(data[j:j + step]), data[j:j + step])
                        for j in range(0, len(data), step))
        assert relays["wire"].chunked(wire + b"0\r\n\r\n") is None
        assert writes["wire"] == writes["payloads"] and logs["wire"] == logs["payloads"]
        taken = relays["payloads"](data)
        got = relays["wire"].chunked(wire)
        assert got is True if taken else got == data
        if not taken:  # the connection queues it; the relay's task takes it
            assert observers["wire"].take(got) == observers["payloads"].take(data)
        assert writes["wire"] == writes["payloads"] and logs["wire"] == logs["payloads"], i
    fields = ("first_at", "last_at", "usage", "done", "saw_error", "tokens")
    assert [getattr(observers["wire"], f) for f in fields] == [getattr(observers["payloads"], f) for f in fields]


def test_direct_relay_chunked_takes_bytes_only(core):
    relay = core.DirectRelay(_cycle([]), _observer_giving(bytes))
    with pytest.raises(TypeError):
        relay.chunked(bytearray(b"1\r\na\r\n"))
    with pytest.raises(TypeError):
        relay.chunked()


@pytest.mark.parametrize("reads", EDGE_READS)
def test_direct_relay_at_the_edges_of_events(core, reads):
    """The reads the fast path must not take whole (tests/test_relay.py): a blank line's LF
    left over for the next read, blank lines or comments between events, [DONE] behind a chunk."""
    _relays_alike(core, reads)


def _never(data):
    raise AssertionError("observed while the client's side was not ready")


def _observer_giving(out):
    """A stand-in observer whose general path gives ``out(data)``: ``take``, and its splitter's
    ``feed`` then ``filter``, alike."""
    return types.SimpleNamespace(first_at=None, splitter=types.SimpleNamespace(held=b"", feed=lambda d: [d]),
                                 filter=lambda events: out(b"".join(events)), take=out)


@pytest.mark.parametrize("fields", list(itertools.product([False, True], [False, True, "maybe"], [False, True],
                                                           [False, True], [False, True])))
def test_direct_relay_is_ready_exactly_when_write_through_is(core, fields):
    """Over every state of the cycle's fields: taken and written only while the answer is
    started, chunked, not complete, its client there and reading; else False, ``take`` not
    called (tests/test_direct_relay.py holds write_through to the same)."""
    started, chunked, complete, disconnected, paused = fields
    written = []
    cycle = _cycle(written, response_started=started, chunked_encoding=chunked, response_complete=complete,
                   disconnected=disconnected, paused=paused)
    ready = started and chunked is True and not complete and not disconnected and not paused
    observer = _observer_giving(bytes.upper if ready else _never)
    assert core.DirectRelay(cycle, observer)(b"abc") is ready
    assert written == ([b"3\r\nABC\r\n"] if ready else [])


def test_direct_relay_writes_nothing_for_nothing_and_frames_any_bytes_like(core):
    """Bytes go the observer's general path (splitter, filter); any other read goes to ``take``;
    whatever bytes-like answer comes back is framed."""
    written = []
    cycle = _cycle(written)
    for out, expect in [(lambda d: b"", []), (lambda d: bytearray(b"xy"), [b"2\r\nxy\r\n"]),
                        (lambda d: memoryview(b"z" * 300), [b"12c\r\n" + b"z" * 300 + b"\r\n"])]:
        for read in (b"data", bytearray(b"data")):
            written.clear()
            assert core.DirectRelay(cycle, _observer_giving(out))(read) is True
            assert written == expect


@pytest.mark.parametrize("size", [1, 9, 10, 15, 16, 17, 255, 256, 4095, 4096, 65535, 65536, (1 << 20) + 11])
def test_direct_relay_frames_every_length_as_python_does(core, size):
    """A chunk's size line is its length in lowercase hex without leading zeros, at every
    count of digits (b"%x" % len, as ChunkWriter frames it)."""
    written = []
    payload = bytes(range(256)) * (size // 256) + b"q" * (size % 256)
    assert core.DirectRelay(_cycle(written), _observer_giving(lambda d: payload))(b"data") is True
    assert written == [b"%x\r\n%s\r\n" % (size, payload)]


def test_direct_relay_raises_what_its_callbacks_raise(core):
    """An error in the observer or in the write reaches the upstream connection's callback
    (which fails the response: prefill_gate/proxy/fasthttp.py), nothing swallowed."""
    def boom(data):
        raise ValueError("observer failed")

    def refuse(data):
        raise OSError("socket gone")

    observer = _observer_giving(boom)
    with pytest.raises(ValueError, match="observer failed"):  # from filter
        core.DirectRelay(_cycle([]), observer)(b"x")
    with pytest.raises(ValueError, match="observer failed"):  # from take
        core.DirectRelay(_cycle([]), observer)(bytearray(b"x"))
    observer.splitter.feed = boom
    with pytest.raises(ValueError, match="observer failed"):  # from the splitter
        core.DirectRelay(_cycle([]), observer)(b"x")
    cycle = _cycle([])
    cycle.transport.write = refuse
    observer = _observer_giving(bytes)
    with pytest.raises(OSError, match="socket gone"):
        core.DirectRelay(cycle, observer)(b"x")
    under_way = StreamObserver(lambda: None, lambda gap, n: boom(None))
    under_way.first_at = under_way.last_at = 0.0
    with pytest.raises(ValueError, match="observer failed"):  # from counted's on_tokens, on the fast path
        core.DirectRelay(_cycle([]), under_way)(ev(chunk("a")))
    del cycle.flow.write_paused
    with pytest.raises(AttributeError):
        core.DirectRelay(cycle, observer)(b"x")


def test_direct_relay_refuses_wrong_arguments(core):
    observer = _observer_giving(bytes)
    with pytest.raises(TypeError):
        core.DirectRelay(_cycle([]))
    with pytest.raises(AttributeError):  # a cycle without a flow or transport
        core.DirectRelay(types.SimpleNamespace(), observer)
    relay = core.DirectRelay(_cycle([]), observer)
    with pytest.raises(TypeError):
        relay(b"a", b"b")
    with pytest.raises(TypeError):
        relay(data=b"a")


def test_direct_relay_keeps_no_references_and_no_memory(core):
    """A million reads' worth of calls leave every object's references as they were and the
    process's memory where it was (the C code's references counted right); a relay in a
    reference cycle goes at a collection (it tells the collector what it holds)."""
    observer = StreamObserver(lambda: None, lambda gap, n: None)
    observer.take(ev(chunk("first")))
    cycle = _cycle([])
    cycle.transport.write = len  # takes the bytes, keeps nothing
    relay = core.DirectRelay(cycle, observer)
    plain, other = ev(chunk("a")), ev({"choices": [], "usage": {"prompt_tokens": 1}})
    wire = b"%x\r\n%s\r\n" % (len(plain), plain)
    before = [sys.getrefcount(o) for o in (plain, other, observer, cycle, wire)]
    for _ in range(1000):
        relay(plain), relay(other), relay.chunked(wire), relay.chunked(other)
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(100_000):
            relay(plain), relay(other), relay.chunked(wire), relay.chunked(other)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in (plain, other, observer, cycle, wire)] == before
    assert grown < 64 * 1024
    holder = types.SimpleNamespace()
    holder.relay = core.DirectRelay(_cycle([]), types.SimpleNamespace(splitter=holder))
    kind = type(holder.relay)
    del holder
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is kind and o is not relay]


# ------------------------------------------------------------ the relay_core setting
def test_auto_runs_the_compiled_core_where_it_is_built(core):
    state = make_state()
    assert state.relay_core == "compiled" and make_state(relay_core="compiled").relay_core == "compiled"
    assert make_state(relay_core="python").direct_relay is relaycore.python_relay


def test_without_the_compiled_core_auto_runs_python_and_compiled_refuses(monkeypatch, capsys):
    monkeypatch.setattr(relaycore, "compiled_module", lambda: ImportError("no module named prefill_gate.proxy._relaycore"))
    assert relaycore.relay_factory("auto") == (relaycore.python_relay, "python")
    with pytest.raises(relaycore.CoreMissing, match="C compiler"):
        relaycore.relay_factory("compiled")
    assert cli.main(["serve", "--upstream", "http://127.0.0.1:9", "--relay-core", "compiled", "--port", "0"]) == 2
    assert "relay_core is 'compiled' but the compiled relay core did not import" in capsys.readouterr().err
