"""Reading request bodies: the same facts inline and in a worker process; the event loop runs
while a big body is read; a bad body is the same 400 either way; a dead worker costs nothing."""

import array
import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import signal

import httpx
import pytest

from prefill_gate.proxy.app import create_app
from prefill_gate.proxy.bodies import (
    ID_BYTES,
    is_json,
    USAGE_MEMBER,
    BodyOptions,
    BodyReader,
    _read_in_worker,
    _unpacked,
    read,
    token_ids_of,
    usage_of,
    with_member,
)
from prefill_gate.proxy.slicer import IdPrefixes
from prefill_gate.proxy.errors import BadRequest

CHAT, COMPLETIONS = BodyOptions("chat"), BodyOptions("completions")
EVERYTHING = dict(protect_non_streaming=True, slicing=True, upstream_tokenize=True)


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "héllo 😀 " * 50}], **fields}).encode()


BODIES = [
    (CHAT, chat(stream=True)),
    (CHAT, chat(stream=True, stream_options={"include_usage": True})),
    (CHAT, chat(stream=True, stream_options={"continuous_usage_stats": False})),
    (CHAT, chat(max_tokens=7, priority=3, cache_salt="s")),
    (CHAT, chat(max_completion_tokens=9, tools=[{"type": "function", "function": {"name": "f"}}])),
    (BodyOptions("chat", **EVERYTHING), chat()),  # assembled: re-encoded with stream and include_usage
    (BodyOptions("chat", **EVERYTHING), chat(stream=True)),
    (BodyOptions("chat", **EVERYTHING), b' {"model":"m","messages":[{"role":"user","content":[{"type":"text",'
                                        b'"text":"parts"}]}],"stream":true} \r\n'),
    (COMPLETIONS, json.dumps({"model": "m", "prompt": "once upon a time", "stream": True}).encode()),
    (BodyOptions("completions", **EVERYTHING), json.dumps({"prompt": "a prompt", "stream": True}).encode()),
    (BodyOptions("completions", **EVERYTHING), json.dumps({"prompt": list(range(5000))}).encode()),
    (BodyOptions("completions", **EVERYTHING), json.dumps({"prompt": ["one", "two"]}).encode()),
]


def _as_sent(body, opts: BodyOptions) -> dict:
    """What the gate sends upstream of a read body, and the facts it decides by, with the
    structures an inline read keeps encoded as a worker's read encodes them."""
    facts = dataclasses.asdict(body)
    shape = facts.pop("shape")
    tokenize = body.tokenize
    if isinstance(tokenize, dict) and "ids" in tokenize:
        tokenize = list(tokenize["ids"])
    elif isinstance(tokenize, dict):
        tokenize = json.loads(json.dumps(tokenize))
    elif isinstance(tokenize, bytes):
        tokenize = json.loads(tokenize)
    facts["tokenize"] = tokenize
    count = shape["tokenize_json"]
    if opts.upstream_tokenize:  # the /tokenize request of an exact count (chat)
        facts["exact_count_request"] = json.loads(count) if count else (
            {"model": body.model, "messages": shape["messages"]} if shape["messages"] is not None else None)
    # What the estimate reads; the text and prompt only where a counter reads them.
    facts["shape"] = (body.shape.n_bytes, shape["n_messages"], shape["token_ids"])
    if opts.local_count or opts.upstream_tokenize:
        facts["text"] = shape["text"]
    if opts.upstream_tokenize:
        facts["prompt"] = shape["prompt"]
    assert facts.pop("content_from_raw") is None
    return facts


@pytest.mark.parametrize("opts,raw", BODIES + [(dataclasses.replace(o, local_count=True), r) for o, r in BODIES[:3]])
def test_a_worker_reads_what_the_loop_would(opts, raw):
    inline, answer = read(raw, opts), _read_in_worker(raw, opts)
    packed = pickle.loads(pickle.dumps(answer))[1]  # as it crosses the pipe
    assert packed.shape.messages is None and not isinstance(packed.tokenize, dict) or \
        isinstance(packed.tokenize, dict) and isinstance(packed.tokenize["ids"], array.array)
    if packed.content_from_raw is not None:  # the bytes it would have carried back
        assert packed.content is None and inline.content in (raw, with_member(raw, USAGE_MEMBER))
    if not (opts.local_count or opts.upstream_tokenize):
        assert packed.shape.text == ""
    assert _as_sent(_unpacked(answer, raw), opts) == _as_sent(inline, opts)
    if not opts.upstream_tokenize:
        assert packed.shape.tokenize_json is None


