"""What each upstream probably still holds in its prefix cache.

Agents re-send the whole conversation every turn; vLLM's prefix cache makes all of it
free but the new tail. The proxy remembers, per upstream, hashes of the message-list
prefixes it sent (each with its estimated token count), in a bounded LRU. A new chat
request's cached part is its longest remembered prefix; only the rest is prefill work.
It is an estimate: vLLM may have evicted blocks since (the LRU bound stands in for
that), and the assistant's reply, re-sent by the client next turn, is counted as new.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass

# How pickle writes U+D800-U+DFFF (UTF-8 with surrogatepass); valid UTF-8 never holds it.
_MAYBE_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def prefix_hashes(messages: list, salt: str | None = None) -> list[bytes]:
    """h[i] identifies messages[: i + 1] (chained, so equal hashes mean equal prefixes). A
    ``cache_salt`` starts the chain: vLLM shares cached blocks only between requests with the
    same salt, and so does this memory (nor can one salt's requests learn of another's).

    A message is hashed as pickled, which is C all the way (a megabyte of text in about 1 ms
    and 150,000 JSON containers in about 50 ms on the 2-core VM, where re-encoding each
    message as sorted JSON took 7-10 ms and 250 ms on the event loop). Pickle writes values,
    dict keys in their order, and an object met twice (by identity) as a back-reference;
    json.loads makes the same objects of the same text, so a message sent again as it was
    sent before hashes the same. One sent again with its keys reordered hashes differently
    and loses only its cache credit: the estimate errs high, the safe side.

    A lone surrogate (JSON's ``\\ud800`` parses; no encoder takes it) raises
    UnicodeEncodeError, which ``prepare`` answers with a 400.

    The hash is BLAKE2b-128, CPython's own: OpenSSL's SHA-256 (hashlib.sha256) looks its
    digest up through its providers on each construction, which on the proxy's loop (the
    CPU's caches full of other requests' work) made this function cost 15 us a one-message
    request against 8.5-9 now (the old docs/RESULTS.md (in git history) 3m)."""
    out = []
    blake2b = hashlib.blake2b
    h = b"" if salt is None else blake2b(b"cache_salt\0" + salt.encode(errors="surrogatepass"), digest_size=16).digest()
    for m in messages:
        d = blake2b(h, digest_size=16)
        data = pickle.dumps(m, protocol=5)
        if _MAYBE_SURROGATE.search(data) is not None:  # a lone surrogate, or a length's or a number's bytes
            json.dumps(m, ensure_ascii=False).encode()  # which: UnicodeEncodeError for a surrogate
        d.update(data)
        h = d.digest()
        out.append(h)
    return out


PER_REQUEST = 64  # prefixes one request may add to an upstream's memory


@dataclass(frozen=True)
class Hit:
    upstream: str
    messages: int  # how many leading messages are cached
    tokens: int  # their estimated tokens


class PrefixMemory:
    def __init__(self, upstreams, capacity: int = 20000):
        self.capacity = capacity
        self._mem: dict[str, OrderedDict[bytes, int]] = {u: OrderedDict() for u in upstreams}

    def longest(self, hashes: list[bytes]) -> Hit | None:
        """The upstream holding the longest prefix of these hashes (the last message excluded:
        at least the newest message is always prefill work)."""
        best: Hit | None = None
        for upstream, mem in self._mem.items():
            for i in range(len(hashes) - 2, -1, -1):
                tokens = mem.get(hashes[i])
                if tokens is not None:
                    if best is None or i + 1 > best.messages:
                        best = Hit(upstream, i + 1, tokens)
                    break
        if best is not None:
            self._mem[best.upstream].move_to_end(hashes[best.messages - 1])
        return best

    def remember(self, upstream: str, hashes: list[bytes], cumulative_tokens: list[int]) -> None:
        """Remember a request's prefixes: its last PER_REQUEST ones (the next turn of a
        conversation extends the whole list, so the longest prefixes are the ones that hit;
        one request of thousands of messages cannot flush everyone else's memory)."""
        mem = self._mem[upstream]
        keep = len(hashes) - PER_REQUEST
        for h, t in list(zip(hashes, cumulative_tokens))[max(0, keep):]:
            mem[h] = t
            mem.move_to_end(h)
        while len(mem) > self.capacity:
            mem.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(m) for m in self._mem.values())
