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
from collections import OrderedDict
from dataclasses import dataclass


def prefix_hashes(messages: list, salt: str | None = None) -> list[bytes]:
    """h[i] identifies messages[: i + 1] (chained, so equal hashes mean equal prefixes). A
    ``cache_salt`` starts the chain: vLLM shares cached blocks only between requests with the
    same salt, and so does this memory (nor can one salt's requests learn of another's)."""
    out = []
    h = b"" if salt is None else hashlib.blake2b(b"cache_salt\0" + salt.encode(errors="surrogatepass"),
                                                  digest_size=16).digest()
    for m in messages:
        canon = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        h = hashlib.blake2b(h + canon, digest_size=16).digest()
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