async def test_big_bodies_go_through_a_worker_process_with_the_same_answer():
    opts = BodyOptions("chat", **EVERYTHING)
    reader = BodyReader({"chat": opts}, offload_bytes=4096, workers=1)
    try:
        small, big = chat(stream=True), chat(stream=True, filler="x" * 5000)
        assert not reader.offloads(len(small)) and reader.offloads(len(big))
        assert _as_sent(await reader.read(small, "chat"), opts) == _as_sent(read(small, opts), opts)
        assert reader._pool is None  # small bodies never start one
        assert _as_sent(await reader.read(big, "chat"), opts) == _as_sent(read(big, opts), opts)
        assert reader._pool is not None
    finally:
        reader.close()


async def test_the_loop_runs_while_a_worker_parses():
    """A body of many containers takes a parse of tens of milliseconds: inline, nothing else
    runs meanwhile; through the worker, the loop goes on (here: a ticker every millisecond)."""
    parts = [{"type": "text", "text": "a"}] * 150_000
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}).encode()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    for workers, expect_ticks in ((0, False), (1, True)):
        reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=workers)
        task = asyncio.create_task(ticker())
        try:
            if workers:
                await reader.read(chat(filler="x" * 5000), "chat")  # the worker started and warm
            await asyncio.sleep(0.01)
            before = ticks
            body = await reader.read(raw, "chat")
            assert body.message_bytes == [150_000]
            assert (ticks - before >= 5) is expect_ticks, (workers, ticks - before)
        finally:
            task.cancel()
            reader.close()


@pytest.mark.parametrize("raw,param", [
    (b'{"model":"m","messages":"no"}' + b" " * 5000, "messages"),
    (b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}' + b" " * 5000, None),
    (b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":' + b"[" * 990 + b"]" * 990 + b"}", None),
    (b'{"model":12,"pad":"' + b"x" * 5000 + b'"}', "model"),
    (b'{"model":' + b"1" * 5000 + b"}", None),  # (an int of over 4,300 digits: not JSON to Python)
])
async def test_a_bad_big_body_is_the_same_400_as_a_small_one(raw, param):
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=1)
    try:
        with pytest.raises(BadRequest) as inline:
            read(raw, CHAT)
        with pytest.raises(BadRequest) as offloaded:
            await reader.read(raw, "chat")
        assert (offloaded.value.message, offloaded.value.param) == (inline.value.message, inline.value.param)
        assert inline.value.param == param
    finally:
        reader.close()


async def test_a_dead_worker_costs_the_request_nothing_and_the_next_body_a_fresh_pool():
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=1)
    big = chat(filler="x" * 5000)
    try:
        await reader.read(big, "chat")
        pool = reader._pool
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        body = await reader.read(big, "chat")  # read inline this once
        assert _as_sent(body, CHAT) == _as_sent(read(big, CHAT), CHAT) and reader._pool is None
        assert _as_sent(await reader.read(big, "chat"), CHAT) == _as_sent(read(big, CHAT), CHAT)
        assert reader._pool is not None and reader._pool is not pool
    finally:
        reader.close()


async def test_start_brings_every_worker_up_and_the_first_big_body_uses_them():
    """``start`` (run at the proxy's start) spawns each worker and waits for its answer, so the
    first long prompt does not wait for a spawn; its body goes to those same processes."""
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=2)
    try:
        await reader.start()
        pool = reader._pool
        assert pool is not None
        started = {pid for pid, p in pool._processes.items() if p.is_alive()}
        assert len(started) == 2
        big = chat(filler="x" * 5000)
        assert _as_sent(await reader.read(big, "chat"), CHAT) == _as_sent(read(big, CHAT), CHAT)
        assert reader._pool is pool and set(pool._processes) == started  # no new process for it
    finally:
        reader.close()


