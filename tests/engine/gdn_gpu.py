"""One mixed GDN step through vLLM 0.26's own core and through engine_patches.gdn's, on a GPU.

A layer the size of the 27B hybrid's (16 key heads and 48 value heads of 128 per GPU, conv
width 4) as the attributes vLLM's ``_forward_core`` reads, its metadata built with the
helpers vLLM's ``GDNAttentionMetadataBuilder`` calls, and vLLM's chunked prefill op called as
its Triton backend does (``forward_native``). Both paths start from the same conv and
recurrent states; the comparison is of the outputs and of the states they leave.

Used by tests/engine/test_gdn.py (GPU-marked) and bench/gpu/gdn_h200.sh, which also times both.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

SIZES = {"H": 16, "HV": 48, "K": 128, "V": 128}  # the 27B hybrid's, per GPU
WIDTH = 4


def make_layer(slots: int, seed: int = 0, dtype=torch.bfloat16, device="cuda", sizes: dict = SIZES):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

    H, HV, K, V = (sizes[k] for k in ("H", "HV", "K", "V"))
    g = torch.Generator(device=device).manual_seed(seed)
    dim = 2 * H * K + HV * V
    conv_layout = (dim, WIDTH - 1) if is_conv_state_dim_first() else (WIDTH - 1, dim)  # vLLM's DS or SD
    layer = SimpleNamespace(
        prefix="model.layers.0.linear_attn", tp_size=1, activation="silu", key_dim=H * K, value_dim=HV * V,
        num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, enable_packed_recurrent_decode=False,
        conv1d=SimpleNamespace(weight=(torch.randn(dim, 1, WIDTH, generator=g, device=device) * 0.3).to(dtype),
                               bias=(torch.randn(dim, generator=g, device=device) * 0.1).to(dtype)),
        A_log=torch.randn(HV, generator=g, device=device) * 0.5,
        dt_bias=torch.randn(HV, generator=g, device=device) * 0.5,
        kv_cache=(torch.randn(slots, *conv_layout, generator=g, device=device).to(dtype),
                  torch.randn(slots, HV, V, K, generator=g, device=device) * 0.1),
    )
    layer.chunk_gated_delta_rule = lambda **kw: chunk_gated_delta_rule(**kw)  # the Triton backend's forward_native
    layer.rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv.__get__(layer)
    return layer


def make_metadata(decodes: int, prompt_lens: list[int], slots: list[int], has_initial: list[bool],
                  device="cuda"):
    """What GDNAttentionMetadataBuilder.build gives a non-speculative mixed step (decodes first)."""
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    lens = [1] * decodes + prompt_lens
    qsl_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qsl = qsl_cpu.to(device)
    indices = torch.tensor(slots, dtype=torch.int32, device=device)
    initial = torch.tensor(has_initial, device=device)
    prefill_qsl_cpu = qsl_cpu[decodes:] - decodes
    nums_dict, batch_ptr, token_chunk_offset_ptr = compute_causal_conv1d_metadata(qsl_cpu, device=qsl.device)
    return GDNAttentionMetadata(
        num_prefills=len(prompt_lens), num_prefill_tokens=sum(prompt_lens), num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=sum(lens),
        has_initial_state=initial, non_spec_query_start_loc=qsl, non_spec_state_indices_tensor=indices,
        chunk_indices=prepare_chunk_indices(prefill_qsl_cpu, FLA_CHUNK_SIZE).to(device),
        chunk_offsets=prepare_chunk_offsets(prefill_qsl_cpu, FLA_CHUNK_SIZE).to(device),
        prefill_query_start_loc=prefill_qsl_cpu.to(device), prefill_state_indices=indices[decodes:],
        prefill_has_initial_state=initial[decodes:], nums_dict=nums_dict, batch_ptr=batch_ptr,
        token_chunk_offset_ptr=token_chunk_offset_ptr)


def compare_paths(prompt_lens: list[int], decodes: int, seed: int = 0, timing_runs: int = 0, device="cuda",
                  sizes: dict | None = None, launch: dict | None = None) -> dict:
    """Run one step both ways; relative max errors of the outputs and the states, whether the
    decodes' outputs are identical, and (``timing_runs``) each path's time per call: until the
    calls returned (the host launching) and until the GPU finished (states reused, not reset).
    ``launch``: our kernel's launch shape (block_v, stages)."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as qwen

    from prefill_gate.engine_patches import _vllm, gdn

    internals = _vllm.gdn_internals()
    stock_core = getattr(qwen.QwenGatedDeltaNetAttention._forward_core, "__wrapped__",
                         qwen.QwenGatedDeltaNetAttention._forward_core)
    seqs = decodes + len(prompt_lens)
    slots = list(range(1, seqs + 1))
    has_initial = [True] * decodes + [i % 2 == 0 for i in range(len(prompt_lens))]  # fresh and continuing prompts
    md = make_metadata(decodes, prompt_lens, slots, has_initial, device)
    tokens = md.num_actual_tokens
    sizes = sizes or SIZES
    H, HV, K, V = (sizes[k] for k in ("H", "HV", "K", "V"))
    layer = make_layer(seqs + 2, seed, device=device, sizes=sizes)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    mixed = torch.randn(tokens, 2 * H * K + HV * V, generator=g, device=device).to(torch.bfloat16)
    b = torch.randn(tokens, HV, generator=g, device=device).to(torch.bfloat16)
    a = torch.randn(tokens, HV, generator=g, device=device).to(torch.bfloat16)
    start = tuple(t.clone() for t in layer.kv_cache)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    context = SimpleNamespace(attn_metadata={layer.prefix: md})
    saved = qwen.get_forward_context
    qwen.get_forward_context = lambda: context
    try:
        def stock(fresh=True):
            if fresh:
                layer.kv_cache = tuple(t.clone() for t in start)
            out = torch.zeros(tokens, HV, V, dtype=torch.bfloat16, device=device)
            stock_core(layer, mixed_qkv=mixed, b=b, a=a, core_attn_out=out)
            return out, layer.kv_cache

        def ours(fresh=True):
            if fresh:
                layer.kv_cache = tuple(t.clone() for t in start)
            out = torch.zeros(tokens, HV, V, dtype=torch.bfloat16, device=device)
            gdn.recurrent_core(layer, mixed, b, a, out, md, internals, **(launch or {}))
            return out, layer.kv_cache

        (o1, (c1, s1)), (o2, (c2, s2)) = stock(), ours()
        sync()
        errors = {"out_rel": rel(o2, o1), "state_rel": rel(s2, s1), "conv_state_equal": bool(torch.equal(c1, c2)),
                  "decode_out_equal": bool(torch.equal(o1[:decodes], o2[:decodes]))}  # before timing reuses the states
        times = {}
        for name, fn in (("stock", stock), ("ours", ours)):
            if not timing_runs:
                break
            for _ in range(3):
                fn(False)
            sync()
            t0 = time.perf_counter()
            for _ in range(timing_runs):
                fn(False)
            host = time.perf_counter() - t0  # the calls returned: the host's launching
            sync()
            wall = time.perf_counter() - t0
            times[f"{name}_host_ms"] = host * 1e3 / timing_runs
            times[f"{name}_wall_ms"] = wall * 1e3 / timing_runs
    finally:
        qwen.get_forward_context = saved

    return {"prompt_lens": prompt_lens, "decodes": decodes, **errors, **times}


def rel(x, y) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-12)).item()
