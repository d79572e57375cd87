"""Kernels compiled while vLLM starts, not beside the first live streams.

Triton compiles a kernel the first time it is launched with a new key (its constants, the
dtypes, whether each pointer and integer argument is a multiple of 16, and each integer's being 1). vLLM warms the
kernels it knows before it captures its CUDA graphs (``kernel_warmup``), so that none
compiles while serving; on the report's model class three still did. On a fresh 27B hybrid
server (H100, align-mode prefix caching; bench/results/hybrid/h100/run-acf2645/server-jit.txt)
vLLM's own JIT monitor reported, during service:

- ``_compute_slot_mapping_kernel`` at the first request: vLLM warms it for blocks of 3 and 16
  tokens made of one kernel block each, and align mode's 1,568-token blocks of 16-token
  kernel blocks are another key;
- ``_gated_delta_kernel`` (``prefill_gate.kernels``) at the first short prompt: the GDN patch's
  path runs only for steps with a short prompt, which vLLM's warm-up never makes;
- ``batch_memcpy_kernel``, the recurrent state's copy into the next block's slot, the first time
  a stream crossed a 1,568-token boundary: a new short prompt then cost 4 streams 401 ms
  instead of the ~35 ms the same server's later prompts cost them.

With the GDN patch on, this wraps vLLM's Qwen warm-up (``kernel_warmup.qwen_triton_warmup``,
which vLLM calls for every model and which returns at once for models it does not know) so
that, after vLLM's own, each of these is launched once with the keys the server will use:
the slot mapping on the runner's own block tables with no request (its launch pads nothing),
the state copy with nothing to copy, and our kernel on a step whose sequences all sit in the
null state slot (it returns before touching any state). A warm-up that fails logs a warning
and vLLM starts as it would have: the kernel then compiles in service, as before. Measured
since on a fresh server of the same model and card (bench/results/hybrid/h100/run-ad481ac/):
the JIT monitor reported nothing in service, where the stock server beside it reported two.

It then runs what vLLM runs eagerly on one row per request every step (the output layer, the
greedy pick, the picks' copy to the host) once at every request count from 1 to vLLM's largest
(``--max-num-seqs``, or ``--max-num-batched-tokens`` where that is fewer): every 27B hybrid
server traced had run its first step with 9 requests ~70 ms longer than any later one
(bench/results/hybrid/h100/run-ed51eec/), where vLLM warms these at its largest count only.
Measured since (bench/results/hybrid/h100/run-b088fbb/): that step took 6.9 and 6.1 ms of host
time on two servers warmed so, 71.5 on one with no warm-up, minutes apart on one H100 (the
steady load's worst gap 49.1 and 47.6 ms against 73.0); the warm-up without this stage, at
ed51eec, had left it (70.9 ms). Replayed alone, none of the three ops stalls at a new count
(bench/gpu/first_use.py): the one-time work is somewhere in vLLM's output path around them,
which calling the model's own ``compute_logits`` covers.

    PREFILL_GATE_WARMUP   on    (default) as above, where the GDN patch is on
                          off   vLLM's warm-up alone
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from prefill_gate._env import switch

ENV = "PREFILL_GATE_WARMUP"


class WarmupError(ValueError):
    """PREFILL_GATE_WARMUP holds a value the plugin cannot use."""


def enabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    return switch(ENV, "on", WarmupError, environ)


def slot_mapping(tables, device) -> int:
    """Launch each token-slot block table's slot-mapping kernel with no request: its padding
    program pads from the step's tokens to the table's maximum, here none. Returns the count."""
    import torch

    count = 0
    for table in tables:
        if str(getattr(table.slot_mapping_mode, "value", "")) != "token_to_kv_slot":
            continue  # recurrent-state groups map no token slots (vLLM's call returns at once)
        positions = torch.zeros(table.max_num_batched_tokens, dtype=torch.int64, device=device)
        table.compute_slot_mapping(0, torch.zeros(1, dtype=torch.int32, device=device), positions)
        count += 1
    return count


def state_copy(batch_memcpy, device) -> None:
    """vLLM's batched state copy with one entry of zero bytes (its dtypes: uint64 addresses,
    int32 sizes, as vLLM's copy buffers hold them)."""
    import torch

    batch_memcpy(torch.zeros(1, dtype=torch.uint64, device=device), torch.zeros(1, dtype=torch.uint64, device=device),
                 torch.zeros(1, dtype=torch.int32, device=device))


