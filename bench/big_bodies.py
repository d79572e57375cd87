"""What a big request costs the streams the proxy is already relaying.

    python3 bench/big_bodies.py [--streams 16] [--interval 0.005] [--kinds none,tool:1000000,parts:150000]
                                [--rate 2] [--seconds 8] [--rounds 3] [--baseline DIR] [--json F]

The proxy reads every request body on its event loop (parse, bounds, prefix hashes, the
estimate) before the gate sees it, and every stream it relays waits while it does: an agent's
megabyte of context should not stall the answers streaming beside it. Here ``--streams``
streams run through the proxy without pause (``bench-upstream``, a chunk every ``--interval``
seconds stamped with its write time; each stream starts at a random phase and restarts as it
ends, so they never pause together) while chat requests of one kind arrive at random
(Poisson, ``--rate`` a second):

- ``none``: no big request; the streams' own delay, to compare with.
- ``tool:B``: an agent's conversation of about B bytes, most of it one tool result.
- ``parts:N``: N tiny content parts (the most JSON containers per byte a client can send
  below ``max_json_containers``).

Per turn the table gives the streams' per-chunk delay (arrival minus stamp): p50, p99, p99.9
and max, over ``--rounds`` turns of ``--seconds`` (median and range), how many big requests
were answered, and their own wait: from a big request's last byte sent to its answer's first
(p50; the upstream answers at once, so this is the proxy reading the body). Every request is interactive (``large_prefill_tokens`` at 10^9), so
that the gate answers the big ones at once: what is measured is reading them, not holding
them. The upstream does not parse bodies over 64 KiB (its own loop would stall the stamps it
writes). ``--baseline DIR`` runs another checkout's proxy (``git worktree add DIR COMMIT``) in
the same turns, targets alternating. Placement: the proxy alone on the last CPU, upstream and
load on the others.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefill_gate.proxy.bench.overhead import _one_stream  # noqa: E402
from prefill_gate.proxy.bench.report import environment, percentile, table, write_json  # noqa: E402
from prefill_gate.proxy.bench.services import Service  # noqa: E402

COLUMNS = [("target", "target"), ("kind", "big requests"), ("answered", "answered"), ("p50", "delay p50 ms"),
           ("p99", "p99 ms"), ("p999", "p99.9 ms"), ("max", "max ms"),
           ("big_first_ms_p50", "big request first byte p50 ms")]
ALL_INTERACTIVE = {"PREFILL_GATE_LARGE_PREFILL_TOKENS": str(10**9)}


def body_of(kind: str, seed: int = 0) -> bytes | None:
    """The chat request of ``kind`` (see the module's text), or None for ``none``."""
    name, _, arg = kind.partition(":")
    rnd = random.Random(seed)
    if name == "none":
        return None
    if name == "tool":
        size = int(arg)
        words = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 9))) for _ in range(4000)]
        text = lambda n: " ".join(rnd.choices(words, k=max(1, n // 6)))  # noqa: E731
        messages = [{"role": "system", "content": text(2000)}]
        for i in range(8):
            messages.append({"role": "user", "content": text(300)})
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": text(size // 8 - 400)})
        messages.append({"role": "user", "content": "Fix the failing test."})
    elif name == "parts":
        n = int(arg)
        messages = [{"role": "user", "content": [{"type": "text", "text": "a"} for _ in range(n // 20)]}
                    for _ in range(20)]
    else:
        raise SystemExit(f"unknown kind {kind!r}: none, tool:BYTES or parts:N")
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 2, "stream": True}).encode()


async def _post(url: str, body: bytes, answered: list, firsts: list) -> None:
    """One big request over a raw socket, read to its end; ``firsts`` gets the seconds from
    its last byte sent to its answer's first."""
    host, port = url.split("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        sent = time.monotonic()
        buf = b""
        while b"[DONE]" not in buf and b"HTTP/1.1 4" not in buf[:12]:
            data = await reader.read(65536)
            if not data:
                return
            if not buf:
                firsts.append(time.monotonic() - sent)
            buf = buf[-64:] + data
        answered.append(b"[DONE]" in buf)
    finally:
        writer.close()


async def _turn(url: str, streams: int, interval: float, tokens: int, seconds: float, body: bytes | None,
                rate: float, seed: int) -> dict:
    rnd = random.Random(seed)
    delays: list[float] = []
    answered: list[bool] = []
    firsts: list[float] = []
    await _one_stream(url, 2, 0.001, [], [])  # warm the proxy's upstream pool
    end = time.monotonic() + seconds

    async def live(k: int) -> None:
        await asyncio.sleep(rnd.uniform(0, tokens * interval))  # random phases, never in lockstep
        while time.monotonic() < end:
            await _one_stream(url, tokens, interval, [], delays)

    async def big() -> None:
        posts = []
        while body is not None:
            await asyncio.sleep(rnd.expovariate(rate))
            if time.monotonic() >= end:
                break
            posts.append(asyncio.create_task(_post(url, body, answered, firsts)))
        for p in posts:
            try:
                await asyncio.wait_for(p, 30)
            except (asyncio.TimeoutError, OSError):
                answered.append(False)

    await asyncio.gather(big(), *(live(k) for k in range(streams)))
    ms = [d * 1e3 for d in delays]
    return {"chunks": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99),
            "p999": percentile(ms, 99.9), "max": max(ms) if ms else float("nan"),
            "big_sent": len(answered), "big_answered": sum(answered),
            "big_first_ms_p50": percentile([f * 1e3 for f in firsts], 50),
            "big_first_ms_max": max(firsts) * 1e3 if firsts else float("nan")}


def _run_turn(args: tuple) -> dict:
    """A turn with the load generator's own collector off (its pauses would count as delay)."""
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(_turn(*args))
    finally:
        gc.enable()


def _summary(target: str, kind: str, turns: list[dict]) -> dict:
    row = {"target": target, "kind": kind,
           "answered": f"{sum(t['big_answered'] for t in turns)}/{sum(t['big_sent'] for t in turns)}"}
    for key in ("p50", "p99", "p999", "max", "big_first_ms_p50"):
        vals = [t[key] for t in turns if not math.isnan(t[key])]
        row[key] = f"{statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]" if vals else "-"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between a stream's chunks")
    ap.add_argument("--tokens", type=int, default=200, help="chunks per live stream (then it restarts)")
    ap.add_argument("--kinds", default="none,tool:110000,tool:1000000,parts:150000")
    ap.add_argument("--rate", type=float, default=1.0, help="big requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout: its proxy beside this one")
    ap.add_argument("--baseline-commit", help="the baseline's commit, where DIR is a copy without .git")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    bodies = {k: body_of(k) for k in kinds}
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpu, rest = {cpus[-1]}, set(cpus[:-1]) or {cpus[-1]}
    os.sched_setaffinity(0, rest)
    targets = {"prefill-gate": None}
    if args.baseline:
        commit = args.baseline_commit or subprocess.run(
            ["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
            text=True).stdout.strip()
        targets[f"prefill-gate@{commit}"] = str(pathlib.Path(args.baseline).resolve())
    turns: dict[tuple[str, str], list[dict]] = {(t, k): [] for t in targets for k in kinds}
    with Service("bench-upstream", name="stamp", cpus=rest) as up:
        proxies = {t: Service("serve", "--upstream", up.url, "--log-level", "warning", name=t, cpus=proxy_cpu,
                              cwd=d, env=ALL_INTERACTIVE) for t, d in targets.items()}
        try:
            for r in range(args.rounds):
                for k in kinds:
                    for t, svc in proxies.items():
                        res = _run_turn((svc.url, args.streams, args.interval, args.tokens, args.seconds,
                                         bodies[k], args.rate, 1000 * r + kinds.index(k)))
                        turns[(t, k)].append(res)
                        print(f"round {r} {t} {k}: p99 {res['p99']:.2f} p99.9 {res['p999']:.2f} "
                              f"max {res['max']:.2f} ms, {res['big_answered']}/{res['big_sent']} answered",
                              flush=True)
        finally:
            for svc in proxies.values():
                svc.stop()
    rows = [_summary(t, k, turns[(t, k)]) for t in targets for k in kinds]
    print(table(rows, COLUMNS))
    if args.json:
        write_json(args.json, {**environment(), "args": vars(args),
                               "body_bytes": {k: len(b) if b else 0 for k, b in bodies.items()},
                               "rows": rows, "turns": {f"{t} {k}": v for (t, k), v in turns.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
