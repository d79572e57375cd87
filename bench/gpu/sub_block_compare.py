"""PREFILL_GATE_PACING_SUB_BLOCK on a GPU: the same prompts prefilled in whole blocks and below them.

    python3 bench/gpu/sub_block_compare.py URL --control FILE --json OUT.json [--block 1568]

On one paced hybrid server (its pacing read from the control file this script rewrites), each
mode runs the same scenario: stream B decodes, so pacing bounds every step; prompt A (3.5 blocks)
arrives and prefills in bounded steps, then prompt C, A's first two blocks and a tail of its own,
hits the blocks A left in the prefix cache. Modes: `whole`, cap one block (what align mode
allowed), and `sub`, cap 256 with SUB_BLOCK=1 (A's chunks end inside blocks). A per-mode
`cache_salt` keeps one mode's blocks from serving the other. A state slot read or cached wrong
shows as answers that part at once; rounding (chunk boundaries move) may part them late, on
random weights where near ties are common. Random weights also make greedy answers repeat one
token (the H100 run at `943f4b9`: 24 x token 85 for A in both modes), which a wrong state may
not change, so each answer's logprobs (the chosen tokens' and the top 5's) are compared too,
against a control that shows how far they move when the state before C's tail really differs:
C's tail after another first block (`C'`, in the `whole` mode). The states agree when both
modes' answers' logprobs differ by less than CONTROL_SHARE of the control's difference.
Recorded per mode: A's and C's greedy token ids and logprobs, C's cached prompt tokens (>= 2
blocks when the hit happened), B's gaps while A prefilled. When it
ends, however it ends, the control file is left empty: the server's own settings again (the
scheduler layers the file over its environment), so a server started for other rows, as
`CLASS=hybrid SUBBLOCK=1 bench/gpu/defaults_h200.sh` starts it, serves them as before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment  # noqa: E402

CONTROL_SHARE = 0.1  # the modes' logprobs may differ by rounding, far less than a different state moves them
TOP = 5

MODES = {
    "whole": "PREFILL_GATE_PACING=cap\nPREFILL_GATE_PACING_CAP_TOKENS={block}\nPREFILL_GATE_PACING_SUB_BLOCK=0\n",
    "sub": "PREFILL_GATE_PACING=cap\nPREFILL_GATE_PACING_CAP_TOKENS=256\nPREFILL_GATE_PACING_SUB_BLOCK=1\n",
}


def texts(block: int, seed: int = 0) -> tuple[str, str]:
    rng = random.Random(seed)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()

    def text(n: int) -> str:
        out = ""
        while len(out) < n:
            out += rng.choice(words) + " "
        return out[:n]

    a = text(block * 7 // 2)  # the character-level test tokenizer: one character, one token
    return a, a[:2 * block] + text(block + 300)


async def complete(c: httpx.AsyncClient, url: str, prompt: str, salt: str) -> dict:
    r = await c.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "seed": 0, "ignore_eos": True,
        "return_token_ids": True, "cache_salt": salt, "logprobs": TOP})
    r.raise_for_status()
    body = r.json()
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    choice = body["choices"][0]
    logprobs = choice.get("logprobs") or {}
    return {"token_ids": choice.get("token_ids"), "cached_tokens": details.get("cached_tokens"),
            "logprobs": logprobs.get("token_logprobs"), "top_logprobs": logprobs.get("top_logprobs")}


async def stream_b(c: httpx.AsyncClient, url: str, started: asyncio.Event, stamps: list[float]) -> None:
    async with c.stream("POST", url + "/v1/completions", json={
            "model": "m", "prompt": "a stream that decodes throughout", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
                started.set()


def other_first_block(text: str, block: int) -> str:
    """``text`` with its first block replaced by another of the same length (C', the control)."""
    words = "one two six ten red big old new far low".split()
    rng, out = random.Random(1), ""
    while len(out) < block:
        out += rng.choice(words) + " "
    return out[:block] + text[block:]


def logprob_diff(x: dict, y: dict) -> float | None:
    """The largest difference between two answers' logprobs, over the tokens where their greedy
    answers still agree: the chosen token's, and each top-``TOP`` token both list. None when an
    answer has none."""
    if not x.get("logprobs") or not y.get("logprobs"):
        return None
    same = parts_at(x["token_ids"], y["token_ids"])
    n = min(len(x["logprobs"]), len(y["logprobs"])) if same is None else same
    diffs = [abs(a - b) for a, b in zip(x["logprobs"][:n], y["logprobs"][:n]) if a is not None and b is not None]
    for tx, ty in zip((x.get("top_logprobs") or [])[:n], (y.get("top_logprobs") or [])[:n]):
        diffs += [abs(tx[k] - ty[k]) for k in (tx or {}).keys() & (ty or {}).keys()]
    return max(diffs, default=None)


async def scenario(url: str, mode: str, a_text: str, c_text: str, block: int = 1568) -> dict:
    async with httpx.AsyncClient(timeout=300) as c:
        started, stamps = asyncio.Event(), []
        b = asyncio.create_task(stream_b(c, url, started, stamps))
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        a = await complete(c, url, a_text, f"sub-block-{mode}")
        t1 = time.perf_counter()
        cc = await complete(c, url, c_text, f"sub-block-{mode}")
        other = await complete(c, url, other_first_block(c_text, block), f"sub-block-{mode}-other") \
            if mode == "whole" else None
        b.cancel()
    gaps = [(y - x) * 1e3 for x, y in zip(stamps, stamps[1:]) if t0 <= y <= t1]
    return {"a": a, "c": cc, **({"c_other": other} if other else {}), "a_seconds": t1 - t0, "b_gaps_during_a_ms": {
        "n": len(gaps), "p50": sorted(gaps)[len(gaps) // 2] if gaps else None, "max": max(gaps, default=None)}}


def write_control(path: str, text: str) -> None:
    """Replace the control file at once (the scheduler polls it and must never read half)."""
    Path(path + ".tmp").write_text(text)
    Path(path + ".tmp").replace(path)


def parts_at(x: list | None, y: list | None) -> int | None:
    if x is None or y is None:
        return None
    return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None if len(x) == len(y) else min(len(x), len(y)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--control", required=True, help="the server's PREFILL_GATE_PACING_CONTROL_FILE")
    p.add_argument("--block", type=int, default=1568)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    url = args.url.rstrip("/")
    a_text, c_text = texts(args.block)
    runs = {}
    try:
        for mode, control in MODES.items():
            write_control(args.control, control.format(block=args.block))
            time.sleep(1.0)  # the scheduler polls the file every 0.2 s
            runs[mode] = asyncio.run(scenario(url, mode, a_text, c_text, args.block))
            r = runs[mode]
            print(f"{mode}: A {r['a_seconds']:.2f} s, B's gaps during A p50/max {r['b_gaps_during_a_ms']['p50']}/"
                  f"{r['b_gaps_during_a_ms']['max']} ms, C cached {r['c']['cached_tokens']}", flush=True)
    finally:
        write_control(args.control, "# empty: the server's own settings (sub_block_compare.py ended)\n")
        time.sleep(1.0)
    whole, sub = runs["whole"], runs["sub"]
    verdict = {
        "a_identical": whole["a"]["token_ids"] == sub["a"]["token_ids"],
        "a_parts_at": parts_at(whole["a"]["token_ids"], sub["a"]["token_ids"]),
        "c_identical": whole["c"]["token_ids"] == sub["c"]["token_ids"],
        "c_parts_at": parts_at(whole["c"]["token_ids"], sub["c"]["token_ids"]),
        "c_hit_both": all((r["c"]["cached_tokens"] or 0) >= 2 * args.block for r in runs.values()),
        "a_logprob_diff": logprob_diff(whole["a"], sub["a"]),
        "c_logprob_diff": logprob_diff(whole["c"], sub["c"]),
        "control_logprob_diff": logprob_diff(whole["c"], whole["c_other"]) if "c_other" in whole else None,
    }
    diffs = (verdict["a_logprob_diff"], verdict["c_logprob_diff"], verdict["control_logprob_diff"])
    verdict["states_agree"] = None if None in diffs else max(diffs[:2]) < CONTROL_SHARE * diffs[2]
    print(json.dumps(verdict))
    Path(args.json).write_text(json.dumps({"bench": "sub_block_compare", "url": url, "block": args.block,
                                           "runs": runs, **verdict, **environment()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
