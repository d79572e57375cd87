"""Random paged-attention inputs: fresh per call, random block tables, mixed batches."""

from __future__ import annotations

import torch


def make_case(page: int, query_lens: list[int], contexts: list[int], num_q_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """contexts[i]: tokens already in sequence i's cache before its query_lens[i] new ones."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [n + c for n, c in zip(query_lens, contexts)]
    pages = [-(-length // page) for length in seq_lens]
    num_blocks = sum(pages) + 4  # spare blocks hold noise that must never be read
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(seq_lens), max(pages) + 2), num_blocks - 1, dtype=torch.int32)
    taken = 0
    for s, n in enumerate(pages):
        table[s, :n] = order[taken:taken + n]
        taken += n
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q.to(device), "k_cache": k.to(device), "v_cache": v.to(device), "block_table": table.to(device),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
            "query_start_loc": starts.to(device), "scale": head_dim ** -0.5, "max_query_len": max(query_lens)}


def in_a_vllm_child(call: str, timeout: float = 600) -> None:
    """Run ``call`` (``module:function``, a function of this repository) in a child process where
    vLLM's Triton kernels run under the interpreter: they need an active Triton driver unless
    CUDA_VISIBLE_DEVICES is empty (vllm.triton_utils decides at import), which a process cannot
    change once vLLM is imported. The function prints ``identical`` when its comparison held."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    module, function = call.split(":")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", f"import {module} as m; m.{function}()"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "identical" in done.stdout, done.stderr[-3000:]
