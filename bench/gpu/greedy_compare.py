"""Greedy outputs of two servers for the same prompts: how many agree, and where they part.

    python3 bench/gpu/greedy_compare.py URL_A URL_B --json OUT.json

Each prompt (short, varied lengths: the steps the GDN patch takes) goes to both at temperature 0
with the same seed; the answers' token ids are compared (``return_token_ids``). A patch that is
bit-exact gives identical answers; one that changes rounding (engine_patches.gdn's prompts)
may part after some tokens on random weights, where near ties are common: the fraction that
agree in full and the first token where each pair parts are the record, not a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import environment  # noqa: E402


async def answer(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list:
    r = await c.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
        "return_token_ids": True, "ignore_eos": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice.get("token_ids") or list(choice["text"])  # characters, where no ids come back


async def run(a: str, b: str, prompts: list[str], max_tokens: int) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for p in prompts:
            x, y = await answer(c, a, p, max_tokens), await answer(c, b, p, max_tokens)
            parts = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
            out.append({"prompt_chars": len(p), "tokens": len(x), "identical": x == y, "first_difference": parts})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url_a")
    p.add_argument("url_b")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    rng = random.Random(0)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 300))) for _ in range(args.prompts)]
    rows = asyncio.run(run(args.url_a.rstrip("/"), args.url_b.rstrip("/"), prompts, args.max_tokens))
    same = sum(r["identical"] for r in rows)
    print(f"identical answers: {same}/{len(rows)}; first differences at tokens "
          f"{[r['first_difference'] for r in rows if not r['identical']]}")
    Path(args.json).write_text(json.dumps({"bench": "greedy_compare", "a": args.url_a, "b": args.url_b,
                                           "identical": same, "rows": rows, **environment()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
