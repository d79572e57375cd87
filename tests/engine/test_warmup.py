"""engine_patches.warmup: the kernels a GDN hybrid would otherwise compile beside its first streams.

On the CPU (Triton's interpreter runs the kernels): the setting; vLLM's real block tables in
align mode's shape, whose slot-mapping launch writes nothing; vLLM's real state copy with
nothing to copy; our kernel's warm-up step, which leaves every state as it was; the wrapper
around vLLM's warm-up, installed once, after vLLM's own, never stopping vLLM; register()
installing it only with the GDN patch. On a GPU: after the warm-up, a real mixed step and a
real slot mapping compile nothing new (the keys match what service uses).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefill_gate.engine_patches import gdn, warmup
from tests.engine.test_gdn import FakeLayer


def test_the_setting():
    assert warmup.enabled_from_env({}) and warmup.enabled_from_env({warmup.ENV: " ON "})
    assert not warmup.enabled_from_env({warmup.ENV: "off"})
    for bad in ("yes", "1", "auto"):
        with pytest.raises(warmup.WarmupError, match=f"{warmup.ENV}='{bad}': expected on or off"):
            warmup.enabled_from_env({warmup.ENV: bad})


def align_mode_tables(tokens=64):
    """vLLM's block tables as a hybrid in align mode has them: attention in 1,568-token blocks
    of 16-token kernel blocks, and the recurrent state's group, which maps no token slots."""
    from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

    common = dict(max_num_reqs=4, max_num_blocks_per_req=3, max_num_batched_tokens=tokens, pin_memory=False,
                  device=torch.device("cpu"), cp_kv_cache_interleave_size=1)
    attention = BlockTable(block_size=1568, kernel_block_size=16, **common)
    state = BlockTable(block_size=1568, kernel_block_size=1568, slot_mapping_mode=SlotMappingMode.NONE, **common)
    return attention, state


def _slot_mapping_writes_nothing() -> None:
    attention, state = align_mode_tables()
    assert attention.blocks_per_kv_block == 98  # the key vLLM's own warm-up (1 kernel block a block) misses
    attention.slot_mapping.gpu.fill_(-7)
    assert warmup.slot_mapping([attention, state], torch.device("cpu")) == 1
    assert (attention.slot_mapping.gpu == -7).all()
    # The same launch with a request does write: the warm-up ran the kernel, not nothing.
    attention.add_row([5], 0)
    attention.commit_block_table(1)
    attention.compute_slot_mapping(1, torch.tensor([0, 3], dtype=torch.int32), torch.arange(3))
    assert attention.slot_mapping.gpu[:3].tolist() == [5 * 1568, 5 * 1568 + 1, 5 * 1568 + 2]


def _state_copy_copies_nothing() -> None:
    from vllm.v1.worker.mamba_utils import batch_memcpy

    calls = []

    def spy(src, dst, sizes):
        calls.append((src.dtype, dst.dtype, sizes.dtype, src.numel(), sizes.tolist()))
        batch_memcpy(src, dst, sizes)  # vLLM's own kernel, under the interpreter

    warmup.state_copy(spy, torch.device("cpu"))
    assert calls == [(torch.uint64, torch.uint64, torch.int32, 1, [0])], calls  # vLLM's copy buffers' dtypes


