"""Uncached-tail estimation: a long conversation's new small turn is interactive,
a turn that adds a long tool result is a large prefill."""

import asyncio
import json
import pickle
import random
import struct

import pytest

from conftest import hold_stream, proxy_client

from prefill_gate.proxy.prefix_memory import PrefixMemory, prefix_hashes

CHAT = "/v1/chat/completions"


def msgs(*contents):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]


def test_hashes_chain_and_identify_prefixes():
    a = prefix_hashes(msgs("x", "y", "z"))
    b = prefix_hashes(msgs("x", "y", "other"))
    c = prefix_hashes(msgs("q", "y", "z"))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a[1] != c[1]  # same second message, other history


def _conversation(rnd, n):
    """Chat messages of the shapes agents send: plain text, content parts (the same keys over
    and over), tool calls, one-character strings, non-ASCII and emoji, numbers, null."""
    texts = ["a", "é", "한국어 텍스트", "emoji 😀 here", "x" * 300, "line\nbreak \"quoted\"", ""]
    out = []
    for i in range(n):
        kind = rnd.randrange(3)
        if kind == 0:
            out.append({"role": "user", "content": rnd.choice(texts) + str(i)})
        elif kind == 1:
            out.append({"role": "user", "content": [{"type": "text", "text": rnd.choice(texts)}
                                                    for _ in range(rnd.randint(1, 4))]})
        else:
            out.append({"role": "assistant", "content": None, "weight": rnd.choice([1, 2.5, True, 0.1]),
                        "tool_calls": [{"id": f"c{i}", "type": "function",
                                        "function": {"name": "f", "arguments": rnd.choice(texts)}}]})
    return out


def _sent(rnd, messages):
    """``messages`` as some client writes them, parsed back as the proxy parses them."""
    style = rnd.choice([{}, {"ensure_ascii": False}, {"separators": (",", ":")}, {"indent": 2}])
    return json.loads(json.dumps({"model": "m", "messages": messages}, **style).encode())["messages"]


def test_a_message_hashes_the_same_in_every_turn_however_the_json_was_written():
    rnd = random.Random(7)
    for _ in range(200):
        conv = _conversation(rnd, rnd.randint(2, 12))
        k = rnd.randint(1, len(conv) - 1)
        turn1, turn2 = prefix_hashes(_sent(rnd, conv[:k])), prefix_hashes(_sent(rnd, conv))
        assert turn2[:k] == turn1
        changed = json.loads(json.dumps(conv))
        changed[k - 1]["role"] += "!"
        assert prefix_hashes(_sent(rnd, changed))[k - 1] != turn1[k - 1]


def test_a_lone_surrogate_raises_and_lookalike_bytes_do_not():
    with pytest.raises(UnicodeEncodeError):
        prefix_hashes(json.loads(b'[{"role":"user","content":"x\\ud800"}]'))
    with pytest.raises(UnicodeEncodeError):
        prefix_hashes([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}])
    # Pickled, a number and Korean text can hold the bytes a surrogate would: not refused.
    lookalike = struct.unpack(">d", b"\x3f\xf0\xed\xa0\x00\x00\x00\x00")[0]
    assert b"\xed\xa0" in pickle.dumps(lookalike, protocol=5)
    messages = json.loads(json.dumps([{"role": "user", "content": "한", "w": lookalike}]))
    assert len(prefix_hashes(messages)) == 1


def test_longest_prefix_excludes_the_newest_message_and_picks_the_best_upstream():
    mem = PrefixMemory(["u1", "u2"])
    h = prefix_hashes(msgs("a", "b", "c", "d"))
    mem.remember("u1", h[:1], [100])
    mem.remember("u2", h[:3], [100, 110, 5000])
    hit = mem.longest(h)
    assert (hit.upstream, hit.messages, hit.tokens) == ("u2", 3, 5000)
    assert mem.longest(h[:3]).messages == 2  # the newest message is never cached
    assert mem.longest(prefix_hashes(msgs("z", "b"))) is None


def test_memory_is_bounded_lru():
    mem = PrefixMemory(["u"], capacity=2)
    h = prefix_hashes(msgs("a", "b", "c", "d"))
    mem.remember("u", h[:3], [1, 2, 3])
    assert len(mem) == 2 and mem.longest(h[:2]) is None  # the oldest prefix fell out