async def test_start_with_no_workers_or_no_processes_starts_nothing_and_reads_inline(monkeypatch):
    import prefill_gate.proxy.bodies

    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=0)
    await reader.start()
    assert reader._pool is None

    def no_semaphores(*args, **kwargs):
        raise ImportError("This platform lacks a functioning sem_open implementation")

    monkeypatch.setattr(prefill_gate.proxy.bodies, "ProcessPoolExecutor", no_semaphores)
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=2)
    await reader.start()  # logged once, not raised: the proxy starts all the same
    big = chat(filler="x" * 5000)
    assert reader._pool is None and not reader.offloads(len(big))
    assert _as_sent(await reader.read(big, "chat"), CHAT) == _as_sent(read(big, CHAT), CHAT)


async def test_the_served_app_starts_its_workers_before_any_request(fake):
    """``prefill-gate serve`` makes its app with ``start_workers``: the workers come up with the
    server, and stop with it."""
    from conftest import make_state, serve

    state = make_state(httpx.MockTransport(fake), offload_body_bytes=4096, body_workers=1)
    app = create_app(state, health_checks=False, start_workers=True)
    async with serve(app):
        for _ in range(300):  # (a spawn: well under a second here; 30 s is a hang)
            pool = state.bodies._pool
            if pool is not None and any(p.is_alive() for p in pool._processes.values()) \
                    and not pool._pending_work_items:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no body reader process came up with the server")
        assert not fake.requests  # nothing sent upstream to get there
    assert state.bodies._pool is None  # closed with the server


# ---------------------------------------------------------------- through the app
async def test_a_big_bodys_exact_count_and_slicing_requests_go_upstream_as_read_in_the_worker(fake):
    """The /tokenize requests of an exact count (upstream_tokenize) and of slicing (auto) are
    encoded in the worker; upstream they are the JSON the loop would have sent."""
    from conftest import proxy_client

    text = "y" * 6000
    messages = [{"role": "user", "content": text}]
    from prefill_gate.proxy.capabilities import Capabilities

    async with proxy_client(fake, upstream_tokenize=True, slicing="auto", large_prefill_tokens=1500,
                            offload_body_bytes=4096, body_workers=1) as (c, state):
        state.set_capabilities(state.settings.upstreams[0], Capabilities(16, True, True))  # an upstream that slices
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
        assert r.status_code == 200
        assert state.bodies._pool is not None  # read in the worker
    sent = [json.loads(q.content) for q in fake.requests if q.url.path == "/tokenize"]
    assert {"model": "m", "messages": messages} in sent  # the exact count's
    sliced = [s for s in sent if "add_generation_prompt" in s]
    assert sliced and sliced[0]["messages"] == messages  # slicing's
    assert all(q.headers["content-type"] == "application/json" for q in fake.requests if q.url.path == "/tokenize")


@pytest.mark.parametrize("answer", [
    json.dumps({"count": 3, "tokens": [1, 2, 3] * 4000}).encode(),
    json.dumps({"count": 0, "tokens": []}).encode() + b" " * 5000,
    json.dumps({"tokens": [1, "2"] * 3000}).encode(),
    json.dumps({"tokens": [1, 2**70] * 3000}).encode(),
    b"<html>" + b"x" * 5000,
])
async def test_a_big_tokenize_answer_is_read_in_a_worker_with_the_same_result(answer):
    reader = BodyReader({}, offload_bytes=4096, workers=1)
    try:
        assert reader.offloads(len(answer))
        try:
            inline = token_ids_of(answer)
        except (ValueError, OverflowError) as exc:
            with pytest.raises(type(exc)) as offloaded:
                await reader.token_ids(answer)
            assert str(offloaded.value) == str(exc)
        else:
            ids = await reader.token_ids(answer)
            assert isinstance(ids, array.array) and ids == inline == array.array("q", [1, 2, 3] * 4000)
    finally:
        reader.close()


async def test_a_long_prompts_id_prefixes_are_encoded_in_a_worker_as_inline():
    ids = list(range(100_000, 103_000))
    reader = BodyReader({}, offload_bytes=4096, workers=1)
    try:
        assert reader.offloads(ID_BYTES * len(ids)) and not reader.offloads(ID_BYTES * 100)
        assert vars(await reader.id_prefixes(ids[:100], 16)) == vars(IdPrefixes(ids[:100], 16))
        assert reader._pool is None
        assert vars(await reader.id_prefixes(ids, 16)) == vars(IdPrefixes(ids, 16))
        assert reader._pool is not None
    finally:
        reader.close()