def test_vllms_kernels_warmed_write_nothing():
    """vLLM's real slot-mapping kernel on align mode's block tables, and its real state copy,
    as the warm-up launches them. vLLM runs its Triton kernels on the CPU only where
    CUDA_VISIBLE_DEVICES is empty when it is first imported (vllm.triton_utils): a child."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    code = ("import tests.engine.test_warmup as t; t._slot_mapping_writes_nothing(); "
            "t._state_copy_copies_nothing(); print('nothing written')")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "nothing written" in done.stdout, done.stderr[-3000:]


class Table:
    """A block table as ``warmup.slot_mapping`` reads it; records its launches."""

    def __init__(self, mode):
        self.slot_mapping_mode, self.max_num_batched_tokens, self.calls = SimpleNamespace(value=mode), 64, []

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        self.calls.append((num_reqs, query_start_loc.dtype, positions.dtype, positions.numel()))


@pytest.mark.parametrize("launch", [{}, {"chunk": 16}, {"walk": (4, 1)}, {"walk": (4, 1), "conv": "ours"}])
def test_the_kernel_warm_up_touches_no_state(launch, monkeypatch):
    """... and with PREFILL_GATE_GDN_CONV=ours it launches our convolution too (its compilation
    is what the warm-up is for), in the state layout vLLM keeps."""
    from prefill_gate.kernels import causal_conv

    convs = []
    real = causal_conv.causal_conv
    monkeypatch.setattr(causal_conv, "causal_conv", lambda *args, **kw: convs.append((args[3].shape, len(args[4]))) or real(*args, **kw))
    layer = FakeLayer()
    conv_before, ssm_before = layer.kv_cache[0].clone(), layer.kv_cache[1].clone()
    gdn.warm_up(layer, max_seqs=200, **launch)
    assert torch.equal(layer.kv_cache[0], conv_before) and torch.equal(layer.kv_cache[1], ssm_before)
    # a vector of 64 sequences a kernel, then 128, then 256: every kernel a step of up to 200 runs
    shape = layer.kv_cache[0].shape
    assert convs == ([(shape, 2), (shape, 128), (shape, 256)] if launch.get("conv") == "ours" else [])


class Model:
    """An output layer over a vocabulary of 50 (``compute_logits`` as vLLM's models have it);
    records the row count of each call."""

    def __init__(self, hidden=8):
        self.weight = torch.randn(50, hidden, dtype=torch.bfloat16)
        self.rows = []

    def compute_logits(self, states):
        self.rows.append(states.shape[0])
        return states @ self.weight.T


class Runner:
    """What ``warmup.warm`` reads from vLLM's GPUModelRunner."""

    def __init__(self, layers, tables=(), max_num_reqs=5):
        self.device, self.dtype, self.max_num_reqs = torch.device("cpu"), torch.bfloat16, max_num_reqs
        self.compilation_config = SimpleNamespace(static_forward_context={f"layers.{i}": x for i, x in enumerate(layers)})
        self.input_batch = SimpleNamespace(block_table=SimpleNamespace(block_tables=list(tables)))
        self.model_config = SimpleNamespace(get_hidden_size=lambda: 8)
        self.model = Model()


def test_the_output_layer_is_warmed_at_every_request_count(monkeypatch):
    """Once at each count from 1 to the largest, in vLLM's greedy dtypes, each pick copied to
    the host; nothing where the runner has no output layer (a pooling model) or no count."""
    runner = Runner([], max_num_reqs=6)
    copies = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if args and args[0] == "cpu":
            copies.append((tuple(self.shape), self.dtype, kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    assert warmup.output_layer(runner) == 6
    assert runner.model.rows == [1, 2, 3, 4, 5, 6]
    assert copies == [((n, 1), torch.int32, True) for n in range(1, 7)]
    runner.max_num_tokens = 4  # vLLM's count: no more requests than a step's tokens
    runner.model.rows.clear()
    assert warmup.output_layer(runner) == 4 and runner.model.rows == [1, 2, 3, 4]
    runner.model = SimpleNamespace()
    assert warmup.output_layer(runner) == 0
    runner = Runner([], max_num_reqs=0)
    assert warmup.output_layer(runner) == 0 and runner.model.rows == []


def kernel_module():
    """A stand-in for vLLM's kernel_warmup module: its Qwen warm-up records its calls."""
    calls = []
    return SimpleNamespace(qwen_triton_warmup=lambda runner, model_config: calls.append(model_config), calls=calls)


def test_the_wrapper_follows_vllms_warm_up_once_and_never_stops_it():
    class Layer(FakeLayer):
        pass

    gdn.install(Layer, 64, None, lambda message: None, walk=(4, 1))
    layers = [Layer(), Layer(), FakeLayer()]  # two GDN layers of one shape; another class
    ssm = [x.kv_cache[1].clone() for x in layers]
    copies = []
    internals = SimpleNamespace(kernel_warmup=kernel_module(), batch_memcpy=lambda *args: copies.append(args))
    logs, warnings = [], []
    gdn_internals = SimpleNamespace(layer_cls=Layer, is_conv_state_dim_first=lambda: True)
    warmup.install(internals, gdn_internals, logs.append, warnings.append)
    wrapped = internals.kernel_warmup.qwen_triton_warmup
    warmup.install(internals, gdn_internals, logs.append, warnings.append)
    assert internals.kernel_warmup.qwen_triton_warmup is wrapped  # register() runs in every process: once

    attention, state = Table("token_to_kv_slot"), Table("none")
    wrapped(Runner(layers, [attention, state]), "config")
    assert internals.kernel_warmup.calls == ["config"]  # vLLM's own first
    assert len(copies) == 1 and warnings == []
    assert attention.calls == [(0, torch.int32, torch.int64, 64)] and state.calls == []
    assert logs == [f"warmed up before serving ({warmup.ENV}): _compute_slot_mapping_kernel, batch_memcpy_kernel, "
                    "_gated_delta_kernel, the output layer at 1-5 requests"]
    assert all(torch.equal(x.kv_cache[1], s) for x, s in zip(layers, ssm))
    assert len(warmup.gdn_layers(Runner(layers).compilation_config.static_forward_context, Layer)) == 1

    # Not a GDN hybrid: nothing of ours runs, nothing is said.
    logs.clear()
    wrapped(Runner([FakeLayer()]), "dense")
    assert logs == [] and len(copies) == 1
    # The GDN patch off: vLLM's kernels still warmed, ours not.
    Layer._forward_core.prefill_gate_settings["limit"] = 0
    wrapped(Runner([Layer()], [attention]), "config")
    assert logs == [f"warmed up before serving ({warmup.ENV}): _compute_slot_mapping_kernel, batch_memcpy_kernel, "
                    "the output layer at 1-5 requests"]

    # Our convolution on: warmed too, in the layout vLLM keeps the state in.
    Layer._forward_core.prefill_gate_settings.update(limit=64, conv="ours")
    logs.clear()
    before = [x.kv_cache[0].clone() for x in layers]
    wrapped(Runner(layers), "config")
    assert logs == [f"warmed up before serving ({warmup.ENV}): batch_memcpy_kernel, _gated_delta_kernel, "
                    "_causal_conv_kernel, the output layer at 1-5 requests"]
    assert all(torch.equal(x.kv_cache[0], c) for x, c in zip(layers, before))
    Layer._forward_core.prefill_gate_settings["conv"] = "vllm"

    # A warm-up that fails says so and lets vLLM start.
    def broken(*args):
        raise RuntimeError("no such kernel")

    internals.batch_memcpy = broken
    wrapped(Runner([Layer()]), "config")
    assert len(warnings) == 1 and "warm-up failed (RuntimeError: no such kernel)" in warnings[0]


def test_register_installs_it_only_with_the_gdn_patch(monkeypatch, caplog):
    import vllm.model_executor.warmup.kernel_warmup as kernel_warmup
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from prefill_gate import engine_patches

    original = kernel_warmup.qwen_triton_warmup
    monkeypatch.setattr(kernel_warmup, "qwen_triton_warmup", original)  # restored after the test
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core", QwenGatedDeltaNetAttention._forward_core)
    for name in (gdn.ENV, gdn.WALK_ENV, gdn.CHUNK_ENV, warmup.ENV):
        monkeypatch.delenv(name, raising=False)
    engine_patches.register()
    assert kernel_warmup.qwen_triton_warmup is original
    monkeypatch.setenv(gdn.ENV, "on")
    monkeypatch.setenv(warmup.ENV, "off")
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert kernel_warmup.qwen_triton_warmup is original and f"{warmup.ENV}=off" in caplog.text
    monkeypatch.delenv(warmup.ENV)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert kernel_warmup.qwen_triton_warmup.__wrapped__ is original and f"{warmup.ENV}=on" in caplog.text
    monkeypatch.setenv(warmup.ENV, "maybe")
    with pytest.raises(warmup.WarmupError, match="PREFILL_GATE_WARMUP='maybe'"):
        engine_patches.register()


def compiled(kernel) -> int:
    """How many compiled variants a Triton kernel holds, over every device."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
def test_on_the_gpu_service_compiles_nothing_after_the_warm_up():
    """Our kernel warmed on a real-sized layer, then a real mixed step through the GDN path
    (vLLM's conv, our launches); vLLM's slot mapping warmed on an align-mode block table, then
    a step's slot mapping: neither compiles a new variant."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from vllm.v1.worker.block_table import BlockTable, _compute_slot_mapping_kernel

    from prefill_gate.engine_patches import _vllm
    from prefill_gate.kernels.gated_delta import _gated_delta_kernel
    from tests.engine.gdn_gpu import make_layer, make_metadata

    from prefill_gate.kernels.causal_conv import _causal_conv_kernel

    for launch in ({}, {"walk": (8, 1)}, {"walk": (8, 1), "conv": "ours"}):
        layer = make_layer(slots=16)
        gdn.warm_up(layer, conv_state_dim_first=_vllm.gdn_internals().is_conv_state_dim_first(), **launch)
        before = compiled(_gated_delta_kernel), compiled(_causal_conv_kernel) if launch.get("conv") else 0
        step = make_metadata(4, [300, 37], slots=[1, 2, 3, 4, 5, 6], has_initial=[True] * 4 + [False, True])
        tokens = step.num_actual_tokens
        g = torch.Generator(device="cuda").manual_seed(0)
        mixed = torch.randn(tokens + 8, layer.conv1d.weight.size(0), generator=g, device="cuda").to(torch.bfloat16)
        ba = torch.randn(tokens + 8, 2 * 48, generator=g, device="cuda").to(torch.bfloat16)
        out = torch.zeros(tokens + 8, 48, 128, dtype=torch.bfloat16, device="cuda")
        gdn.recurrent_core(layer, mixed, ba[:, :48], ba[:, 48:], out, step, _vllm.gdn_internals(), **launch)
        torch.cuda.synchronize()
        assert (compiled(_gated_delta_kernel), compiled(_causal_conv_kernel) if launch.get("conv") else 0) == before, \
            launch

    table = BlockTable(block_size=1568, kernel_block_size=16, max_num_reqs=64, max_num_blocks_per_req=21,
                       max_num_batched_tokens=2048, pin_memory=False, device=torch.device("cuda"),
                       cp_kv_cache_interleave_size=1)
    warmup.slot_mapping([table], torch.device("cuda"))
    before = compiled(_compute_slot_mapping_kernel)
    table.add_row([3, 4], 0)
    table.commit_block_table(1)
    table.compute_slot_mapping(1, torch.tensor([0, 300], dtype=torch.int32, device="cuda"),
                              torch.arange(300, device="cuda"))
    torch.cuda.synchronize()
    assert compiled(_compute_slot_mapping_kernel) == before
