"""PREFILL_GATE_PACING_SUB_BLOCK: paced steps below the KV block on a hybrid in align mode.

The scheduler side runs on vLLM 0.26's real Scheduler/AsyncScheduler and KV-cache manager.
The worker side replays what vLLM's GPU model runner does with the recurrent state, with
vLLM's own code where it decides anything: `preprocess_mamba` (which block's slot holds a
request's running state, and the copy into the next block's slot when a step starts past a
boundary) and `mamba_get_block_table_tensor` (the slot a step's GDN layers read and write).
Only the model is fake: a slot holds (tokens seen, a fingerprint of them), so every chunk
checks that the state it starts from is its own prompt's state after exactly the tokens
computed before it, and a later prompt that hits the prefix cache checks the state a cached
block kept.
"""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefill_gate.engine_patches.pacing import PacedAsyncScheduler, PacedScheduler
from tests.engine.harness import Engine, build

CLASSES = [
    pytest.param(PacedScheduler, 1, id="sync"),
    pytest.param(PacedAsyncScheduler, 2, id="async"),
]
BLOCK = 1568
MODULUS = (1 << 31) - 1


def fingerprint(tokens: list[int]) -> float:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MODULUS
    return float(h)


class StateReplay:
    """The GPU model runner's recurrent-state bookkeeping in align mode, for a fake model."""

    def __init__(self, scheduler, monkeypatch):
        import vllm.v1.worker.mamba_utils as worker_mamba
        from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
        from vllm.v1.utils import CpuGpuBuffer

        def cpu_batch_memcpy(src, dst, sizes):  # vLLM's Triton copy of raw pointers, on the host
            for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
                ctypes.memmove(d, s, n)

        monkeypatch.setattr(worker_mamba, "batch_memcpy", cpu_batch_memcpy)
        self.vllm = worker_mamba
        self.sched = scheduler
        config = scheduler.kv_cache_config
        self.group = next(i for i, g in enumerate(config.kv_cache_groups) if g.layer_names == ["mamba"])
        self.spec = config.kv_cache_groups[self.group].kv_cache_spec
        self.state = torch.zeros(config.num_blocks, 2, dtype=torch.float64)  # (tokens, fingerprint)
        self.forward_context = {"mamba": SimpleNamespace(kv_cache=[self.state])}
        self.copy_funcs = (get_temporal_copy_spec,)
        self.copy_bufs = worker_mamba.MambaCopyBuffers.create(
            64, config, self.copy_funcs,
            lambda *size, dtype: CpuGpuBuffer(*size, dtype=dtype, device="cpu", pin_memory=False))
        self.state_idx: dict[str, int] = {}
        self.requests: dict[str, SimpleNamespace] = {}
        self.prompts: dict[str, list[int]] = {}
        self.first_computed: dict[str, int] = {}  # where each request's first chunk started
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self.boundary_states: dict[int, tuple[float, float]] = {}  # block id -> state when cached
        original = scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            self.run(out)
            return out

        scheduler.schedule = schedule

    def expected(self, rid: str, tokens: int) -> tuple[float, float]:
        prompt = self.prompts[rid]
        return float(tokens), fingerprint(prompt[:min(tokens, len(prompt))])

    def run(self, out) -> None:
        if not out.num_scheduled_tokens:
            return
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(
                num_computed_tokens=new.num_computed_tokens, block_ids=[list(b) for b in new.block_ids])
            self.prompts[new.req_id] = list(new.prompt_token_ids)
            self.first_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            assert rid not in cached.resumed_req_ids, "no preemption in these tests"
            req = self.requests[rid]
            req.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                for group, ids in enumerate(cached.new_block_ids[i]):
                    req.block_ids[group].extend(ids)
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        req_ids = list(out.num_scheduled_tokens)
        batch = SimpleNamespace(req_ids=req_ids, num_accepted_tokens_cpu=np.ones(len(req_ids), dtype=np.int32))
        self.vllm.preprocess_mamba(out, self.sched.kv_cache_config, self.sched.cache_config, self.state_idx,
                                   batch, self.requests, self.forward_context, self.copy_funcs, self.copy_bufs)
        self.forward(out, req_ids)

    def forward(self, out, req_ids: list[str]) -> None:
        from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

        tables = [self.requests[rid].block_ids[self.group] for rid in req_ids]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq_lens = torch.tensor([self.requests[rid].num_computed_tokens + out.num_scheduled_tokens[rid]
                                 for rid in req_ids], dtype=torch.int32)
        slots = mamba_get_block_table_tensor(table, seq_lens, self.spec, "align")[:, 0].tolist()
        for rid, slot in zip(req_ids, slots):
            start = self.requests[rid].num_computed_tokens
            n = out.num_scheduled_tokens[rid]
            assert slot != 0, f"{rid}: the null block as its state slot"
            if start < len(self.prompts[rid]):
                self.chunks.setdefault(rid, []).append((start, n))
            if start > 0:  # has_initial_state: the layers read the slot
                read = tuple(self.state[slot].tolist())
                assert read == self.expected(rid, start), (
                    f"{rid}: a chunk at {start} read the state of {read[0]:.0f} tokens "
                    f"(or another prompt's), slot {slot}")
            self.state[slot] = torch.tensor(self.expected(rid, start + n), dtype=torch.float64)
            end = start + n
            if end % BLOCK == 0 and end <= len(self.prompts[rid]):
                self.boundary_states[slot] = self.expected(rid, end)


def prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    """A: 6,000 tokens (3 full blocks, then 1,296); C: A's first 2 blocks, then 3,000 of its own."""
    rng = random.Random(seed)
    a = [rng.randrange(1, 250) for _ in range(6000)]
    c = a[:2 * BLOCK] + [rng.randrange(1, 250) for _ in range(3000)]
    return a, c


