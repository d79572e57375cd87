"""What a new proxy's first long prompt waits, against the same prompt once the proxy is warm.

    python3 bench/first_prompt.py [--kind tool:110000] [--rounds 5] [--settle 3] [--baseline DIR]
                                  [--json F]

Each round starts a fresh ``prefill-gate serve`` (the real command) in front of
``bench-upstream``, which answers at once, waits ``--settle`` seconds (a user's first request
comes a little after the proxy is up), then sends one agent-sized chat request (``--kind``, as
in ``bench/big_bodies.py``: ``tool:110000`` is ~110 KB, about a 28k-token prompt) and the same
request again, and times each from its last byte sent to its answer's first. The proxy reads
a body that big in a worker process (``offload_body_bytes``); started with the first such
body, the spawn is part of that request's time. ``--baseline DIR`` runs another checkout's
proxy (``git worktree add DIR COMMIT``) in the same rounds, alternating which goes first.
Every request is interactive (``large_prefill_tokens`` at 10^9): what is measured is the
proxy reading the request, not the gate.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from big_bodies import ALL_INTERACTIVE, _post, body_of  # noqa: E402
from prefill_gate.proxy.bench.report import environment, percentile, table, write_json  # noqa: E402
from prefill_gate.proxy.bench.services import Service  # noqa: E402

COLUMNS = [("target", "target"), ("request", "request"), ("n", "rounds"), ("p50", "first byte p50 ms"),
           ("range", "range ms"), ("max", "max ms")]


async def _first_byte(url: str, body: bytes) -> float:
    answered: list[bool] = []
    firsts: list[float] = []
    await asyncio.wait_for(_post(url, body, answered, firsts), 60)
    if not (answered and answered[0] and firsts):
        raise SystemExit(f"{url}: the request was not answered")
    return firsts[0] * 1e3


def _round(target_dir: str | None, upstream: str, body: bytes, settle: float, name: str) -> dict:
    with Service("serve", "--upstream", upstream, "--log-level", "warning", name=name, cwd=target_dir,
                 env=ALL_INTERACTIVE) as proxy:
        time.sleep(settle)
        first = asyncio.run(_first_byte(proxy.url, body))
        second = asyncio.run(_first_byte(proxy.url, body))
    return {"first": first, "second": second}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="tool:110000", help="the request (bench/big_bodies.py's kinds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between the proxy's start and the request")
    ap.add_argument("--baseline", help="another checkout: its proxy beside this one")
    ap.add_argument("--baseline-commit", help="the baseline's commit, where DIR is a copy without .git")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    body = body_of(args.kind)
    if body is None:
        raise SystemExit("--kind none sends nothing: name a request (tool:BYTES or parts:N)")
    targets: dict[str, str | None] = {"prefill-gate": None}
    if args.baseline:
        commit = args.baseline_commit or subprocess.run(
            ["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
            text=True).stdout.strip()
        targets[f"prefill-gate@{commit}"] = str(pathlib.Path(args.baseline).resolve())
    runs: dict[str, list[dict]] = {t: [] for t in targets}
    with Service("bench-upstream", name="stamp") as up:
        direct = [asyncio.run(_first_byte(up.url, body)) for _ in range(args.rounds)]
        order = list(targets)
        for r in range(args.rounds):
            for t in (order if r % 2 == 0 else order[::-1]):
                res = _round(targets[t], up.url, body, args.settle, t)
                runs[t].append(res)
                print(f"round {r} {t}: first {res['first']:.1f} ms, second {res['second']:.1f} ms", flush=True)

    def row(target: str, request: str, ms: list[float]) -> dict:
        return {"target": target, "request": request, "n": len(ms), "p50": f"{statistics.median(ms):.1f}",
                "range": f"{min(ms):.1f}-{max(ms):.1f}", "max": f"{max(ms):.1f}",
                "p99": percentile(ms, 99)}

    rows = [row("upstream direct", "any", direct)]
    for t, rs in runs.items():
        rows += [row(t, "first", [r["first"] for r in rs]), row(t, "second", [r["second"] for r in rs])]
    print(table(rows, COLUMNS))
    if args.json:
        write_json(args.json, {**environment(), "args": vars(args), "body_bytes": len(body), "rows": rows,
                               "direct_ms": direct, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
