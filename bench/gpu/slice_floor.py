"""Where a slice's time goes: the part of a slice's round trip that is not prefill compute.

    python3 bench/gpu/slice_floor.py --base-url http://127.0.0.1:8001 --json OUT.json

Against a vLLM server (prefix caching on). A 28,600-token prompt is prefilled once, so its
blocks are cached; then requests over its prefixes of N tokens (max_tokens 1) compute one
block at most: their round trip is the floor a slice of a prompt that long pays whatever its
own size, split into what the API server does with N ids (or N characters of text) and
what the engine does on arrival (hashing N tokens' blocks). Each N: alone (the round trip),
and next to a streaming request B (B's largest gap while it is in flight). Then one real
slice: 1,024 new tokens after a cached prefix of N tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment  # noqa: E402

SIZES = (1024, 4096, 8192, 16384, 28600)


async def completion(c: httpx.AsyncClient, url: str, prompt) -> float:
    t = time.monotonic()
    r = await c.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0})
    r.raise_for_status()
    return time.monotonic() - t


async def stream_b(c: httpx.AsyncClient, url: str, stamps: list[float], stop: asyncio.Event) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "b" * 40}], "max_tokens": 4000,
            "stream": True, "ignore_eos": True}
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                stamps.append(time.monotonic())
            if stop.is_set():
                break


async def main(url: str, reps: int) -> dict:
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=120) as c:
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(SIZES[-1]))
        ids = (await c.post(url + "/tokenize", json={"model": "m", "prompt": text})).json()["tokens"]
        await completion(c, url, ids)  # prefill once: every later prefix is cached
        rows = []
        for n in SIZES:
            ids_rtt = [await completion(c, url, ids[:n]) for _ in range(reps)]
            text_rtt = [await completion(c, url, text[:n]) for _ in range(reps)]
            fresh = ids[:n] + [rng.randrange(97, 123) for _ in range(1024)]
            slice_rtt = await completion(c, url, fresh)
            # Next to a stream: B's largest gap while a cached prefix of n ids is in flight.
            stamps: list[float] = []
            stop = asyncio.Event()
            b = asyncio.create_task(stream_b(c, url, stamps, stop))
            while len(stamps) < 50:
                await asyncio.sleep(0.005)
            gaps = []
            for _ in range(reps):
                t0 = time.monotonic()
                await completion(c, url, ids[:n])
                t1 = time.monotonic()
                inside = [s for s in stamps if t0 <= s <= t1 + 0.02]
                gaps.append(max((b_ - a for a, b_ in zip(inside, inside[1:])), default=float("nan")) * 1e3)
                await asyncio.sleep(0.05)
            solo = [b_ - a for a, b_ in zip(stamps[5:45], stamps[6:46])]
            stop.set()
            await b
            rows.append({"tokens": n, "cached_ids_rtt_ms": statistics.median(ids_rtt) * 1e3,
                         "cached_text_rtt_ms": statistics.median(text_rtt) * 1e3,
                         "slice_1024_after_cached_ms": slice_rtt * 1e3,
                         "b_max_gap_ms_during_cached_ids": statistics.median(gaps),
                         "b_gap_ms_solo": statistics.median(solo) * 1e3,
                         "all": {"ids": ids_rtt, "text": text_rtt, "gaps_ms": gaps}})
            print(f"{n:6d} ids {rows[-1]['cached_ids_rtt_ms']:7.1f} ms  text {rows[-1]['cached_text_rtt_ms']:7.1f} ms"
                  f"  +1024 fresh {rows[-1]['slice_1024_after_cached_ms']:7.1f} ms  B max gap "
                  f"{rows[-1]['b_max_gap_ms_during_cached_ids']:6.1f} ms (solo {rows[-1]['b_gap_ms_solo']:.1f})",
                  flush=True)
    return {"bench": "slice_floor", "target": url, "reps": reps, "rows": rows, **environment()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8001")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()
    result = asyncio.run(main(a.base_url, a.reps))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
