"""Sliced prefill: the payloads, the slices, the policy's slicing phase, and the whole path
against the simulator on real sockets (a disconnect mid-slicing, the fallbacks to holding)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from conftest import CHAT, chat, hold_stream, proxy_client, sample, serve
from prefill_gate.proxy.admission import AdmissionPolicy, Decision, Limits, Phase, PolicyError, RequestClass, Slicing, Ticket
from prefill_gate.proxy.app import build_state, create_app
from prefill_gate.proxy.routing import probe_capabilities
from prefill_gate.proxy.capabilities import Capabilities, parse_cache_config
from prefill_gate.proxy.settings import load_settings
from prefill_gate.proxy.sim.engine import CostModel, Engine, EngineConfig
from prefill_gate.proxy.sim.server import create_sim_app, render_chat
from prefill_gate.proxy.slicer import IdPrefixes, SliceRun, SliceSizer, run_slices, tokenize_payload
from test_disconnect import start_b, until


# ------------------------------------------------------------------ what to slice
def test_chat_payload_renders_as_vllms_chat_endpoint_would():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
            "chat_template_kwargs": {"x": 1}, "documents": [{"text": "d"}], "reasoning_effort": "low",
            "stream": True, "max_tokens": 5}
    p = tokenize_payload(body, "chat")
    assert p["messages"] is body["messages"] and p["tools"] == body["tools"] and p["model"] == "m"
    assert p["add_generation_prompt"] is True and p["continue_final_message"] is False
    assert p["add_special_tokens"] is False
    # What /tokenize cannot take travels in the template's arguments, as chat merges them.
    assert p["chat_template_kwargs"] == {"x": 1, "documents": [{"text": "d"}], "reasoning_effort": "low",
                                         "enable_thinking": True}
    assert "stream" not in p and "max_tokens" not in p
    # The client's own enable_thinking wins, as in vLLM; "auto" is not passed on.
    p = tokenize_payload({**body, "reasoning_effort": "auto", "chat_template_kwargs": {"enable_thinking": False}},
                         "chat")
    assert p["chat_template_kwargs"] == {"enable_thinking": False, "documents": [{"text": "d"}]}


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1},
    {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 100},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}], "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"a": 1}},
])
def test_what_tokenize_cannot_express_is_not_sliced(body):
    assert tokenize_payload(body, "chat") is None


def test_completions_payloads():
    assert tokenize_payload({"prompt": [5, 6, 7]}, "completions") == {"ids": [5, 6, 7]}
    assert tokenize_payload({"model": "m", "prompt": "abc"}, "completions") == {
        "model": "m", "prompt": "abc", "add_special_tokens": True}
    assert tokenize_payload({"prompt": ["a", "b"]}, "completions") is None
    assert tokenize_payload({"prompt": [[1, 2], [3]]}, "completions") is None


# ---------------------------------------------------------------------- the slices
def test_id_prefixes_are_the_json_of_each_block_prefix():
    ids = [7, 123456, 0, 42, 9, 10, 11, 99999, 1, 2, 3, 4]
    p = IdPrefixes(ids, 4)
    for k in (4, 8, 12):
        assert json.loads(p.json(k)) == ids[:k]


def gap_of(seconds):
    async def window_end(window):
        return seconds
    return window_end


async def test_slices_are_growing_block_aligned_prefixes_of_the_prompt():
    ids = list(range(1000, 1000 + 1234))
    bodies = []

    async def send(body: bytes) -> bool:
        bodies.append(json.loads(body))
        return True

    sizer = SliceSizer(target_s=0.03, min_tokens=100, max_tokens=300, tokens=200)
    run = await run_slices(ids, 16, sizer, send, model="m", cache_salt="s", deadline=float("inf"),
                           window=lambda: None, window_end=gap_of(0.03))
    ends = [len(b["prompt"]) for b in bodies]
    assert ends == sorted(set(ends)) and all(e % 16 == 0 for e in ends)
    assert ends[-1] == (len(ids) - 1) // 16 * 16 and run.tokens == ends[-1]  # the tail is the request's own
    assert all(b["prompt"] == ids[:e] for b, e in zip(bodies, ends))
    assert all(b["max_tokens"] == 1 and b["model"] == "m" and b["cache_salt"] == "s" for b in bodies)
    assert run.slices == len(bodies) and not run.stopped


async def test_slices_come_from_the_encoder_the_caller_gives():
    from prefill_gate.proxy.bodies import BodyReader

    ids = list(range(1000, 1000 + 1234))
    reader = BodyReader({}, offload_bytes=1024, workers=1)  # the proxy's: a worker process here
    asked = []

    async def encode(prefix_ids, block):
        asked.append((len(prefix_ids), block))
        return await reader.id_prefixes(prefix_ids, block)

    async def send(body: bytes) -> bool:
        bodies.append(json.loads(body))
        return True

    try:
        for encoder in (None, encode):
            bodies = []
            sizer = SliceSizer(target_s=0.03, min_tokens=100, max_tokens=300, tokens=200)
            await run_slices(ids, 16, sizer, send, model="m", cache_salt=None, deadline=float("inf"),
                             window=lambda: None, window_end=gap_of(0.03), encode=encoder)
            assert all(b["prompt"] == ids[:len(b["prompt"])] for b in bodies) and bodies
            if encoder is None:
                inline = bodies
        assert bodies == inline and asked == [((len(ids) - 1) // 16 * 16, 16)] and reader._pool is not None
    finally:
        reader.close()


async def test_slicing_stops_at_a_failed_slice_and_at_the_deadline():
    ids = list(range(5000))
    sent = []

    async def failing(body: bytes) -> bool:
        sent.append(body)
        return len(sent) < 3

    sizer = SliceSizer(0.03, 256, 256, 256)
    run = await run_slices(ids, 16, sizer, failing, model=None, cache_salt=None, deadline=float("inf"),
                           window=lambda: None, window_end=gap_of(None))
    assert run.stopped == "upstream_error" and run.slices == 2 and len(sent) == 3
    clock = iter(range(100)).__next__

    async def fine(body: bytes) -> bool:
        return True

    run = await run_slices(ids, 16, sizer, fine, model=None, cache_salt=None, deadline=2,
                           window=lambda: None, window_end=gap_of(None), clock=lambda: float(clock()))
    assert run.stopped == "deadline"


async def test_each_slice_waits_for_settle_first():
    events = []

    async def settle() -> float:
        events.append("settle")
        return 0.25

    async def send(body: bytes) -> bool:
        events.append("slice")
        return True

    sizer = SliceSizer(0.03, 256, 256, 256)
    run = await run_slices(list(range(1000)), 16, sizer, send, model=None, cache_salt=None, deadline=float("inf"),
                           window=lambda: events.append("window"), window_end=gap_of(None), settle=settle)
    assert events == ["settle", "window", "slice"] * run.slices and run.slices == 4
    assert run.settling_s == 0.25 * run.slices


async def test_each_slices_round_trip_is_recorded_from_sent_to_answered():
    """The run keeps each slice's time from its send to its answer (the log line's ``round
    trips``): where a slice's wall time goes beside its step, the engine's intake or its step."""
    now = [0.0]
    took = iter([0.040, 0.025, 0.060, 0.010])

    async def send(body: bytes) -> bool:
        now[0] += next(took)
        return True

    sizer = SliceSizer(0.03, 256, 256, 256)
    run = await run_slices(list(range(1000)), 16, sizer, send, model=None, cache_salt=None, deadline=float("inf"),
                           window=lambda: None, window_end=gap_of(0.01), clock=lambda: now[0])
    assert run.slices == 4 and run.round_trips == pytest.approx([0.040, 0.025, 0.060, 0.010])
    assert run.seconds == pytest.approx(sum(run.round_trips))


async def test_two_slices_in_flight_overlap_in_order_after_the_first_round_trip():
    """inflight=2: the first slice goes alone (its round trip sets the spacing), then each
    slice is sent while the previous one is still answering, never more than two at once,
    the prefixes still growing in order; the run covers the same prompt as one at a time."""
    ids = list(range(3000))
    loop = asyncio.get_running_loop()
    events, in_flight, peak = [], set(), [0]

    async def send(body: bytes) -> bool:
        end = len(json.loads(body)["prompt"])
        events.append(("sent", end, loop.time(), frozenset(in_flight)))
        in_flight.add(end)
        peak[0] = max(peak[0], len(in_flight))
        await asyncio.sleep(0.02)
        in_flight.discard(end)
        return True

    sizer = SliceSizer(0.03, 256, 256, 256)
    run = await run_slices(ids, 16, sizer, send, model=None, cache_salt=None, deadline=float("inf"),
                           window=lambda: None, window_end=gap_of(0.01), inflight=2)
    ends = [e for _, e, _, _ in events]
    assert ends == list(range(256, 2992, 256)) + [2992] and run.tokens == 2992 and run.slices == len(ends)
    assert events[1][3] == frozenset()  # the second slice waited for the first one's answer
    assert peak[0] == 2 and sum(1 for *_, busy in events if busy) >= len(ends) // 2  # (timing: most, not all)
    spacing = [b[2] - a[2] for a, b in zip(events[1:], events[2:])]
    assert min(spacing) >= 0.005  # about half a round trip apart (0.01 s), not at once
    one = SliceSizer(0.03, 256, 256, 256)
    events.clear()
    await run_slices(ids, 16, one, send, model=None, cache_salt=None, deadline=float("inf"),
                     window=lambda: None, window_end=gap_of(0.01))
    assert all(not busy for *_, busy in events)  # inflight=1: one at a time, as before


async def test_slices_under_a_ceiling_go_two_in_flight_when_asked_and_others_one_at_a_time():
    """capped_inflight=2: while the sizer keeps slices under a ceiling (slices above some size
    broke the promise grossly, again and again), the next slice is sent while one runs; with no
    ceiling, one at a time as ``inflight`` says. Set as the proxy has it (``slice_inflight_capped``)."""
    ids = list(range(3000))
    in_flight, busy_sends = set(), []

    async def send(body: bytes) -> bool:
        end = len(json.loads(body)["prompt"])
        busy_sends.append(bool(in_flight))
        in_flight.add(end)
        await asyncio.sleep(0.02)
        in_flight.discard(end)
        return True

    def sizer(capped: bool) -> SliceSizer:
        s = SliceSizer(0.045, 256, 256, 256, max_gap_s=0.05)
        for n in [256] * 100 + [800] * 30:
            s.after(0.02, n, 0)
        if capped:
            s.after(0.12, 800, 0)
            s.after(0.11, 640, 0)
        s.tokens = 256
        assert (s.ceiling() is not None) == capped
        return s

    async def run(capped: bool, **kw) -> SliceRun:
        busy_sends.clear()
        return await run_slices(ids, 16, sizer(capped), send, model=None, cache_salt=None, deadline=float("inf"),
                                window=lambda: None, window_end=gap_of(0.01), **kw)

    done = await run(True, capped_inflight=2)
    assert done.tokens == 2992 and sum(busy_sends) >= len(busy_sends) // 2  # pipelined (timing: most)
    await run(False, capped_inflight=2)
    assert not any(busy_sends)  # no ceiling: inflight=1 holds
    await run(True)
    assert not any(busy_sends)  # a ceiling, capped_inflight not asked: one at a time, as before
    await run(True, capped_inflight=1, inflight=2)
    assert any(busy_sends)  # the larger of the two holds under the ceiling


async def test_a_failed_slice_cancels_the_one_in_flight_behind_it():
    loop = asyncio.get_running_loop()
    answers: dict[int, asyncio.Future] = {}
    cancelled = []

    async def send(body: bytes) -> bool:
        end = len(json.loads(body)["prompt"])
        answers[end] = loop.create_future()
        try:
            return await answers[end]
        except asyncio.CancelledError:
            cancelled.append(end)
            raise

    async def sent(end: int) -> None:
        while end not in answers:
            await asyncio.sleep(0)

    sizer = SliceSizer(0.03, 256, 256, 256)
    run = asyncio.ensure_future(run_slices(list(range(5000)), 16, sizer, send, model=None, cache_salt=None,
                                           deadline=float("inf"), window=lambda: None, window_end=gap_of(None),
                                           inflight=2, clock=lambda: 0.0))
    await sent(256)
    answers[256].set_result(True)
    await sent(768)  # two in flight now: 512 and 768
    answers[512].set_result(True)
    await sent(1024)
    answers[768].set_result(False)  # 768 fails while 1024 runs
    run = await run
    assert run.stopped == "upstream_error" and run.tokens == 512 and run.slices == 2
    assert cancelled == [1024] and sorted(answers) == [256, 512, 768, 1024]


async def test_cancelling_a_pipelined_run_cancels_its_slices():
    started, cancelled = [], []

    async def send(body: bytes) -> bool:
        started.append(body)
        try:
            await asyncio.sleep(0.02 if len(started) == 1 else 10)
        except asyncio.CancelledError:
            cancelled.append(len(started))
            raise
        return True

    task = asyncio.ensure_future(run_slices(list(range(5000)), 16, SliceSizer(0.03, 256, 256, 256), send,
                                            model=None, cache_salt=None, deadline=float("inf"),
                                            window=lambda: None, window_end=gap_of(None), inflight=2))
    while len(started) < 3:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(cancelled) == 2  # both slices in flight, none left running


def test_overlapping_slices_each_see_the_gaps_of_their_own_time():
    from prefill_gate.proxy.predict import MAX_WINDOWS, Predictor

    p = Predictor(["u"], slice_gap_s=0.04, max_gap_s=0.05, min_slice_tokens=256, max_slice_tokens=4096)
    first = p.window_start("u")
    p.gap("u", 0.030)
    second = p.window_start("u")
    p.gap("u", 0.020)
    assert p.window_max("u", first) == pytest.approx(0.030)
    p.gap("u", 0.045)
    assert p.window_max("u", second) == pytest.approx(0.045)
    p.gap("u", 0.5)  # no window open: nothing kept
    assert p.window_max("u", first) == pytest.approx(0.030)
    for _ in range(3 * MAX_WINDOWS):  # windows abandoned by cancelled slicers stay bounded
        p.window_start("u")
    assert len(p._ups["u"].windows) == MAX_WINDOWS


def test_slice_size_follows_the_gaps_in_whole_blocks():
    s = SliceSizer(target_s=0.030, min_tokens=100, max_tokens=2048, tokens=512)
    s.after(0.060)  # twice the target: halve
    assert s.tokens == 256
    s.after(0.300)  # far over: at most halve
    assert s.tokens == 128
    s.after(0.001)  # far under: at most 1.5x
    assert s.tokens == 192
    s.after(None)  # no stream saw it: grow
    assert s.tokens == 288
    assert s.size(16) == 288 and s.size(100) == 200  # whole blocks, at least min_tokens
    s.tokens = 10
    assert s.size(16) == 112  # min 100 rounded up to blocks
    idle = SliceSizer(target_s=0.030, min_tokens=100, max_tokens=2048, tokens=512, hold_unwatched=True)
    for _ in range(5):
        idle.after(None)  # slicing with nothing live: the size stays what the gaps last made it
    assert idle.tokens == 512


# --------------------------------------------------------------------- the policy
def slicing_policy(mode=Slicing.ON, chooser=None, upstreams=("u1",)):
    p = AdmissionPolicy(upstreams, Limits(slicing=mode), clock=lambda: 0.0, chooser=chooser)
    for u in p.upstreams.values():
        u.can_slice = True
    return p


def live_stream(p):
    b = Ticket(RequestClass.INTERACTIVE, 50)
    p.submit(b)
    p.start_decoding(b)
    return b


def long_ticket(sliceable=True):
    return Ticket(RequestClass.LARGE, 20_000, sliceable=sliceable)


def test_a_held_prefill_is_sliced_one_at_a_time_per_upstream():
    p = slicing_policy()
    b = live_stream(p)
    a1, a2 = long_ticket(), long_ticket()
    assert p.submit(a1) is Decision.SLICING and a1.phase is Phase.SLICING
    assert p.submit(a2) is Decision.QUEUED  # one slicer per upstream
    up = p.upstreams["u1"]
    assert up.slicer == a1.id and up.large_in_flight == 0 and up.active == 1
    assert p.sliced(a1, 300) == [a2] and a2.phase is Phase.SLICING  # the freed slicer takes the next
    assert a1.phase is Phase.PREFILLING and a1.tokens == 300 and up.large_in_flight == 0
    assert up.prefill_tokens == 300 + 50 - 50  # the stream's prompt is done; a1's tail is in flight
    p.start_decoding(a1)
    for t in (a2, a1, b):
        p.finish(t)
    assert (up.active, up.live_decodes, up.slicer, up.prefill_tokens, p.queue_depth) == (0, 0, None, 0, 0)


def test_finish_while_slicing_frees_the_slicer_exactly_once():
    p = slicing_policy()
    live_stream(p)
    a = long_ticket()
    p.submit(a)
    nxt = long_ticket()
    p.submit(nxt)
    assert p.finish(a) == [nxt] and nxt.phase is Phase.SLICING
    with pytest.raises(PolicyError):
        p.finish(a)


def test_unslice_goes_back_to_its_place_and_is_never_sliced_again():
    p = slicing_policy()
    b = live_stream(p)
    a, later = long_ticket(), long_ticket(sliceable=False)
    p.submit(a), p.submit(later)
    assert p.unslice(a) == [] and a.phase is Phase.QUEUED and not a.sliceable
    assert p.queued() == [a, later]  # ahead of the later arrival, as before
    assert p.finish(b) == [a]  # the stream ended: the head is admitted whole
    assert p.upstreams["u1"].large_in_flight == 1


def test_not_sliceable_off_or_incapable_upstreams_hold():
    for mode, sliceable, can in ((Slicing.OFF, True, True), (Slicing.ON, False, True), (Slicing.ON, True, False)):
        p = slicing_policy(mode)
        p.upstreams["u1"].can_slice = can
        live_stream(p)
        assert p.submit(long_ticket(sliceable)) is Decision.QUEUED


def test_auto_asks_the_chooser_and_asks_again_as_things_change():
    answers = {"slice": False}
    p = slicing_policy(Slicing.AUTO, chooser=lambda t, u: answers["slice"])
    b = live_stream(p)
    a = long_ticket()
    assert p.submit(a) is Decision.QUEUED
    answers["slice"] = True
    b2 = live_stream(p)  # any change pumps the queue: the chooser now says slice
    assert a.phase is Phase.SLICING
    p.finish(b), p.finish(b2)


def test_slice_idle_slices_with_nothing_live_and_runs_nothing_whole_beside_a_slicer():
    p = AdmissionPolicy(["u1"], Limits(slicing=Slicing.ON, slice_idle=True), clock=lambda: 0.0)
    p.upstreams["u1"].can_slice = True
    a1, a2, plain = long_ticket(), long_ticket(), long_ticket(sliceable=False)
    assert p.submit(a1) is Decision.SLICING  # nothing live: sliced anyway
    assert p.submit(a2) is Decision.QUEUED  # not whole beside the slicer
    p.sliced(a1, 10)
    assert a2.phase is Phase.SLICING
    p.finish(a1), p.sliced(a2, 10), p.finish(a2)
    assert p.submit(plain) is Decision.ADMITTED  # what cannot be sliced runs whole when idle
    # and without slice_idle the same idle upstream admits it whole
    q = slicing_policy()
    assert q.submit(long_ticket()) is Decision.ADMITTED


def test_prefilling_counts_requests_without_their_first_chunk():
    p = slicing_policy()
    b = Ticket(RequestClass.INTERACTIVE, 0)  # a fully cached prompt: no tokens, still prefilling
    p.submit(b)
    up = p.upstreams["u1"]
    assert (up.prefilling, up.prefill_tokens) == (1, 0)
    p.start_decoding(b)
    assert up.prefilling == 0
    p.finish(b)


async def test_prefills_settled_waits_for_first_chunks_within_its_bound():
    from prefill_gate.proxy.gate import Gate

    p = slicing_policy()
    gate = Gate(p)
    assert await gate.prefills_settled("u1", 1.0) == 0.0  # nothing prefilling: no wait
    b = Ticket(RequestClass.INTERACTIVE, 300)
    async with gate.admission(b) as lease:
        waiter = asyncio.create_task(gate.prefills_settled("u1", 5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        lease.decoding()  # its first chunk: the prefill is over
        waited = await asyncio.wait_for(waiter, 1.0)
        assert 0.04 < waited < 1.0
    c = Ticket(RequestClass.INTERACTIVE, 300)
    async with gate.admission(c):  # never decodes (a non-streaming answer): the bound ends the wait
        waited = await gate.prefills_settled("u1", 0.1)
        assert 0.09 < waited < 0.5
    assert not gate._settle_waiters["u1"]


def test_a_sliced_request_is_never_rerouted():
    p = slicing_policy(upstreams=("u1", "u2"))
    live_stream(p), live_stream(p)  # one on each (interactive goes to the least active)
    a = long_ticket()
    assert p.submit(a) is Decision.SLICING
    p.sliced(a, 100)
    assert p.reroute(a, {a.upstream}) is None


# ------------------------------------------------------------------ capabilities
def test_cache_config_is_read_off_vllms_metrics():
    page = (b'# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
            b'enable_prefix_caching="True",engine="0"} 1.0\n')
    assert parse_cache_config(page) == (16, True)
    assert parse_cache_config(page.replace(b"True", b"False")) == (16, False)
    assert parse_cache_config(b"vllm:num_requests_running 0\n") == (None, False)
    assert not Capabilities(16, True, False).can_slice and "tokenize" in Capabilities(16, True, False).why_not()


# --------------------------------------------------- the whole path, real sockets
# Slow steps so that a slice is in flight long enough to act: 5 ms per step + 50 us/token.
COST = CostModel(base=0.005, per_prefill_token=5e-5)


@pytest.fixture
async def sliced_stack(request):
    caching = getattr(request, "param", True)
    budget = 8192 if isinstance(caching, bool) else caching  # an int param: a small step budget
    engine = Engine(EngineConfig(max_num_batched_tokens=budget, enable_prefix_caching=bool(caching)), COST)
    prompts = []
    add = engine.add

    def recording(req, token_ids=False):
        # and, for a slice, how many other requests were prefilling when it arrived
        others = sum(r.prefilling and not getattr(r, "is_slice", False) for r in engine.waiting + engine.running)
        req.is_slice = token_ids
        prompts.append((list(req.prompt), token_ids, others))
        return add(req, token_ids)

    engine.add = recording
    async with serve(create_sim_app(engine)) as sim_url:
        settings = load_settings({"upstreams": [sim_url], "large_prefill_tokens": 1000, "slicing": "on",
                                  "min_slice_tokens": 512, "max_slice_tokens": 512}, environ={})
        state = build_state(settings, registry=CollectorRegistry())
        state.set_capabilities(sim_url, await probe_capabilities(state.client, sim_url))
        async with serve(create_app(state, health_checks=False)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                yield client, state, prompts


def long_chat(n=6000, stream=True):
    return {"model": "sim", "messages": [{"role": "user", "content": "x" * n}], "max_tokens": 3, "stream": stream}


async def test_a_long_prompt_next_to_a_stream_is_sliced_then_sent_whole(sliced_stack):
    client, state, prompts = sliced_stack
    assert state.caps[state.settings.upstreams[0]].can_slice
    b_cm, b_it = await start_b(client)
    r = await client.post(CHAT, json=long_chat(stream=False))
    assert r.status_code == 200
    final = render_chat(long_chat()["messages"])
    slices = [p for p, ids, _ in prompts if ids]
    last = (len(final) - 1) // 16 * 16  # the last whole block before the prompt's end
    assert len(slices) == -(-last // 512) and len(slices[-1]) == last  # 512-token slices up to it
    assert all(s == final[: len(s)] and len(s) % 16 == 0 for s in slices)
    assert [len(s) for s in slices] == sorted(len(s) for s in slices)
    assert prompts[-1][:2] == (final, False)  # then the client's request, unchanged
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(slices[-1])
    reg = state.metrics.registry
    up = state.settings.upstreams[0]
    assert sample(reg, "prefill_gate_slices_total", {"upstream": up}) == len(slices)
    assert sample(reg, "prefill_gate_slice_cache_miss_tokens_total", {"upstream": up}) == 0
    assert sample(reg, "prefill_gate_admissions_total", {"class": "large", "decision": "slicing"}) == 1
    await b_cm.__aexit__(None, None, None)


async def test_the_slice_ceiling_is_exported(sliced_stack):
    """Where larger slices kept stalling streams grossly the sizer keeps under them; operators see
    it as prefill_gate_slice_ceiling_tokens (0 while there is none)."""
    client, state, prompts = sliced_stack
    up = state.settings.upstreams[0]
    sizer = state.predictor.sizer(up)
    for n, gap in [(480, 0.02)] * 20 + [(800, 0.12), (800, 0.02), (640, 0.11)]:
        sizer.after(gap, n, 0)
    assert sizer.ceiling() == 480
    assert sample(state.metrics.registry, "prefill_gate_slice_ceiling_tokens", {"upstream": up}) == 0
    b_cm, b_it = await start_b(client)
    assert (await client.post(CHAT, json=long_chat(stream=False))).status_code == 200
    assert [p for p, ids, _ in prompts if ids]  # sliced, at this stack's only size (512: min_slice_tokens)
    assert sizer.ceiling() == 512  # the clean 512-token slices moved it up to them
    assert sample(state.metrics.registry, "prefill_gate_slice_ceiling_tokens", {"upstream": up}) == 512
    await b_cm.__aexit__(None, None, None)


async def test_a_disconnect_mid_slicing_closes_the_slice_and_sends_nothing_more(sliced_stack):
    client, state, prompts = sliced_stack
    b_cm, b_it = await start_b(client)
    task = asyncio.create_task(client.post(CHAT, json=long_chat(30_000)))
    await until(lambda: sum(ids for _, ids, _ in prompts) >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    sent = sum(ids for _, ids, _ in prompts)
    up = state.policy.upstreams[state.settings.upstreams[0]]
    await until(lambda: up.slicer is None and up.active == 1)  # only B is left
    await asyncio.sleep(0.3)
    assert sum(ids for _, ids, _ in prompts) == sent  # nothing more was sliced
    await b_cm.__aexit__(None, None, None)
    await until(lambda: up.active == 0 and up.live_decodes == 0)


@pytest.mark.parametrize("sliced_stack", [256], indirect=True)
async def test_slices_wait_for_interactive_prefills_to_end(sliced_stack):
    """Steps of 256 tokens: an 800-token interactive prompt prefills over four steps, and a
    slice sent meanwhile would share them (its cost added to the streams' gap)."""
    client, state, prompts = sliced_stack
    b_cm, b_it = await start_b(client)
    task = asyncio.create_task(client.post(CHAT, json=long_chat(30_000, stream=False)))
    await until(lambda: sum(ids for _, ids, _ in prompts) >= 2)
    for _ in range(6):  # interactive requests arriving while it is sliced
        r = await client.post(CHAT, json={**long_chat(3_000, stream=False), "max_tokens": 1})
        assert r.status_code == 200
        await asyncio.sleep(0.01)
    assert (await task).status_code == 200
    slices = [others for _, ids, others in prompts if ids]
    interactive = [p for p, ids, _ in prompts if not ids and 2000 < len(p) < 5000]
    assert len(interactive) == 6 and len(slices) > 6
    assert slices.count(0) == len(slices)  # no slice arrived while another prompt was prefilling
    up = state.settings.upstreams[0]
    assert sample(state.metrics.registry, "prefill_gate_slice_settle_seconds_total", {"upstream": up}) > 0
    await b_cm.__aexit__(None, None, None)


@pytest.mark.parametrize("sliced_stack", [False], indirect=True)
async def test_an_upstream_without_prefix_caching_holds(sliced_stack):
    client, state, prompts = sliced_stack
    up = state.settings.upstreams[0]
    assert not state.caps[up].can_slice and "prefix caching" in state.caps[up].why_not()
    b_cm, b_it = await start_b(client)
    task = asyncio.create_task(client.post(CHAT, json=long_chat()))
    await until(lambda: state.policy.queue_depth == 1)  # held
    await b_cm.__aexit__(None, None, None)
    assert (await task).status_code == 200
    assert not any(ids for _, ids, _ in prompts)


async def test_when_tokenize_fails_the_request_is_held_instead(fake):
    """The fake upstream's /tokenize answers a count but no token ids."""
    async with proxy_client(fake, slicing="on", large_prefill_tokens=1000) as (c, state):
        state.set_capabilities(state.settings.upstreams[0], Capabilities(16, True, True))
        b = await hold_stream(c, fake)
        task = asyncio.create_task(c.post(CHAT, json=chat("y" * 20_000, stream=True)))
        await until(lambda: state.policy.queue_depth == 1)
        assert not fake.bodies[-1].get("prompt")  # no slice was sent
        fake.release.set()
        assert (await b).status_code == 200 and (await task).status_code == 200
        assert state.policy.queued() == []


async def test_a_slices_window_waits_for_the_gap_that_arrives_after_its_answer():
    """The stream's chunk from the slice's engine step may reach the proxy just after the
    slice's answer: closing the window at once missed it (and the sizer grew 1.5x)."""
    from prefill_gate.proxy.exchange import slice_window_end
    from prefill_gate.proxy.predict import Predictor

    p = Predictor(["u"], slice_gap_s=0.04, max_gap_s=0.05, min_slice_tokens=256, max_slice_tokens=4096)
    p.stream_started("u", 1, None, "m", lambda: 0)
    w = p.window_start("u")
    p.gap("u", 0.006)  # decode steps before the slice ran
    asyncio.get_running_loop().call_later(0.01, p.gap, "u", 0.080)  # the slice's own gap, late
    assert await slice_window_end(p, "u", w) == pytest.approx(0.080)
    w = p.window_start("u")  # no stream chunk comes: the wait is bounded
    t = asyncio.get_running_loop().time()
    assert await slice_window_end(p, "u", w, wait_s=0.05) is None
    assert asyncio.get_running_loop().time() - t < 0.2


async def test_auto_counts_a_long_prompt_exactly_before_choosing_and_reuses_the_ids():
    """The simulator's tokens are characters: 4 bytes per token is a 4x under-count."""
    engine = Engine(EngineConfig(max_num_batched_tokens=8192), COST)
    tokenized = []
    async with serve(create_sim_app(engine)) as sim_url:
        settings = load_settings({"upstreams": [sim_url], "large_prefill_tokens": 1000, "slicing": "auto"},
                                 environ={})
        state = build_state(settings, registry=CollectorRegistry())
        state.set_capabilities(sim_url, await probe_capabilities(state.client, sim_url))
        request_bytes = state.client.request_bytes

        async def counting(upstream, method, path, *args, **kwargs):
            if path == "/tokenize":
                tokenized.append(path)
            return await request_bytes(upstream, method, path, *args, **kwargs)

        state.client.request_bytes = counting
        seen = []
        submit = state.policy.submit
        state.policy.submit = lambda t: (seen.append(t.tokens), submit(t))[1]
        async with serve(create_app(state, health_checks=False)) as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as client:
            r = await client.post(CHAT, json=long_chat(6000, stream=False))
            assert r.status_code == 200
            b_cm, _b_it = await start_b(client)
            r = await client.post(CHAT, json=long_chat(6000, stream=False))  # sliced next to B
            assert r.status_code == 200
            await b_cm.__aexit__(None, None, None)
    exact = len(render_chat(long_chat(6000)["messages"]))
    assert seen[0] == seen[-1] == exact  # not the 4-bytes-per-token estimate (~1,500)
    assert len(tokenized) == 2  # once per prompt: the slicer reused the ids it was counted with
    assert state.estimator.calibrator.ratio("sim") < 1.5  # learned, from the counts and usage: a byte a token


async def test_a_slow_tokenize_costs_an_arriving_prompt_a_bounded_wait(fake, monkeypatch):
    """slicing auto counts a long prompt on arrival; an upstream slow to /tokenize must not
    hold the request for the whole read_timeout (it goes on with the estimate)."""
    import prefill_gate.proxy.exchange as exchange

    monkeypatch.setattr(exchange, "EXACT_COUNT_TIMEOUT_S", 0.2)
    answer = fake.__call__

    async def slow(request):
        if request.url.path == "/tokenize":
            await asyncio.sleep(30)
        return await answer(request)

    async with proxy_client(slow, slicing="auto", large_prefill_tokens=1000) as (c, state):
        t = asyncio.get_running_loop().time()
        r = await c.post(CHAT, json=chat("x" * 40_000, stream=False))
        assert r.status_code == 200 and asyncio.get_running_loop().time() - t < 2.0


async def test_a_hold_that_outlives_its_prediction_is_decided_again():
    """Auto holds a prompt while the chooser predicts the live streams end first; if they
    have not ended when the prediction runs out, the gate asks again (here: slice), rather
    than leaving the prompt held until its wait bound."""
    import time

    from prefill_gate.proxy.gate import Gate

    answers = iter([False, True])
    asked = []

    def chooser(ticket, up):
        asked.append(time.monotonic())
        slice_it = next(answers, True)
        if not slice_it:
            ticket.recheck_at = time.monotonic() + 0.1  # the chooser's predicted end of the hold
        return slice_it

    p = AdmissionPolicy(("u1",), Limits(slicing=Slicing.AUTO, max_queue_wait=30.0), chooser=chooser)
    p.upstreams["u1"].can_slice = True
    live_stream(p)  # a stream that does not end
    a = long_ticket()
    start = time.monotonic()
    async with Gate(p).admission(a) as lease:
        assert lease.slicing
    assert 0.09 < time.monotonic() - start < 1.0 and len(asked) == 2


async def test_a_paced_upstream_is_not_asked_to_count_a_long_prompt():
    """Slicing auto counts a large prompt exactly on arrival (/tokenize) to weigh holding
    against slicing. Where no upstream can be sliced (here: it paces its own steps) there is
    nothing to weigh: the prompt goes on its estimate, and the upstream tokenizes it once."""
    from conftest import FakeVLLM, chat, proxy_client

    from prefill_gate.engine_info import EngineInfo
    from prefill_gate.proxy.capabilities import Capabilities

    fake = FakeVLLM()
    async with proxy_client(fake, slicing="auto") as (client, state):
        state.set_capabilities(state.settings.upstreams[0], Capabilities(16, True, True, EngineInfo("adaptive")))
        assert state.policy.upstreams[state.settings.upstreams[0]].paced
        r = await client.post("/v1/chat/completions", json=chat("x" * 60_000, max_tokens=1))
        assert r.status_code == 200
        assert [q.url.path for q in fake.requests] == ["/v1/chat/completions"]
        # A sliceable upstream is asked, as before.
        state.set_capabilities(state.settings.upstreams[0], Capabilities(16, True, True))
        r = await client.post("/v1/chat/completions", json=chat("y" * 60_000, max_tokens=1))
        assert [q.url.path for q in fake.requests][1:] == ["/tokenize", "/v1/chat/completions"]