def paced_engine(cls, depth, tiny_model, pacing_env, monkeypatch, sub_block: int, cap: int = 512):
    pacing_env("cap", cap_tokens=cap, sub_block=sub_block)
    scheduler = build(cls, tiny_model, block_size=BLOCK, hybrid_align=True, num_blocks=400,
                      enable_prefix_caching=True, async_scheduling=depth == 2)
    replay = StateReplay(scheduler, monkeypatch)
    return Engine(scheduler, depth=depth), replay


def serve_a_then_c(engine: Engine) -> None:
    a, c = prompts()
    engine.add(40, 600, "B")  # a stream that decodes throughout
    engine.run(lambda: "B" in engine.first_token)
    engine.add(len(a), 4, "A", tokens=a)
    engine.run(lambda: "A" in engine.finished, max_steps=400)
    engine.add(len(c), 4, "C", tokens=c)
    engine.run(lambda: "C" in engine.finished, max_steps=400)
    engine.drain()


@pytest.mark.parametrize("cls,depth", CLASSES)
def test_sub_block_chunks_never_cross_a_boundary(cls, depth, tiny_model, pacing_env, monkeypatch):
    engine, replay = paced_engine(cls, depth, tiny_model, pacing_env, monkeypatch, sub_block=1)
    serve_a_then_c(engine)
    a_chunks = replay.chunks["A"]
    assert all(0 < n <= 512 for _, n in a_chunks), a_chunks
    assert a_chunks[0][0] == 0 and sum(n for _, n in a_chunks) == 6000
    for start, n in a_chunks:
        if start + n <= 4704:  # before the last full block: never past a boundary mid-chunk
            assert start // BLOCK == (start + n - 1) // BLOCK, (start, n)
    ends = {start + n for start, n in a_chunks}
    assert {BLOCK, 2 * BLOCK, 3 * BLOCK} <= ends  # every boundary's state is materialised
    assert any((start + n) % BLOCK for start, n in a_chunks if start + n < 4704)  # and sub-block chunks ran


@pytest.mark.parametrize("cls,depth", CLASSES)
@pytest.mark.parametrize("sub_block", [1, 0])
def test_every_chunk_and_every_cache_hit_reads_the_right_state(cls, depth, sub_block, tiny_model, pacing_env,
                                                               monkeypatch):
    """The fake layers assert on every chunk (StateReplay.forward); C must start from A's
    cached second block, whose slot must still hold the state at 3,136 tokens."""
    engine, replay = paced_engine(cls, depth, tiny_model, pacing_env, monkeypatch, sub_block=sub_block)
    serve_a_then_c(engine)
    assert replay.first_computed["C"] == 2 * BLOCK, "C did not hit A's cached blocks"
    assert replay.chunks["C"][0][0] == 2 * BLOCK
    assert len(replay.boundary_states) >= 3


def test_off_by_default_and_whole_blocks_without_it(tiny_model, pacing_env, monkeypatch):
    engine, replay = paced_engine(PacedScheduler, 1, tiny_model, pacing_env, monkeypatch, sub_block=0)
    assert not engine.scheduler.pacer.config.sub_block
    serve_a_then_c(engine)
    assert all(n % BLOCK == 0 for start, n in replay.chunks["A"] if start + n < 4704)


def test_the_setting_is_validated():
    from prefill_gate.engine_patches.config import PacingConfig, PacingConfigError

    assert PacingConfig.from_env({"PREFILL_GATE_PACING_SUB_BLOCK": "1"}).sub_block
    with pytest.raises(PacingConfigError, match="PREFILL_GATE_PACING_SUB_BLOCK=2"):
        PacingConfig.from_env({"PREFILL_GATE_PACING_SUB_BLOCK": "2"})


@pytest.mark.parametrize("sub_block", [0, 1])
@pytest.mark.parametrize("prompt,cap", [(6000, 512), (2000, 2048), (4705, 700), (9000, 1600), (3136, 100)])
def test_the_simulator_chunks_as_vllm(prompt, cap, sub_block, tiny_model, pacing_env, monkeypatch):
    """The simulator's align-mode chunking (prefill_gate.proxy.sim, which the proxy's benches
    and the hybrid presets run on) against vLLM's real scheduler paced by engine_patches:
    the same chunk sequence for one long prompt beside a decoding stream."""
    import asyncio

    from prefill_gate.proxy.sim.engine import CostModel, EngineConfig, SimRequest
    from prefill_gate.proxy.sim.engine import Engine as SimEngine

    engine, replay = paced_engine(PacedScheduler, 1, tiny_model, pacing_env, monkeypatch, sub_block=sub_block,
                                  cap=cap)
    rng = random.Random(prompt)
    engine.add(40, 3000, "B")
    engine.run(lambda: "B" in engine.first_token)
    engine.add(prompt, 2, "A", tokens=[rng.randrange(1, 250) for _ in range(prompt)])
    engine.run(lambda: "A" in engine.first_token, max_steps=400)
    real = [n for _, n in replay.chunks["A"]]

    sim = SimEngine(EngineConfig(max_num_batched_tokens=8192, max_num_seqs=16, block_size=BLOCK, align_chunks=True,
                                 pacing_cap=cap, pacing_short_tokens=0, pacing_sub_block=bool(sub_block)),
                    CostModel(base=0.001))
    sim.add(SimRequest(list(range(1000, 1040)), 3000, events=asyncio.Queue()))
    sim.apply(sim.plan())
    long = sim.add(SimRequest([rng.randrange(1, 250) for _ in range(prompt)], 2, events=asyncio.Queue()))
    modelled = []
    while long.prefilling:
        plan = sim.plan()
        modelled += [n for r, n in plan.chunks if r is long]
        sim.apply(plan)
    assert modelled == real
