"""The kernel's ahead-of-time compile report for sm_70/80/90 (registers, spills), with the
record every result carries (machine, versions, command, git commit).

    python3 bench/kernel_aot.py --json bench/results/kernel-aot.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from prefill_gate.kernels.aot import all_reports  # noqa: E402
from prefill_gate.proxy.bench.report import environment  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[70, 80, 90])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    rows = all_reports(args.arch, None, args.head_dim)
    record = {"triton": triton.__version__, "reports": rows, **environment()}
    pathlib.Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"{len(rows)} kernels compiled for sm_{', sm_'.join(map(str, args.arch))}: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
