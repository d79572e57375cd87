"""The only module that imports vLLM internals.

engine_patches is written against exactly one vLLM release: its scheduler subclasses
read request fields and scheduler attributes, and its attention backend derives from the
Triton backend's classes, none of which vLLM promises to keep. A
different version fails here, at import, with a message that says what to install,
rather than mis-scheduling in production.
"""

from __future__ import annotations

import vllm

SUPPORTED_VLLM = "0.26.0"

if vllm.__version__.split("+")[0] != SUPPORTED_VLLM:
    raise ImportError(
        f"engine_patches supports vLLM {SUPPORTED_VLLM} only, found {vllm.__version__}; "
        f"install vllm=={SUPPORTED_VLLM} or unset --scheduler-cls / PREFILL_GATE_* to run "
        "without the patches"
    )

from vllm.config import CUDAGraphMode, VllmConfig
from vllm.logger import init_logger
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.request import Request

__all__ = [
    "SUPPORTED_VLLM",
    "AggregateStatLoggerBase",
    "AsyncScheduler",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionType",
    "CUDAGraphMode",
    "CommonAttentionMetadata",
    "Request",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "cached_prefix_tokens",
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadataBuilder",
    "VllmConfig",
    "decode_tokens",
    "fcfs_queue",
    "init_logger",
    "is_decoding",
    "register_backend",
    "resolve_obj_by_qualname",
]


def is_decoding(request: Request) -> bool:
    """A running request past its prompt: its next step is a decode (or a verify)."""
    return not request.is_prefill_chunk


def decode_tokens(scheduler: Scheduler, request: Request, step: int) -> int:
    """The tokens vLLM 0.26's running loop will give this decoding request in `step`.

    Mirrors `Scheduler.schedule()`'s per-request arithmetic for running requests (the
    async early-stop and pipeline-cadence skips, 1 + k tokens with k speculative tokens,
    the max-model-len clip), so a budget of `sum(decode_tokens) + cap` leaves exactly
    `cap` tokens for prefills once the decodes are scheduled first.
    """
    if (
        request.num_output_placeholders > 0
        and request.num_computed_tokens + 2 - request.num_output_placeholders
        >= request.num_prompt_tokens + request.max_tokens
    ):
        return 0
    if step < request.next_decode_eligible_step:
        return 0
    n = (
        request.num_tokens_with_spec
        + request.num_output_placeholders
        - request.num_computed_tokens
    )
    n = min(
        n,
        scheduler.max_model_len
        - request.num_computed_tokens
        - scheduler.num_sampled_tokens_per_step,
    )
    return max(n, 0)


def cached_prefix_tokens(scheduler: Scheduler, request: Request) -> int:
    """Prompt tokens of a waiting request that vLLM's prefix cache holds now: the lookup
    the waiting loop will make (`KVCacheManager.get_computed_blocks`), without its side
    effects (hit statistics, cache events). 0 when caching is off or the request skips it."""
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching or request.skip_reading_prefix_cache:
        return 0
    _, hit, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
    return hit


def fcfs_queue(requests) -> FCFSRequestQueue:
    """A first-come-first-served queue holding `requests` in this order."""
    queue = FCFSRequestQueue()
    queue.extend(requests)
    return queue


def gdn_internals():
    """vLLM's Gated DeltaNet layer class and what its core calls, imported on demand: the
    model-layer modules are heavy, and only a server with the GDN patch on needs them."""
    from types import SimpleNamespace

    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAttentionBackend,
        GDNAttentionMetadata,
        GDNAttentionMetadataBuilder,
    )

    return SimpleNamespace(layer_cls=QwenGatedDeltaNetAttention, metadata_cls=GDNAttentionMetadata,
                           get_forward_context=get_forward_context, causal_conv1d_fn=causal_conv1d_fn,
                           is_conv_state_dim_first=is_conv_state_dim_first, backend_cls=GDNAttentionBackend,
                           builder_cls=GDNAttentionMetadataBuilder)


def graph_internals():
    """vLLM's GPU model runner (whose ``capture_model`` captures every CUDA graph) and its graph
    wrapper class (``_all_instances``: every wrapper alive), imported on demand: the runner's
    module is heavy, and only a server that uploads its graphs needs it."""
    from types import SimpleNamespace

    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return SimpleNamespace(runner_cls=GPUModelRunner, wrapper_cls=CUDAGraphWrapper)


def warmup_internals():
    """vLLM's start-up kernel warm-up module and the mamba state copy it leaves cold, imported
    on demand (only a server with the GDN patch on installs ``warmup``)."""
    from types import SimpleNamespace

    import vllm.model_executor.warmup.kernel_warmup as kernel_warmup
    from vllm.v1.worker.mamba_utils import batch_memcpy

    return SimpleNamespace(kernel_warmup=kernel_warmup, batch_memcpy=batch_memcpy)
