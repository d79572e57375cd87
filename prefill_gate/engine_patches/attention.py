"""Per-row attention routing for vLLM 0.26 on `--attention-backend CUSTOM` (made for sm_70).

vLLM's Triton backend launches one kernel for the whole batch and takes its split-KV path
only when every row is a one-token decode; speculative-verify rows (1 + k tokens) and every
mixed batch take the 2-D path, the slow one on sm_70 (V100), where tl.dot has no
tensor-core path and re-reading KV per 16-row query tile dominates. This backend splits
each batch by row (`prefill_gate.engine_patches.routing`): decode and verify rows, which vLLM's batch
reorder puts first, go to one split-KV launch of our `prefill_gate.kernels.paged_attention`, the rest
to one 2-D launch, in the same step.

    PREFILL_GATE_SPEC_AS_DECODE=auto|0|1 \\
      vllm serve MODEL --attention-backend CUSTOM --dtype float16   # the plugin registers it

Everything vLLM's Triton backend does besides the attention kernel is inherited: the KV
cache layout and its write (`do_kv_cache_update`), the metadata vLLM hands in. The builder
classifies rows from CPU-side query lengths and prefill flags (no device sync), and sizes
the split path's scratch per token, for the longest row that can take that path, so no
batch the scheduler can form overflows it. Full CUDA graphs cover uniform batches (all
decodes, or all verifies of 1 + k tokens); mixed batches run under piecewise graphs.

Not supported, with an error that names the setting to change: quantized KV caches,
bf16 on GPUs before sm_80, ALiBi, attention sinks, multimodal prefix ranges, encoder
attention, fused output quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from prefill_gate.engine_patches._vllm import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
    init_logger,
)
from prefill_gate.engine_patches.routing import PREFILL, mode_from_env, row_classes, split_query_cap
from prefill_gate.kernels.paged_attention import (
    HEAD_DIMS,
    Scratch,
    counters,
    device_capability,
    paged_attention,
)

logger = init_logger("vllm.prefill_gate.attention")

MAX_SPLITS = 16  # KV segments per split-KV row
PROGRAMS_PER_SM = 2  # the split-KV launch aims for this many programs per SM


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Segments per row so that `num_seqs` rows fill the GPU: a power of two in 1..16.
    Depends only on host values that a captured graph fixes (the padded row count)."""
    want = -(-PROGRAMS_PER_SM * num_sms // max(1, num_seqs * num_kv_heads))
    return min(MAX_SPLITS, 1 << max(0, want - 1).bit_length())


def scratch_rows(max_num_seqs: int, query_cap: int, max_tokens: int, num_kv_heads: int, num_sms: int) -> int:
    """The (token, split) slots the largest split-KV launch can need: over every row count
    the scheduler can form, tokens (each row at most `query_cap`) times that count's splits."""
    return max(min(n * query_cap, max_tokens) * num_kv_splits(n, num_kv_heads, num_sms)
               for n in range(1, max_num_seqs + 1))


@dataclass
class SplitRowsMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor
    # The split-KV launch: rows [0, num_split), each at most max_split_query_len tokens.
    num_split: int
    max_split_query_len: int
    split_tokens: int  # a bound on the split rows' tokens (query_start_loc[num_split])
    num_kv_splits: int
    scratch: Scratch | None
    # The 2-D launch: rows [num_split, num_reqs).
    num_reqs: int
    use_cascade: bool = False

    def __post_init__(self) -> None:
        # Slices made once per step here, not once per layer in forward.
        n = self.num_split
        self.split_rows = (self.seq_lens[:n], self.query_start_loc[: n + 1])
        self.rest_rows = (self.block_table[n:], self.seq_lens[n:], self.query_start_loc[n:])


class SplitRowsMetadataBuilder(TritonAttentionMetadataBuilder):
    # Full graphs for uniform batches (all decodes, or all verifies of 1 + k); vLLM runs
    # mixed batches under piecewise graphs, attention eager, so the split point can move.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.mode = mode_from_env()
        spec = vllm_config.speculative_config
        k = (spec.num_speculative_tokens or 0) if spec is not None else 0
        if spec is not None and getattr(spec, "parallel_drafting", False):
            k *= 2  # the drafter's own rows carry 1 + 2k tokens
        self.num_spec_tokens = k
        self.query_cap = split_query_cap(k, self.mode)
        # vLLM's batch reorder puts rows of at most this many tokens that are done
        # prefilling first: our split rows form a prefix of the batch.
        self._init_reorder_batch_threshold(self.query_cap)
        sched = vllm_config.scheduler_config
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if torch.device(device).type == "cuda" else 80)
        max_tokens = sched.max_num_batched_tokens
        sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
        max_seqs = max([sched.max_num_seqs, *sizes])  # a padded graph batch may have more rows
        self.scratch_rows = scratch_rows(max_seqs, self.query_cap, max(max_tokens, max(sizes, default=0)),
                                         self.num_heads_kv, self.num_sms)
        self.max_split_seqs = max_seqs
        m = torch.empty(self.scratch_rows * self.num_heads_q, dtype=torch.float32, device=device)
        self._scratch = (m, torch.empty_like(m),
                         torch.empty(self.scratch_rows * self.num_heads_q * self.headdim, dtype=torch.float32,
                                     device=device))
        # The fused merge's arrival counters: zero between launches, shared by every layer.
        self._counter = counters(max_seqs, self.num_heads_kv, device)
        logger.info("prefill-gate CUSTOM attention: PREFILL_GATE_SPEC_AS_DECODE=%s, split-KV rows up to %d "
                    "tokens (k=%d), scratch %.1f MiB", self.mode, self.query_cap, k,
                    sum(t.numel() for t in self._scratch) * 4 / 2**20)

    def split_point(self, common: CommonAttentionMetadata) -> tuple[int, int]:
        """(rows in the split-KV launch, their longest query): the leading rows the
        routing sends there. CPU tensors only."""
        qsl = common.query_start_loc_cpu.numpy()
        query_lens = np.diff(qsl[: common.num_reqs + 1])
        # vLLM's model runner V2 hands flags for the real rows only: the padding rows of a
        # captured graph are not prefilling.
        prefilling = np.zeros(query_lens.shape, dtype=bool)
        if common.is_prefilling is not None:
            flags = common.is_prefilling[: common.num_reqs].numpy()
            prefilling[: flags.shape[0]] = flags
        classes = row_classes(query_lens, prefilling, self.num_spec_tokens, self.mode)
        later = np.flatnonzero(classes == PREFILL)
        n = int(later[0]) if later.size else common.num_reqs
        return n, int(query_lens[:n].max(initial=0))

    def scratch_for(self, num_split: int, max_query: int) -> tuple[int, int, Scratch]:
        """(token bound, splits, scratch views) for a split-KV launch of `num_split` rows."""
        if num_split > self.max_split_seqs:
            raise RuntimeError(f"{num_split} split-KV rows; the scratch was sized for {self.max_split_seqs}")
        splits = num_kv_splits(num_split, self.num_heads_kv, self.num_sms)
        tokens = num_split * max_query
        if tokens * splits > self.scratch_rows:
            raise RuntimeError(f"split-KV scratch overflow: {tokens} tokens x {splits} splits > "
                               f"{self.scratch_rows} slots")
        hq, d = self.num_heads_q, self.headdim
        m, l, acc = self._scratch
        slots = tokens * hq * splits
        return tokens, splits, Scratch(m[:slots].view(tokens, hq, splits), l[:slots].view(tokens, hq, splits),
                                       acc[: slots * d].view(tokens, hq, splits, d), self._counter)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SplitRowsMetadata:
        common = common_attn_metadata
        if common_prefix_len > 0:
            raise NotImplementedError("cascade attention: the CUSTOM backend never asks for it")
        if common.mm_req_doc_ranges is not None:
            raise NotImplementedError("multimodal prefix ranges: use --attention-backend TRITON_ATTN")
        num_split, max_split_query = self.split_point(common)
        max_split_query = max(1, max_split_query)  # padding rows have none
        tokens, splits, scratch = 0, 1, None
        if num_split:
            tokens, splits, scratch = self.scratch_for(num_split, max_split_query)
        return SplitRowsMetadata(
            num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len, query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens, block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping, causal=common.causal,
            num_split=num_split, max_split_query_len=max_split_query,
            split_tokens=min(tokens, common.num_actual_tokens), num_kv_splits=splits, scratch=scratch,
            num_reqs=common.num_reqs)


