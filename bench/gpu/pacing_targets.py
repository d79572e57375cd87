"""Every adaptive pacing run against its target: p99 and max of B's gaps during A, per run.

    python3 bench/gpu/pacing_targets.py bench/results/pacing --json OUT.json

Reads the committed `bench overlap` JSON of each batch (bench/results/pacing/batch-*/
paced*-adaptive-<target>*.json) and prints, per configuration, the ratio of every run's
p99 and maximum gap to the target: the figures the old docs/RESULTS.md (in git history) section 5d cites.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import git_state, table

NAME = re.compile(r"^paced(?:-(?P<kind>full|cold))?-adaptive-(?P<target>\d+)(?P<rest>[-\w]*)\.json$")


def rows(root: pathlib.Path) -> list[dict]:
    out = []
    for path in sorted(root.glob("batch-*/paced*-adaptive-*.json"), key=lambda p: (int(p.parent.name[6:]), p.name)):
        m = NAME.match(path.name)
        if m is None:
            continue
        target = float(m["target"])
        runs = json.loads(path.read_text())["per_run"]
        p99 = [r["overlap_itl_ms_p99"] / target for r in runs]
        mx = [r["overlap_itl_ms_max"] / target for r in runs]
        out.append({"batch": int(path.parent.name[6:]), "config": path.stem, "target_ms": target, "runs": len(runs),
                    "p99_over_target": [round(x, 3) for x in p99], "max_over_target": [round(x, 3) for x in mx],
                    "p99_range": f"{min(p99):.3f}-{max(p99):.3f}", "max_range": f"{min(mx):.3f}-{max(mx):.3f}",
                    "file": str(path)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=pathlib.Path)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    found = rows(args.root)
    print(table(found, [("batch", "batch"), ("config", "config"), ("target_ms", "target ms"), ("runs", "runs"),
                        ("p99_range", "p99 / target"), ("max_range", "max / target")]))
    every_p99 = [x for r in found for x in r["p99_over_target"]]
    every_max = [x for r in found for x in r["max_over_target"]]
    print(f"\n{len(every_p99)} runs: p99 / target {min(every_p99):.3f}-{max(every_p99):.3f}, "
          f"max / target {min(every_max):.3f}-{max(every_max):.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": found, "command": " ".join(sys.argv), **git_state()},
                                                      indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
