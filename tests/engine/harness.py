"""Real vLLM 0.26 schedulers on the CPU, driven step by step without a model.

Built the way vLLM's own scheduler tests build theirs: a config-only local model folder,
`skip_tokenizer_init`, `DeviceConfig(device="cpu")` and a KV-cache config written by
hand. `Engine.step()` plays the model runner: it samples one token for every request
that finished its prompt and none for a partial prefill chunk.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# vLLM 0.26's default capture sizes when the largest is 512 (max_num_seqs >= 256).
DEFAULT_GRAPH_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def model_dir(root: Path) -> Path:
    path = root / "tiny-qwen3"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


def vllm_config(
    model: Path,
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    block_size: int = 16,
    hybrid_align: bool = False,
    num_spec_tokens: int = 0,
    async_scheduling: bool = False,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = False,
) -> VllmConfig:
    max_model_len = 65536
    model_config = ModelConfig(
        model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len,
        dtype="bfloat16", seed=0,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode="align" if hybrid_align else "none",
    )
    speculative_config = None
    if num_spec_tokens:
        speculative_config = SpeculativeConfig(
            method="ngram_gpu" if async_scheduling else "ngram",
            num_speculative_tokens=num_spec_tokens,
            prompt_lookup_max=4, prompt_lookup_min=2,
        )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=speculative_config,
    )


def build(cls, model: Path, *, num_blocks: int = 10_000, graph_sizes: list[int] | None = None,
          graph_mode: str = "FULL_AND_PIECEWISE", **settings):
    """A `cls` scheduler over a hand-written KV-cache config; `settings` as for `vllm_config`.

    `graph_sizes`, `graph_mode`: the CUDA-graph capture sizes and mode of a GPU server
    (vLLM's default mode); on the CPU vLLM turns graphs off, so they are set after the fact.
    """
    config = vllm_config(model, **settings)
    if graph_sizes:
        compilation = config.compilation_config
        compilation.cudagraph_mode = CUDAGraphMode[graph_mode]
        compilation.cudagraph_capture_sizes = sorted(graph_sizes)
        compilation.max_cudagraph_capture_size = max(graph_sizes)
    cache_config = config.cache_config
    block_size = cache_config.block_size
    hybrid_align = cache_config.mamba_cache_mode == "align"
    groups = [
        KVCacheGroupSpec(
            ["attn"],
            FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                              dtype=torch.bfloat16),
        )
    ]
    if hybrid_align:
        groups.append(
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(block_size=block_size, shapes=((16, 64),), dtypes=(torch.bfloat16,),
                          mamba_cache_mode="align"),
            )
        )
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups)
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )


_ids = itertools.count()


@functools.cache
def _block_hasher(block_size: int):
    """vLLM's request block hasher (sha256), as its engine core builds it; the seed hash
    is set once per process (it is random unless PYTHONHASHSEED is set)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


@dataclass
class Step:
    """One scheduled step, classified with what was known before it ran."""

    output: SchedulerOutput
    decoding: set[str]  # requests that were past their prompt before this step
    prefill_tokens: int
    decode_tokens: dict[str, int] = field(default_factory=dict)
    chunk_end: dict[str, int] = field(default_factory=dict)  # prompt position reached


class Engine:
    """Drives a scheduler like vLLM's engine core loop, minus the model.

    `depth=1` is the synchronous loop (schedule, run, update); `depth=2` is the async
    batch queue (schedule step k+1 before step k's output is processed). With a
    `cost(step) -> seconds`, a fake clock follows a GPU timeline: a step starts when it
    is scheduled and the previous one is done, and lasts `cost(step)`; the scheduler's
    `pacing_clock` reads that clock.
    """

    def __init__(self, scheduler, *, spec_tokens: int = 0, depth: int = 1, cost=None, host=None):
        self.scheduler = scheduler
        self.spec_tokens = spec_tokens
        self.depth = depth
        self.cost = cost
        self.host = host  # host(step, scheduler) -> seconds the engine thread spends launching it
        self.done_at: dict[int, float] = {}  # step index -> when its output reached the scheduler
        self.now = 0.0
        self.gpu_free_at = 0.0
        self.steps: list[Step] = []
        self.durations: list[float] = []
        self.finished: dict[str, int] = {}  # request id -> step index it finished in
        self.first_token: dict[str, int] = {}
        self._in_flight: list[tuple[int, SchedulerOutput, float]] = []
        if cost is not None:
            scheduler.pacing_clock = lambda: self.now

    def add(self, prompt_tokens: int, max_tokens: int, name: str | None = None, *,
            tokens: list[int] | None = None, priority: int = 0) -> str:
        """A request of `prompt_tokens` copies of one token, or of `tokens` (distinct
        prompts for prefix-caching tests)."""
        rid = name or f"r{next(_ids)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        sched = self.scheduler
        hasher = _block_hasher(sched.cache_config.block_size) if sched.cache_config.enable_prefix_caching else None
        request = Request(rid, tokens if tokens is not None else [7] * prompt_tokens, params, None,
                          priority=priority, block_hasher=hasher)
        sched.add_request(request)
        return rid

    def step(self) -> Step:
        sched = self.scheduler
        decoding = {
            r.request_id for r in sched.running
            if r.num_computed_tokens >= r.num_prompt_tokens
        }
        scheduled_at = self.now
        out = sched.schedule()
        prefill = sum(n for rid, n in out.num_scheduled_tokens.items() if rid not in decoding)
        step = Step(out, decoding, prefill,
                    {rid: n for rid, n in out.num_scheduled_tokens.items() if rid in decoding},
                    {rid: sched.requests[rid].num_computed_tokens
                     for rid in out.num_scheduled_tokens if rid not in decoding})
        self.steps.append(step)
        index = len(self.steps) - 1
        if self.host is not None:  # the engine thread prepares and launches the step meanwhile
            self.now += self.host(step, sched)
        sched.get_grammar_bitmask(out)  # as vLLM's engine loop, once the step is launched
        duration = self.cost(step, sched) if self.cost else 0.0
        self.durations.append(duration)
        # the GPU runs the step after the one before it, and not past its last launch
        end = max(self.now, max(scheduled_at, self.gpu_free_at) + duration)
        self.gpu_free_at = end
        self._in_flight.append((index, out, end))
        if len(self._in_flight) >= self.depth or not sched.has_requests():
            self.drain(1)
        return step

    def drain(self, n: int | None = None) -> None:
        for _ in range(len(self._in_flight) if n is None else n):
            index, out, end = self._in_flight.pop(0)
            self.now = max(self.now, end)
            self.done_at[index] = self.now
            self._complete(index, out)

    def run(self, until, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def _complete(self, index: int, out: SchedulerOutput) -> None:
        sched = self.scheduler
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            request = sched.requests.get(rid)
            # A partial prefill chunk samples nothing; a final chunk or a decode samples
            # one token, plus every scheduled speculative token (all accepted).
            if request is None or self._partial_chunk(request, out, rid):
                sampled.append([])
                continue
            spec = out.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append([5] * (1 + len(spec)))
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        results = sched.update_from_output(out, runner_output)
        for rid, s in zip(req_ids, sampled):
            if s and rid not in self.first_token:
                self.first_token[rid] = index
        for outputs in results.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = index
        if self.spec_tokens:
            live = [r.request_id for r in sched.running
                    if r.num_computed_tokens >= r.num_prompt_tokens]
            sched.update_draft_token_ids(
                DraftTokenIds(live, [[9] * self.spec_tokens for _ in live])
            )

    def _partial_chunk(self, request: Request, out: SchedulerOutput, rid: str) -> bool:
        step = self.steps[self._index_of(out)]
        if rid in step.decoding:
            return False
        end = step.chunk_end.get(rid, 0)
        return end < request.num_prompt_tokens

    def _index_of(self, out: SchedulerOutput) -> int:
        for i in range(len(self.steps) - 1, -1, -1):
            if self.steps[i].output is out:
                return i
        raise KeyError("unknown step")