def _capturing(t: torch.Tensor) -> bool:
    """Is a CUDA graph being recorded on the stream that `t`'s kernels go to?"""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class SplitRowsAttentionImpl(TritonAttentionImpl):
    """vLLM's Triton impl (KV cache layout and write) with the attention itself done by
    `prefill_gate.kernels.paged_attention`: one split-KV launch for the leading decode/verify rows (its
    merge fused in when run eagerly, a second launch under CUDA-graph capture) and one 2-D
    launch for the rest."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None, use_alibi_sqrt=False, chunk_lookback=-1):
        unsupported = [
            (kv_cache_dtype not in ("auto", "float16", "bfloat16"),
             f"KV cache dtype {kv_cache_dtype}: set --kv-cache-dtype auto (or float16)"),
            (alibi_slopes is not None or use_alibi_sqrt, "ALiBi: use --attention-backend TRITON_ATTN"),
            (sinks is not None, "attention sinks: use --attention-backend TRITON_ATTN"),
            (attn_type != AttentionType.DECODER, f"{attn_type} attention: use --attention-backend TRITON_ATTN"),
            (chunk_lookback != -1, "chunked lookback attention: use --attention-backend TRITON_ATTN"),
            (head_size not in HEAD_DIMS,
             f"head size {head_size} (supported {HEAD_DIMS}): use --attention-backend TRITON_ATTN"),
        ]
        reasons = [why for bad, why in unsupported if bad]
        if reasons:
            raise ValueError("--attention-backend CUSTOM (prefill-gate) does not support " + "; ".join(reasons))
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks, use_alibi_sqrt,
                         chunk_lookback)
        self.window = None if sliding_window is None else int(sliding_window)
        self.softcap = float(logits_soft_cap) if logits_soft_cap else None
        self._checked = False  # layouts and dtypes checked on the first call, not per layer

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def _check_dtype(self, query: torch.Tensor) -> None:
        """bf16 has no sm_70 path (Triton and the hardware); say which flag fixes it."""
        cap = device_capability(query.device)
        if query.dtype == torch.bfloat16 and cap is not None and cap < (8, 0):
            raise ValueError(f"bfloat16 attention on sm_{cap[0]}{cap[1]}: run vLLM with --dtype float16 "
                             "(--attention-backend CUSTOM)")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization with --attention-backend CUSTOM")
        if attn_metadata is None:  # the profiling run
            return output.fill_(0)
        validate = not self._checked
        if validate:
            self._check_dtype(query)
        m: SplitRowsMetadata = attn_metadata
        # (blocks, kv_heads, page, 2 * head) -> K and V as (blocks, page, kv_heads, head) views
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if m.num_split:
            t = m.split_tokens
            scratch = m.scratch
            if _capturing(query):
                # Replayed from a graph a launch costs the host nothing: the merge as its own
                # launch is faster on the GPU (H200: 98 vs 111 us at 4k, 551 vs 623 at 32k). Run
                # eagerly, the fused merge's one launch saves the host 20-30 us per layer.
                scratch = scratch._replace(counter=None)
            paged_attention(query[:t], key_cache, value_cache, m.block_table, *m.split_rows, scale=self.scale,
                            max_query_len=m.max_split_query_len, out=output[:t], split=True,
                            num_kv_splits=m.num_kv_splits, scratch=scratch, sliding_window=self.window,
                            softcap=self.softcap, validate=validate)
        if m.num_split < m.num_reqs:
            t = m.num_actual_tokens
            paged_attention(query[:t], key_cache, value_cache, *m.rest_rows, scale=self.scale,
                            max_query_len=m.max_query_len, out=output[:t], split=False, sliding_window=self.window,
                            softcap=self.softcap, validate=validate)
        self._checked = True
        return output


class SplitRowsAttentionBackend(TritonAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return SplitRowsAttentionImpl

    @staticmethod
    def get_builder_cls():
        return SplitRowsMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in HEAD_DIMS

    # What vLLM asks a backend before choosing it; the split kernel does none of these.
    supports_non_causal = supports_batch_invariance = supports_mm_prefix = supports_sink = \
        supports_alibi_sqrt = classmethod(lambda cls: False)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


__all__ = ["SplitRowsAttentionBackend", "SplitRowsAttentionImpl", "SplitRowsMetadataBuilder", "num_kv_splits",
           "scratch_rows"]
