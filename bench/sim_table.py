"""The table of a bench/sim_*.sh run: one row per ``*-seed*.json`` in OUT (``bench defaults``),
the chosen mixed-phase columns of one row and part, written to OUT/table.txt.

    python3 bench/sim_table.py OUT ROW PART KEY=HEADER ...   (KEY ``slices``: the median number of
                                                              slices a prompt, from RUN-slices.log)
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from prefill_gate.proxy.bench.report import table  # noqa: E402


def rows(out: pathlib.Path, row: str, part: str, keys: list[str]) -> list[dict]:
    found = []
    for f in sorted(out.glob("*-seed*.json")):
        d = json.loads(f.read_text())
        mixed = d["rows"][row][part]["mixed"]
        r = {"run": f.stem, "commit": d["git_commit"][:7] + ("+" if d["git_dirty"] else "")}
        for key in keys:
            if key == "slices":
                log = f.with_name(f.stem + "-slices.log")
                counts = [int(x) for x in re.findall(r": (\d+) slices,", log.read_text())] if log.exists() else []
                r[key] = statistics.median(counts) if counts else None
            else:
                r[key] = mixed[key]
        found.append(r)
    return found


def main(argv: list[str]) -> int:
    out, row, part, *columns = argv
    pairs = [c.split("=", 1) for c in columns]
    text = table(rows(pathlib.Path(out), row, part, [k for k, _ in pairs]),
                 [("run", "run"), ("commit", "commit"), *[(k, h) for k, h in pairs]])
    print(text)
    (pathlib.Path(out) / "table.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
