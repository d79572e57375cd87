"""What one token of a prompt costs our GDN kernel's token walk, per launch shape, read from the
PTX that Triton builds for a GPU that is not here (no GPU needed; counts, not times).

    python3 bench/gdn_walks_aot.py --json bench/results/gdn/walks-aot.json [--arch 90 80]

The walk updates a program's [value rows x 128] float32 state tile once a token, in dependent
order: two reductions over the key dimension per value row (the state times the key, the state
times the query), two for the query's and key's norms, and elementwise work. How those reductions
compile depends on the launch shape (``prefill_gate.kernels.aot.WALKS``: value rows and warps a
program; the first row is the one launch without PREFILL_GATE_GDN_WALK, 32 rows and 4 warps): across lanes they are warp shuffles, across warps barriers and shared memory. Per shape:
the token loop's instructions, shuffles and barriers a warp executes (``aot.token_loop``),
registers and spills, and the issue work one token asks of the whole GPU for one prompt of the
27B hybrid's layer (programs x warps x loop instructions). A GPU run decides what is fastest
(bench/gpu/gdn_kernel_time.py --walks, gdn_sweep.py's wRxW shapes); these say where to look.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from prefill_gate.kernels.aot import HYBRID_27B, WALKS, walk_report  # noqa: E402
from prefill_gate.proxy.bench.report import environment, table, write_json  # noqa: E402

COLUMNS = [("arch", "sm"), ("launch", "launch"), ("rows", "value rows"), ("warps", "warps"), ("instructions", "loop instrs"),
           ("shuffles", "shuffles"), ("barriers", "barriers"), ("shared_stores", "smem stores"),
           ("registers", "regs"), ("spill_stores_bytes", "spill B"), ("programs", "programs"),
           ("warp_instructions_a_token", "warp instrs a token")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="sm_80 and up (bf16)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if min(args.arch) < 80:
        raise SystemExit("--arch: the walk's inputs are bf16, which needs sm_80 or later")
    rows = [row for arch in args.arch
            for row in [walk_report(arch, walk=False), *(walk_report(arch, r, w) for r, w in WALKS)]]
    print(table(rows, COLUMNS))
    write_json(args.json, {"bench": "gdn_walks_aot", "triton": triton.__version__, "sizes": HYBRID_27B,
                           "rows": rows, **environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
