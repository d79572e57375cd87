"""Write prefill-gate's dist-info (its entry points) for a machine that runs the checkout from
source: vLLM finds the engine patches' plugin and stat logger through entry points, which a
plain PYTHONPATH to the tree does not give.

    python3 bench/gpu/dist_info.py .gpu/ep      # then, there: PYTHONPATH=...:$PWD/.gpu/ep
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(out: str) -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = project["name"].replace("-", "_")
    folder = Path(out) / f"{name}-{project['version']}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (folder / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()))
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu/ep"))