@pytest.mark.parametrize("answer,usage", [
    (json.dumps({"choices": [{"text": "x" * 6000}], "usage": {"prompt_tokens": 5}}).encode(), {"prompt_tokens": 5}),
    (json.dumps({"choices": [{"text": "x" * 6000}], "usage": None}).encode(), None),
    (json.dumps([{"usage": {}}, "x" * 6000]).encode(), None),
    (b'{"usage": {"prompt_tokens": 5}' + b" " * 6000, None),  # cut short
])
async def test_a_big_answers_usage_is_found_in_a_worker_as_inline(answer, usage):
    reader = BodyReader({}, offload_bytes=4096, workers=1)
    try:
        assert usage_of(answer) == usage == await reader.usage(answer) and reader._pool is not None
    finally:
        reader.close()


async def test_big_error_bodies_and_assembled_answers_are_done_in_a_worker_as_inline():
    """An upstream's error body is checked for JSON, and an answer the proxy assembled is
    encoded, in a worker when big: the same answers as inline, for bodies that nest past
    the recursion limit too."""
    big = {"choices": [{"message": {"content": "caf\xe9 \u20ac" * 2000}, "logprobs": [{"t": i} for i in range(500)]}]}
    cases = [json.dumps(big).encode(), b"{" + b" " * 6000, b"[" * 200_000 + b"]" * 200_000, b"not json" * 1000]
    reader = BodyReader({}, offload_bytes=4096, workers=1)
    try:
        assert await reader.encode(big, 100) == json.dumps(big).encode()  # (read from 100 bytes: inline)
        assert await reader.is_json(b'{"error": 1}') and not await reader.is_json(b"{")
        assert reader._pool is None
        assert all(reader.offloads(len(c)) for c in cases)
        assert [await reader.is_json(c) for c in cases] == [True, False, False, False]
        assert await reader.encode(big, len(cases[0])) == json.dumps(big).encode()
        assert reader._pool is not None
    finally:
        reader.close()
    assert [is_json(c) for c in cases] == [True, False, False, False]


async def test_pools_that_keep_breaking_pause_the_offload_instead_of_a_process_per_request(monkeypatch):
    """Workers that cannot start (their initializer exits, as a spawned child whose __main__
    runs the server would fail): three broken pools in a row pause the offload for a while."""
    import sys
    from concurrent.futures import ProcessPoolExecutor

    import prefill_gate.proxy.bodies

    class Unstartable(ProcessPoolExecutor):
        def __init__(self, workers, mp_context, **kwargs):  # (in place of the reader's own initializer)
            super().__init__(workers, mp_context=mp_context, initializer=sys.exit, initargs=(3,))

    monkeypatch.setattr(prefill_gate.proxy.bodies, "ProcessPoolExecutor", Unstartable)
    now = [0.0]
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=1, clock=lambda: now[0])
    big = chat(filler="x" * 5000)
    try:
        for _ in range(BodyReader.BREAKS_TO_PAUSE):
            assert reader.offloads(len(big))
            assert _as_sent(await reader.read(big, "chat"), CHAT) == _as_sent(read(big, CHAT), CHAT)  # inline
        assert not reader.offloads(len(big)) and reader._pool is None  # paused: no pool started
        await reader.read(big, "chat")
        assert reader._pool is None
        monkeypatch.undo()
        now[0] += BodyReader.PAUSE_S
        assert reader.offloads(len(big))
        await reader.read(big, "chat")
        assert reader._pool is not None and reader.offloads(len(big))
    finally:
        reader.close()


async def test_where_processes_cannot_be_made_every_body_is_read_inline(monkeypatch):
    import prefill_gate.proxy.bodies

    def no_semaphores(*args, **kwargs):
        raise ImportError("This platform lacks a functioning sem_open implementation")

    monkeypatch.setattr(prefill_gate.proxy.bodies, "ProcessPoolExecutor", no_semaphores)
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=2)
    big = chat(filler="x" * 5000)
    assert _as_sent(await reader.read(big, "chat"), CHAT) == _as_sent(read(big, CHAT), CHAT)
    assert not reader.offloads(len(big)) and reader._pool is None


