"""One loop for the GDN benches' "host time a call" (bench/gpu/gdn_conv_time.py, gdn_launch_time.py).

``time_ways(ways, state0, calls, repeats, sync, cuda)``: each way is ``fn(state) -> output``,
called on its own copy of ``state0``. Every way is warmed (compiled, kept), then ``repeats``
rounds time ``calls`` back-to-back calls of each way in turn without waiting for the GPU (the
loop's wall time is the host's), synchronising only between loops. After: one more call per
way for its bits (output and state, copied), and with ``cuda`` the GPU's time a call (CUDA
events over 20 calls). Returns ``(host_us, bits, gpu_us)``, each a dict by way: every
round's host microseconds a call, ``(output, state)``, and GPU microseconds a call (None
without ``cuda``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def time_ways(ways: dict[str, Callable], state0, calls: int, repeats: int, sync: Callable[[], None],
              cuda: bool) -> tuple[dict, dict, dict]:
    for fn in ways.values():  # warm: compiled, kept
        state = state0.clone()
        for _ in range(3):
            fn(state)
    sync()
    host = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            state = state0.clone()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(state)
            host[name].append((time.perf_counter() - t0) / calls * 1e6)
            sync()
    bits, gpu_us = {}, {}
    for name, fn in ways.items():
        state = state0.clone()
        out = fn(state)
        sync()
        bits[name] = (out.clone(), state.clone())
        gpu_us[name] = None
        if cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn(state)
            end.record()
            sync()
            gpu_us[name] = round(start.elapsed_time(end) / 20 * 1e3, 1)
    return host, bits, gpu_us
