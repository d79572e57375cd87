"""Agent workloads through the proxy, on the simulator: three scenarios, one command.

    prefill-gate bench agent [--preset h200-qwen3-8b] [--json FILE]

1. conversation: one agent conversation grows to ~60k tokens (a short user turn each
   time, a ~12k-token tool result every third turn) while another user's stream B decodes
   (512 tokens, a second of think time, again). Every turn re-sends the whole history, as
   agents do. Per turn: TTFT through the proxy next to B, against the same conversation
   alone straight at a fresh simulator; and B's largest gap while each turn prefilled.
   Short turns must not be held (their uncached tail is small even when the history is
   60k tokens); tool-result turns must not stall B.
2. two upstreams: the seed shape through the proxy in front of two simulators: the large
   prefill goes to the one nobody decodes on, so A is not held and B stays smooth.
3. paced engine: the seed shape against a simulator that paces its steps like
   engine_patches' cap mode, through the proxy holding (default) and with the closed loop
   (``itl_slo_ms``): the loop admits A next to B and B's p95 stays within the SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import time
from dataclasses import dataclass, field

import httpx

from ..relay import is_token
from .overlap import run_overlap
from .report import OVERLAP_COLUMNS, percentile, table, write_json
from .services import Service


@dataclass
class Turn:
    kind: str  # "short" | "tool"
    added_chars: int
    history_chars: int = 0
    sent: float = 0.0
    first: float = 0.0
    ttft: float = float("nan")
    reply: str = ""


@dataclass
class Stream:
    """Another user's answers, one after another, recording every token's arrival."""

    tokens: list[float] = field(default_factory=list)
    stop: bool = False


def _words(rng: random.Random, n_chars: int) -> str:
    out, total = [], 0
    while total < n_chars:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(w)
        total += len(w) + 1
    return " ".join(out)[:n_chars]


def plan_conversation(seed: int, turns: int = 15, short_chars: int = 200, tool_chars: int = 12_000) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [("tool", "tool result: " + _words(rng, tool_chars)) if (i + 1) % 3 == 0
            else ("short", _words(rng, short_chars)) for i in range(turns)]


async def chat_turn(client: httpx.AsyncClient, url: str, messages: list[dict], turn: Turn, max_tokens: int = 32) -> None:
    body = {"model": "sim", "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    turn.sent = time.monotonic()
    parts = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: HTTP {r.status_code} {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.startswith("data: [DONE]"):
                continue
            obj = json.loads(line[5:])
            if is_token(obj):
                if not turn.first:
                    turn.first = time.monotonic()
                choice = next(c for c in obj["choices"] if isinstance(c, dict))
                parts.append((choice.get("delta") or {}).get("content") or "")
    turn.ttft = turn.first - turn.sent
    turn.reply = "".join(parts)


async def run_conversation(url: str, plan: list[tuple[str, str]]) -> list[Turn]:
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    out = []
    async with httpx.AsyncClient(timeout=120) as client:
        for kind, text in plan:
            messages.append({"role": "user", "content": text})
            turn = Turn(kind, len(text), history_chars=sum(len(m["content"]) for m in messages))
            await chat_turn(client, url, messages, turn)
            messages.append({"role": "assistant", "content": turn.reply})
            out.append(turn)
    return out


async def other_user(url: str, stream: Stream, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        while not stream.stop:
            body = {"model": "sim", "messages": [{"role": "user", "content": _words(rng, 40)}],
                    "max_tokens": 512, "stream": True, "ignore_eos": True}
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and not line.startswith("data: [DONE]") \
                            and is_token(json.loads(line[5:])):
                        stream.tokens.append(time.monotonic())
            await asyncio.sleep(1.0)  # think time before the next question


async def conversation_with_stream(url: str, plan) -> tuple[list[Turn], Stream]:
    stream = Stream()
    task = asyncio.create_task(other_user(url, stream, seed=7))
    while len(stream.tokens) < 64:  # B is decoding before the agent starts
        await asyncio.sleep(0.01)
    try:
        turns = await run_conversation(url, plan)
    finally:
        stream.stop = True
        await task
    return turns, stream


def max_gap_in(tokens: list[float], start: float, end: float) -> float:
    gaps = [b - a for a, b in zip(tokens, tokens[1:]) if start < b <= end + 1e-9]
    return max(gaps, default=float("nan"))


def conversation_scenario(preset: str, time_scale: float) -> dict:
    plan = plan_conversation(seed=11)
    sim_args = ["sim", "--preset", preset, "--time-scale", str(time_scale)]
    with Service(*sim_args, name="sim-solo") as solo:
        alone = asyncio.run(run_conversation(solo.url, plan))
    with Service(*sim_args, name="sim") as sim, \
            Service("serve", "--upstream", sim.url, "--log-level", "warning", name="proxy") as gate:
        turns, stream = asyncio.run(conversation_with_stream(gate.url, plan))
        metrics = httpx.get(gate.url + "/metrics").text
    solo_gaps = [b - a for a, b in zip(stream.tokens, stream.tokens[1:]) if b - a < 0.5]
    rows = []
    for i, (t, s) in enumerate(zip(turns, alone)):
        rows.append({"turn": i + 1, "kind": t.kind, "history_chars": t.history_chars,
                     "ttft_ms": t.ttft * 1e3, "solo_ttft_ms": s.ttft * 1e3, "ttft_ratio": t.ttft / s.ttft,
                     "b_max_gap_ms": max_gap_in(stream.tokens, t.sent, t.first) * 1e3})
    short = [r for r in rows if r["kind"] == "short" and r["turn"] > 1]
    tool = [r for r in rows if r["kind"] == "tool"]
    admitted_large = sum(float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith("prefill_gate_admissions_total{") and 'class="large"' in line)
    return {
        "turns": rows,
        "history_chars_final": turns[-1].history_chars,
        "b_gap_ms_p50": percentile(solo_gaps, 50) * 1e3,
        "short_ttft_ratio_p50": percentile([r["ttft_ratio"] for r in short], 50),
        "short_ttft_ratio_max": max(r["ttft_ratio"] for r in short),
        "short_ttft_ms_max": max(r["ttft_ms"] for r in short),
        "tool_b_max_gap_ms": max(r["b_max_gap_ms"] for r in tool if r["b_max_gap_ms"] == r["b_max_gap_ms"]),
        "large_requests": admitted_large,
    }


def two_upstreams_scenario(preset: str, time_scale: float) -> dict:
    sim_args = ["sim", "--preset", preset, "--time-scale", str(time_scale)]
    with Service(*sim_args, name="sim-1") as s1, Service(*sim_args, name="sim-2") as s2, \
            Service("serve", "--upstream", s1.url, "--upstream", s2.url, "--log-level", "warning",
                    name="proxy") as gate:
        result = asyncio.run(run_overlap(gate.url, runs=1, progress=False))
    result["config"] = "proxy, two upstreams"
    return result


def paced_scenario(preset: str, time_scale: float, cap: int, slo_ms: float) -> list[dict]:
    sim_args = ["sim", "--preset", preset, "--time-scale", str(time_scale), "--pacing-cap", str(cap)]
    out = []
    with Service(*sim_args, name="sim-paced") as sim:
        for label, extra in (("paced engine, proxy holding", []),
                             (f"paced engine, proxy closed loop {slo_ms:g} ms", ["--itl-slo-ms", str(slo_ms)])):
            with Service("serve", "--upstream", sim.url, "--log-level", "warning", *extra, name="proxy") as gate:
                result = asyncio.run(run_overlap(gate.url, runs=1, progress=False))
            result["config"] = label
            out.append(result)
    return out


CONV_COLUMNS = [("turn", "turn"), ("kind", "kind"), ("history_chars", "history tokens"), ("ttft_ms", "TTFT ms"),
                ("solo_ttft_ms", "alone TTFT ms"), ("ttft_ratio", "ratio"), ("b_max_gap_ms", "B max gap ms")]


def main(args) -> int:
    def say(text: str) -> None:
        print(f"[agent] {text}", file=sys.stderr)

    say("1/3 conversation to ~60k tokens next to a decoding stream (and alone)")
    conv = conversation_scenario(args.preset, args.time_scale)
    print(table(conv["turns"], CONV_COLUMNS))
    print(f"\nshort turns: TTFT next to B / alone p50 {conv['short_ttft_ratio_p50']:.2f}x, "
          f"max {conv['short_ttft_ratio_max']:.2f}x; tool-result turns: B's largest gap "
          f"{conv['tool_b_max_gap_ms']:.1f} ms (B's p50 {conv['b_gap_ms_p50']:.1f} ms)")
    say("2/3 two upstreams")
    two = two_upstreams_scenario(args.preset, args.time_scale)
    say(f"3/3 paced engine (cap {args.pacing_cap}), holding vs closed loop ({args.slo_ms:g} ms)")
    paced = paced_scenario(args.preset, args.time_scale, args.pacing_cap, args.slo_ms)
    cols = OVERLAP_COLUMNS + [("overlap_itl_ms_p95", "B overlap p95 ms")]
    print()
    print(table([two, *paced], cols))
    if args.json:
        write_json(args.json, {"bench": "agent", "preset": args.preset, "time_scale": args.time_scale,
                               "conversation": conv, "two_upstreams": two, "paced": paced,
                               "pacing_cap": args.pacing_cap, "slo_ms": args.slo_ms})
        print(f"\nwrote {args.json}")
    return 0