def _read_in_a_daemon(answers) -> None:
    reader = BodyReader({"chat": CHAT}, offload_bytes=4096, workers=2)
    big = chat(filler="x" * 5000)
    try:
        body = asyncio.run(reader.read(big, "chat"))
        answers.put(("read", body.model, reader.workers, reader._pool is None))
    except BaseException as exc:  # noqa: BLE001 (what the request would have got: a 500)
        answers.put(("raised", f"{type(exc).__name__}: {exc}"))


def test_in_a_daemonic_process_the_reader_reads_inline_not_a_500():
    """A proxy run inside a daemonic process (a multiprocessing worker of someone's app) may
    not start processes: the pool's first submit raised AssertionError and the request got a
    500. Now the reader says so once and reads every body on the loop."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    child = ctx.Process(target=_read_in_a_daemon, args=(answers,), daemon=True)
    child.start()
    try:
        assert answers.get(timeout=60) == ("read", "m", 0, True)
    finally:
        child.join(10)


def _with_member_as_it_was(raw: bytes, member: bytes) -> bytes | None:
    body = raw.strip(b" \t\r\n")
    if not (body.startswith(b"{") and body.endswith(b"}")):
        return None
    inner = body[:-1].rstrip(b" \t\r\n")
    return inner + (b"" if inner == b"{" else b",") + member + b"}"


def test_with_member_copies_once_and_answers_as_the_plain_version_did():
    """The slot is found from both ends (at most a few KB read); the answer is what stripping
    and concatenating gave, except past 4 KB of whitespace at an end, which is re-encoded."""
    import random
    rnd = random.Random(3)
    member = b'"k":1'
    pads = [b"", b" ", b"\r\n", b"\t \n", b" " * 4095]
    cores = [b"{}", b"{ }", b'{"a":1}', b'{"a": [1, {}]}', b"[1]", b'"x"', b"{", b"}", b"", b"{" + b"x" * 9000 + b"}"]
    for _ in range(500):
        raw = rnd.choice(pads) + rnd.choice(cores) + rnd.choice(pads)
        if raw.startswith(b"{") and raw.endswith(b"}") and len(raw) > 2:
            raw = raw[:-1] + rnd.choice(pads) + b"}"
        assert with_member(raw, member) == _with_member_as_it_was(raw, member), raw[:40]
    assert with_member(b"{" + b" " * 5000 + b'"a":1}' + b" " * 5000, member) is None  # (re-encoded)
    assert with_member(b" " * 5000 + b'{"a":1}', member) is None


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_proxy_that_ends_leaves_no_body_reader_behind(how):
    """uvicorn re-raises SIGTERM once it has shut down, and the process died before the pool's
    thread told its workers to go: they waited on their queue for ever (seen after every CI run
    once workers started with the server). SIGKILL runs nothing at all. Now the app's shutdown
    stops them, and each worker ends itself once its proxy is gone."""
    import time

    from conftest import alive, children_of
    from prefill_gate.proxy.bench.services import Service

    def living(pids: set[int]) -> set[int]:
        return {p for p in pids if alive(p)}

    proxy = Service("serve", "--upstream", "http://127.0.0.1:9", "--body-workers", "2", name="proxy")
    everyone: set[int] = set()
    try:
        deadline = time.monotonic() + 30
        while len(workers := {k for k in children_of(proxy.proc.pid)
                              if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()}) < 2:
            assert time.monotonic() < deadline, "the workers did not start with the server"
            time.sleep(0.1)
        everyone = set(children_of(proxy.proc.pid))  # the workers and multiprocessing's resource tracker
        proxy.proc.send_signal(how)
        proxy.proc.wait(timeout=15)
        deadline = time.monotonic() + 10  # (a worker looks for its parent every PARENT_WATCH_S)
        while living(everyone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not living(everyone), f"left behind: {sorted(living(everyone))} of workers {sorted(workers)}"
    finally:
        proxy.stop()
        for pid in living(everyone):  # (a failed run leaves nothing behind either)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