async def test_agent_turns_small_tail_runs_tool_result_waits(fake):
    async with proxy_client(fake) as (c, state):
        history = msgs("x" * 240_000, "ok")  # ~60k tokens of conversation, sent while idle
        r = await c.post(CHAT, json={"messages": history + [{"role": "user", "content": "first"}]})
        assert r.status_code == 200
        b = await hold_stream(c, fake, {"messages": msgs("b"), "stream": True, "hold": True})  # another stream decodes from here on

        turn = history + [{"role": "user", "content": "first"}, {"role": "assistant", "content": "done"},
                          {"role": "user", "content": "now a short question"}]
        r = await asyncio.wait_for(c.post(CHAT, json={"messages": turn}), 5)
        assert r.status_code == 200  # not held: only the new tail is prefill work
        tool = turn + [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "y" * 120_000}]
        held = asyncio.create_task(c.post(CHAT, json={"messages": tool}))
        await asyncio.sleep(0.1)
        assert state.policy.queue_depth == 1 and not held.done()  # the 30k-token tool result is large
        fake.release.set()
        await b
        assert (await asyncio.wait_for(held, 5)).status_code == 200
        reg = state.metrics.registry
        assert reg.get_sample_value("prefill_gate_estimated_cached_prompt_tokens_count") == 4
        assert reg.get_sample_value("prefill_gate_admissions_total",
                                    {"class": "interactive", "decision": "immediate"}) == 2
        assert reg.get_sample_value("prefill_gate_admissions_total", {"class": "large", "decision": "after_wait"}) == 1


async def test_prefix_memory_off_counts_whole_prompts(fake):
    async with proxy_client(fake, prefix_memory_entries=0) as (c, state):
        history = msgs("x" * 40_000, "ok")
        await c.post(CHAT, json={"messages": history + [{"role": "user", "content": "q"}]})
        b = await hold_stream(c, fake, {"messages": msgs("b"), "stream": True, "hold": True})
        again = asyncio.create_task(c.post(CHAT, json={"messages": history + [{"role": "user", "content": "q2"}]}))
        await asyncio.sleep(0.1)
        assert state.policy.queue_depth == 1 and not again.done()
        fake.release.set()
        await asyncio.gather(b, again)


async def test_failed_requests_are_not_remembered(fake):
    async with proxy_client(fake) as (c, state):
        history = msgs("x" * 40_000)
        r = await c.post(CHAT, json={"messages": history + [{"role": "user", "content": "q"}], "fail": "500"})
        assert r.status_code == 500 and len(state.prefix_memory) == 0


async def test_reported_usage_makes_the_remembered_prefix_exact_and_counts_evictions(fake):
    async with proxy_client(fake) as (c, state):
        history = msgs("x" * 40_000, "ok")
        first = history + [{"role": "user", "content": "first"}]
        r = await c.post(CHAT, json={"messages": first, "usage_prompt_tokens": 12_345})
        assert r.status_code == 200
        hit = state.prefix_memory.longest(prefix_hashes(first + [{"role": "user", "content": "next"}]))
        assert hit.tokens == 12_345  # the whole list, as the upstream counted it
        reg = state.metrics.registry
        # The next turn is credited ~12k cached tokens; the upstream reports 0 cached: evicted.
        turn = first + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "next"}]
        r = await c.post(CHAT, json={"messages": turn, "usage_cached_tokens": 0})
        assert reg.get_sample_value("prefill_gate_cache_credit_misses_total") == 1
        r = await c.post(CHAT, json={"messages": turn + [{"role": "assistant", "content": "ab"},
                                                          {"role": "user", "content": "more"}],
                                     "usage_cached_tokens": 12_300})
        assert reg.get_sample_value("prefill_gate_cache_credit_misses_total") == 1  # held this time


def test_a_cache_salt_separates_prefixes_as_vllm_does():
    plain, salted, other = (prefix_hashes(msgs("a", "b"), salt) for salt in (None, "s1", "s2"))
    assert len({plain[0], salted[0], other[0]}) == 3  # no salt shares another's prefix
    assert prefix_hashes(msgs("a", "b"), "s1") == salted
    mem = PrefixMemory(["u"])
    mem.remember("u", salted, [10, 20])
    assert mem.longest(plain) is None and mem.longest(other) is None
    assert mem.longest(salted).messages == 1  # (the newest message is always prefill)