def gdn_layers(static_forward_context, layer_cls) -> list:
    """The GDN layers (``layer_cls``) that hold their state cache, one per distinct shape."""
    seen, out = set(), []
    for layer in (static_forward_context or {}).values():
        if not isinstance(layer, layer_cls) or len(getattr(layer, "kv_cache", ()) or ()) < 2:
            continue
        key = (tuple(layer.conv1d.weight.shape), layer.conv1d.weight.dtype, tuple(layer.kv_cache[1].shape[1:]),
               layer.kv_cache[1].stride(0))
        if key not in seen:
            seen.add(key)
            out.append(layer)
    return out


def output_layer(runner) -> int:
    """What vLLM runs eagerly on one row per request every step, once at each request count
    from 1 to the runner's largest: the output layer (a GEMM whose kernel cuBLAS picks by the
    row count; CUDA loads a kernel at its first launch), the greedy pick in the sampler's dtypes,
    and the picks' non-blocking copy to the host (a pinned block from PyTorch's caching host
    allocator, sized in powers of two). vLLM warms these at its largest count only. Returns the
    largest count warmed (0 where the runner has no output layer to call)."""
    import torch

    compute_logits = getattr(getattr(runner, "model", None), "compute_logits", None)
    # vLLM's own sampler warm-up's count: a step holds no more requests than tokens
    largest = min(int(getattr(runner, "max_num_reqs", 0) or 0), int(getattr(runner, "max_num_tokens", 1 << 30)))
    if compute_logits is None or largest < 1:
        return 0
    hidden = runner.model_config.get_hidden_size()
    states = torch.rand(largest, hidden, dtype=runner.dtype, device=runner.device)
    for count in range(1, largest + 1):
        logits = compute_logits(states[torch.arange(count, device=runner.device)])
        picks = logits.to(torch.float32).argmax(dim=-1).to(torch.int32).unsqueeze(-1)  # [count, 1], as sampled
        picks.to("cpu", non_blocking=True)
    return largest


def warm(runner, internals, gdn_internals) -> list[str]:
    """Everything above for ``runner`` (vLLM's GPUModelRunner); the names of what was warmed."""
    from prefill_gate.engine_patches import gdn

    device = runner.device
    layers = gdn_layers(getattr(runner.compilation_config, "static_forward_context", None), gdn_internals.layer_cls)
    if not layers:
        return []  # not a GDN hybrid: vLLM's warm-up covers it
    done = []
    tables = getattr(getattr(getattr(runner, "input_batch", None), "block_table", None), "block_tables", ())
    if slot_mapping(tables, device):
        done.append("_compute_slot_mapping_kernel")
    state_copy(internals.batch_memcpy, device)
    done.append("batch_memcpy_kernel")
    settings = getattr(gdn_internals.layer_cls._forward_core, "prefill_gate_settings", None)
    if settings and settings["limit"] > 0:
        for layer in layers:
            gdn.warm_up(layer, conv=settings["conv"], chunk=settings["chunk"], walk=settings["walk"],
                        conv_state_dim_first=settings["conv"] != "ours" or gdn_internals.is_conv_state_dim_first(),
                        max_seqs=getattr(runner, "max_num_reqs", 64))
        done.append("_gated_delta_kernel")
        if settings["conv"] == "ours":
            done.append("_causal_conv_kernel")
    largest = output_layer(runner)
    if largest:
        done.append(f"the output layer at 1-{largest} requests")
    return done


def install(internals, gdn_internals, log: Callable[[str], None], warn: Callable[[str], None]) -> None:
    """Wrap ``kernel_warmup.qwen_triton_warmup`` (once per process) so that ``warm`` follows it."""
    module = internals.kernel_warmup
    original = module.qwen_triton_warmup
    if getattr(original, "prefill_gate_warmup", False):
        return

    @functools.wraps(original)
    def qwen_triton_warmup(runner, model_config):
        original(runner, model_config)
        import torch

        try:
            with torch.inference_mode():
                done = warm(runner, internals, gdn_internals)
                if done and runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
        except Exception as exc:  # a warm-up must never stop vLLM: the kernel then compiles in service
            warn(f"warm-up failed ({type(exc).__name__}: {exc}); those kernels compile at first use instead")
            return
        if done:
            log(f"warmed up before serving ({ENV}): {', '.join(done)}")

    qwen_triton_warmup.prefill_gate_warmup = True
    module.qwen_triton_warmup = qwen_triton_warmup
