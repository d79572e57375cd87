"""Greedy outputs of two servers for the same prompts: how many agree, and where they part.

    python3 bench/gpu/greedy_compare.py URL_A URL_B --json OUT.json
    python3 bench/gpu/greedy_compare.py URL_A --save A.json            # one server at a time (a card
    python3 bench/gpu/greedy_compare.py URL_B --against A.json --json OUT.json   # that holds one)

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


async def answers(url: str, prompts: list[str], max_tokens: int) -> list[list]:
    async with httpx.AsyncClient(timeout=120) as c:
        return [await answer(c, url, p, max_tokens) for p in prompts]


def compare(prompts: list[str], xs: list[list], ys: list[list]) -> list[dict]:
    out = []
    for p, x, y in zip(prompts, xs, ys, strict=True):
        parts = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if parts is None and len(x) != len(y):
            parts = min(len(x), len(y))
        out.append({"prompt_chars": len(p), "tokens": len(x), "identical": x == y, "first_difference": parts})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url_a")
    p.add_argument("url_b", nargs="?", help="the second server (or --against a saved run of the first)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--save", help="only URL_A: write its answers here, for --against on another server later")
    p.add_argument("--against", help="compare URL_A's answers with those --save wrote (the same prompts)")
    p.add_argument("--json")
    args = p.parse_args()
    if sum(x is not None for x in (args.url_b, args.save, args.against)) != 1 or (args.save is None) == (args.json is None):
        p.error("give URL_B, --save FILE or --against FILE (one of them), and --json unless --save")
    rng = random.Random(0)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 300))) for _ in range(args.prompts)]
    xs = asyncio.run(answers(args.url_a.rstrip("/"), prompts, args.max_tokens))
    if args.save:
        Path(args.save).write_text(json.dumps({"bench": "greedy_answers", "url": args.url_a, "prompts": prompts,
                                               "max_tokens": args.max_tokens, "answers": xs, **environment()}) + "\n")
        print(f"saved {len(xs)} answers of {args.url_a} to {args.save}")
        return 0
    if args.against:
        saved = json.loads(Path(args.against).read_text())
        if saved["prompts"] != prompts or saved["max_tokens"] != args.max_tokens:
            p.error(f"{args.against} holds answers to other prompts (--prompts, --max-tokens must match)")
        a, b, ys, xs = saved["url"] + f" (saved in {args.against})", args.url_a, xs, saved["answers"]
    else:
        a, b = args.url_a, args.url_b
        ys = asyncio.run(answers(args.url_b.rstrip("/"), prompts, args.max_tokens))
    rows = compare(prompts, xs, ys)
    same = sum(r["identical"] for r in rows)
    print(f"identical answers: {same}/{len(rows)}; first differences at tokens "
          f"{[r['first_difference'] for r in rows if not r['identical']]}")
    Path(args.json).write_text(json.dumps({"bench": "greedy_compare", "a": a, "b": b,
                                           "identical": same, "rows": rows, **environment()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
