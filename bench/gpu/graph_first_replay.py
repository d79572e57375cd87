"""What the first replay of a captured CUDA graph costs, and whether uploading it first helps.

    python3 bench/gpu/graph_first_replay.py --json OUT/graph-first-replay.json

vLLM 0.26 captures its CUDA graphs at start and never replays them before serving
(``CUDAGraphWrapper``: capture, then replay on the next call with that batch descriptor), and
PyTorch instantiates a graph without uploading it, so each capture size's first step in service
pays the upload. On the 27B hybrid a step size's graphs are ~65 pieces (one between each pair of
splitting ops: 16 attention and 48 GDN cores). Here: ``pieces`` graphs of ``nodes`` small kernels
each, captured as vLLM does; the host time of the first replay of all of them in a row against
the second, and the same after ``cuGraphUpload`` on each (the driver's upload, no kernel runs).
Prints a table; the JSON records the machine, versions, command and git commit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

SHAPES = ((1, 400), (1, 2000), (65, 30), (65, 100))  # (pieces, nodes a piece)


def capture(pieces: int, nodes: int, torch) -> list:
    x = torch.zeros(4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for _ in range(pieces):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(nodes):
                x.add_(1.0)
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs


def replay_all(graphs, torch) -> float:
    t0 = time.perf_counter()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from prefill_gate.engine_patches import graph_upload  # the plugin's own upload
    from prefill_gate.proxy.bench import report

    libcuda = ctypes.CDLL("libcuda.so.1")
    rows = []
    for pieces, nodes in SHAPES:
        for upload in (False, True):
            first, second = [], []
            for _ in range(args.repeats):
                graphs = capture(pieces, nodes, torch)
                t_upload = 0.0
                if upload:
                    t0 = time.perf_counter()
                    graph_upload.upload(graphs, torch.cuda.current_stream().cuda_stream, libcuda)
                    torch.cuda.synchronize()
                    t_upload = time.perf_counter() - t0
                first.append(replay_all(graphs, torch))
                second.append(replay_all(graphs, torch))
                del graphs
            row = {"pieces": pieces, "nodes_per_piece": nodes, "uploaded_first": upload,
                   "first_replay_ms": [round(s * 1e3, 3) for s in first],
                   "second_replay_ms": [round(s * 1e3, 3) for s in second],
                   "upload_ms_last": round(t_upload * 1e3, 3)}
            row["first_minus_second_ms_median"] = round(
                statistics.median(f - s for f, s in zip(first, second)) * 1e3, 3)
            rows.append(row)
            print(f"{pieces:>3} x {nodes:>4} nodes  upload={'yes' if upload else 'no ':3}  first "
                  f"{statistics.median(first) * 1e3:7.2f} ms  second {statistics.median(second) * 1e3:7.2f} ms  "
                  f"(first - second, median {row['first_minus_second_ms_median']:.2f} ms)", flush=True)
    out = {"bench": "graph_first_replay", "rows": rows, "cuda": torch.version.cuda, **report.environment()}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
