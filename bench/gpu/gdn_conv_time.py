"""The host's time to launch one GDN layer's convolution: vLLM's ``causal_conv1d_fn`` against ours.

    python3 bench/gpu/gdn_conv_time.py --json OUT.json [--calls 200] [--repeats 7] [--prompt 300]
    python3 bench/gpu/gdn_conv_time.py --json OUT.json --device cpu --small   # under TRITON_INTERPRET=1

In a mixed step the GDN patch runs the layer's convolution, then our recurrence, 48 times on
the 27B hybrid, on the host, while the streams wait. This times the convolution alone, on a
layer of the 27B's width (10,240 channels, bf16, the state dim-first): 4 decodes and a 300-token
prompt, ``--calls`` calls back to back without waiting for the GPU (the loop's wall time is the
host's), the fastest of ``--repeats`` loops, for three ways, alternating:

- vLLM's ``causal_conv1d_fn`` with the chunk lists its GDN metadata builder makes for the step
  (the call the patch makes with ``PREFILL_GATE_GDN_CONV=vllm``);
- ours (``prefill_gate.kernels.causal_conv``, ``PREFILL_GATE_GDN_CONV=ours``) with fast launches;
- ours through Triton's own launch (``PREFILL_GATE_FAST_LAUNCH=off``).

Then the GPU's time a call (CUDA events) and whether all three gave the same bits (outputs and
states). With ``--device cpu --small`` (Triton's interpreter, float32, a narrow layer) it runs the
same code end to end: a check of the bench, not a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_timing import time_ways  # noqa: E402
from prefill_gate.proxy.bench.report import environment, table  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a 96-channel layer in float32 (the interpreter's check)")
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import torch

    if args.device == "cpu":  # vLLM's kernels need CUDA_VISIBLE_DEVICES empty to run under the interpreter
        import vllm.utils.torch_utils
        import vllm.v1.attention.backends.utils as backend_utils

        vllm.utils.torch_utils.PIN_MEMORY = backend_utils.PIN_MEMORY = False
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    from prefill_gate.kernels import causal_conv
    from prefill_gate.kernels.launch import Launcher

    if args.device == "cpu":
        from tests.kernel_tests.test_causal_conv import _static_grid_for_the_interpreter

        _static_grid_for_the_interpreter()
    device, dtype = torch.device(args.device), torch.float32 if args.small else torch.bfloat16
    dim = 96 if args.small else (2 * 16 + 48) * 128
    lens = [1] * args.decodes + [args.prompt]
    tokens, seqs = sum(lens), len(lens)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(dtype).to(device)
    weight = (torch.randn(dim, causal_conv.WIDTH, generator=g) * 0.5).to(dtype).to(device)
    bias = (torch.randn(dim, generator=g) * 0.1).to(dtype).to(device)
    state0 = torch.randn(seqs + 1, dim, causal_conv.WIDTH - 1, generator=g).to(dtype).to(device)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)
    slots = torch.arange(1, seqs + 1, dtype=torch.int32).to(device)
    has_initial = torch.tensor([True] * args.decodes + [False]).to(device)
    nums, batch_ptr, offsets = compute_causal_conv1d_metadata(starts.cpu(), device=device)
    metadata = SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)
    launchers = {"ours, fast launch": Launcher(causal_conv._causal_conv_kernel, enabled=True),
                 "ours, Triton's launch": Launcher(causal_conv._causal_conv_kernel, enabled=False)}

    def vllms(state):
        return causal_conv1d_fn(x.transpose(0, 1), weight, bias, activation="silu", conv_states=state,
                                has_initial_state=has_initial, cache_indices=slots, query_start_loc=starts,
                                metadata=metadata).transpose(0, 1)

    def ours(launcher):
        def call(state):
            causal_conv._launch = launcher
            return causal_conv.causal_conv(x, weight, bias, state, slots, has_initial, starts)
        return call

    ways = {"vLLM's causal_conv1d_fn": vllms, **{name: ours(launcher) for name, launcher in launchers.items()}}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host, bits, gpu_us = time_ways(ways, state0, args.calls, args.repeats, sync, cuda=device.type == "cuda")
    rows = [{"conv": name, "host_us": round(min(host[name]), 1), "host_us_max": round(max(host[name]), 1),
             "gpu_us": gpu_us[name]} for name in ways]
    theirs = bits["vLLM's causal_conv1d_fn"]
    same = all(torch.equal(o, theirs[0]) and torch.equal(s, theirs[1]) for o, s in bits.values())
    for row in rows:
        row["x_vllm"] = round(row["host_us"] / rows[0]["host_us"], 3)
        row["a_step_ms"] = round(row["host_us"] * 48 / 1e3, 2)
    columns = [("conv", "convolution"), ("host_us", "host us a call (min)"), ("host_us_max", "max"),
               ("x_vllm", "x vLLM's"), ("a_step_ms", "x 48 layers, ms"), ("gpu_us", "GPU us a call")]
    print(table(rows, columns))
    print(f"same bits all ways: {same}")
    Path(args.json).write_text(json.dumps({"bench": "gdn_conv_time", "rows": rows, "same_bits": same,
                                           "calls": args.calls, "repeats": args.repeats, "prompt": args.prompt,
                                           "decodes": args.decodes, "dim": dim, "dtype": str(dtype),
                                           "host_us_all": host, "command": " ".join(sys.argv), **environment()},
                                          indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
