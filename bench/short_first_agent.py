"""How often short-first pacing misjudges a prompt on an agent-style workload (CPU).

    .venv/bin/python bench/short_first_agent.py [--agents 4] [--turns 12] [--json F]

vLLM 0.26's real scheduler (the engine tests' harness, no model) with prefix caching on,
paced (cap 256, SHORT_TOKENS 1024): one stream decodes throughout; several agents each
re-send their whole conversation every turn, adding a short user message or a tool
result (500-8000 tokens); a fresh 20k-token prompt arrives now and then. Short-first
classifies a waiting prompt by its tokens minus the prefix vLLM's cache holds when it
looks; the prompt's real prefill work is what the scheduler then computes for it. A
misjudged prompt is one classified on the wrong side of SHORT_TOKENS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHORT_TOKENS = 1024


def run(agents: int, turns: int, seed: int) -> dict:
    os.environ.update(PREFILL_GATE_PACING="cap", PREFILL_GATE_PACING_CAP_TOKENS="256",
                      PREFILL_GATE_PACING_SHORT_TOKENS=str(SHORT_TOKENS), PREFILL_GATE_PACING_LOG_INTERVAL_S="0")
    from prefill_gate.engine_patches.pacing import PacedScheduler
    from prefill_gate.engine_patches.short_first import ShortFirst
    from tests.engine.harness import Engine, build, model_dir

    judged: dict[str, int] = {}  # request id -> remaining tokens as first judged
    remaining = ShortFirst.remaining

    def recording(self, request):
        n = remaining(self, request)
        if request.num_computed_tokens == 0:
            judged.setdefault(request.request_id, n)
        return n

    ShortFirst.remaining = recording
    rng = random.Random(seed)
    engine = Engine(build(PacedScheduler, model_dir(Path(tempfile.mkdtemp())), enable_prefix_caching=True,
                          max_num_seqs=64, num_blocks=40_000), depth=1)

    def words(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    engine.add(0, 100_000, "B", tokens=words(40))
    engine.run(lambda: "B" in engine.first_token)
    history = {a: words(rng.randint(1000, 3000)) for a in range(agents)}
    sent: dict[str, int] = {}
    total: dict[str, int] = {}  # prompt tokens
    pending: list[str] = []
    for t in range(turns):
        for a in range(agents):
            added = words(rng.randint(500, 8000)) if rng.random() < 0.4 else words(rng.randint(100, 300))
            history[a] = history[a] + added
            rid = f"agent{a}-turn{t}"
            engine.add(0, 20, rid, tokens=history[a])
            history[a] = history[a] + words(20)  # the reply the agent keeps
            sent[rid] = len(added)
            total[rid] = len(history[a]) - 20
            pending.append(rid)
            for _ in range(rng.randint(0, 6)):
                engine.step()
        if rng.random() < 0.5:
            rid = f"long-{t}"
            engine.add(0, 10, rid, tokens=words(20_000))
            sent[rid] = total[rid] = 20_000
            pending.append(rid)
        engine.run(lambda: all(r in engine.first_token for r in pending), max_steps=50_000)
    ShortFirst.remaining = remaining
    computed = {rid: 0 for rid in sent}
    for s in engine.steps:
        for rid, n in s.output.num_scheduled_tokens.items():
            if rid in computed and rid not in s.decoding:
                computed[rid] += n
    rows = [{"request": rid, "prompt_tokens": total[rid], "added_tokens": sent[rid],
             "judged_remaining": judged.get(rid), "prefilled": computed[rid]} for rid in sent]
    judged_rows = [r for r in rows if r["judged_remaining"] is not None]
    wrong = [r for r in judged_rows
             if (r["judged_remaining"] <= SHORT_TOKENS) != (r["prefilled"] <= SHORT_TOKENS)]
    return {"bench": "short_first_agent", "agents": agents, "turns": turns, "seed": seed,
            "short_tokens": SHORT_TOKENS, "requests": len(rows), "judged": len(judged_rows),
            "judged_short": sum(r["judged_remaining"] <= SHORT_TOKENS for r in judged_rows),
            "truly_short": sum(r["prefilled"] <= SHORT_TOKENS for r in judged_rows),
            "misjudged": len(wrong), "misjudged_rows": wrong,
            # what judging by prompt length alone (no cache lookup) would have got wrong
            "misjudged_by_length": sum((r["prompt_tokens"] <= SHORT_TOKENS) != (r["prefilled"] <= SHORT_TOKENS)
                                       for r in judged_rows),
            "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args()
    result = run(args.agents, args.turns, args.seed)
    from prefill_gate.proxy.bench.report import environment

    result.update(environment())
    print(f"{result['requests']} prompts, {result['judged']} judged while waiting: "
          f"{result['judged_short']} judged short, {result['truly_short']} truly short, "
          f"{result['misjudged']} misjudged (by prompt length alone: {result['misjudged_by_length']})")
    for r in result["misjudged_rows"]:
        print(f"  {r['request']}: judged {r['judged_remaining']} left, prefilled {r['prefilled']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
