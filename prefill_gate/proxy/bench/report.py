"""What every benchmark shares: percentiles, the table, the JSON record, the plot."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    xs = sorted(v for v in values if not (isinstance(v, float) and math.isnan(v)))
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def git_state() -> dict:
    """The commit the code was measured with, and whether the tree held changes beyond it.
    Where the tree is a copy without ``.git`` (the lent GPU machine), the scripts pass
    ``PREFILL_GATE_GIT_COMMIT`` and ``PREFILL_GATE_GIT_DIRTY`` (1/0) read where it came from."""
    commit = os.environ.get("PREFILL_GATE_GIT_COMMIT")
    if commit:
        return {"git_commit": commit, "git_dirty": os.environ.get("PREFILL_GATE_GIT_DIRTY", "") == "1"}
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    if head.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def environment() -> dict:
    """Machine, versions, command and git commit, for the record."""
    versions = {}
    for pkg in ("prefill-gate", "httpx", "fastapi", "uvicorn", "vllm", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "machine": {"host": platform.node(), "cpu": _cpu_model(),
                    "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
                    "gpu": gpu},
        "versions": versions,
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + sys.argv[1:]),
        **git_state(),
    }


def _cpu_model() -> str:
    """The CPU's model name where Linux says it (/proc/cpuinfo), else what platform knows: a
    host-bound engine's steps follow it (the 27B hybrid's smallest mixed steps took ~26 ms on one
    H100 machine and ~38 ms on another, decode steps ~20 ms on both)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: ``columns`` is [(key, header)]."""
    cells = [[h for _, h in columns]] + [[_fmt(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep] + body)


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=float) + "\n")


OVERLAP_COLUMNS = [
    ("config", "config"),
    ("solo_itl_ms_p50", "B solo p50 ms"),
    ("solo_itl_ms_p99", "B solo p99 ms"),
    ("overlap_itl_ms_p50", "B overlap p50 ms"),
    ("overlap_itl_ms_p99", "B overlap p99 ms"),
    ("overlap_itl_ms_max", "B overlap max ms"),
    ("overlap_b_tokens_per_s", "B tok/s overlap"),
    ("a_ttft_s", "A TTFT s"),
    ("a_total_s", "A total s"),
    ("a_solo_ttft_s", "A solo TTFT s"),
]


def plot_overlap(results: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """B's inter-token gaps over time in the first overlap run of each result, A's life shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True, sharey=True,
                             squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        run = res["raw"][0]
        b, a = run["b"], run["a"]
        t0 = b["sent"]
        ts = b["tokens"]
        gaps = [(t1 - t0, (t1 - tp) * 1e3) for tp, t1 in zip(ts, ts[1:])]
        ax.plot([g[0] for g in gaps], [g[1] for g in gaps], lw=0.9, marker=".", ms=2.5, color="tab:blue",
                label="B inter-token gap")
        first = a["tokens"][0] if a["tokens"] else a["end"]
        # What a client sees of A: sent, no token yet (held by the gate, or prefilling: the
        # client cannot tell them apart), then streaming.
        ax.axvspan(a["sent"] - t0, first - t0, color="tab:gray", alpha=0.15, label="A waits for its first token")
        ax.axvspan(first - t0, a["end"] - t0, color="tab:orange", alpha=0.25, label="A streams")
        ax.set_yscale("log")
        ax.set_ylabel("B's gap (ms)")
        ax.set_title(f"{res.get('config', res.get('target'))}: B (a streaming answer)'s largest gap while A (a "
                     f"{run.get('a_prompt_tokens', '?')}-token prompt) is in flight {res['overlap_itl_ms_max']:.1f} ms; "
                     f"B alone p50 {res['solo_itl_ms_p50']:.1f} ms", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since B was sent")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
