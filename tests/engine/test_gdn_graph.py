"""engine_patches.gdn_graph: whole CUDA graphs for a Gated DeltaNet hybrid's mixed steps.

On the CPU: the setting and what it needs; vLLM's own GDN metadata builder, subclassed, fed the
step a FULL graph's runner hands it (padded with sequences of no tokens in the null slot):
the support it claims, the persistent buffers every graph step's metadata lands in, the steps
it leaves alone; and the layer core on such a step against the float64 specification (Triton's
interpreter). On a GPU (marked; passed on an H100 at 2ac2f9c): the core captured in a CUDA
graph and replayed for steps of other shapes gives exactly the eager core's outputs and states.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from prefill_gate.engine_patches import gdn, gdn_graph
from prefill_gate.kernels.reference import gated_delta_ref
from tests.engine.harness import vllm_config
from tests.engine.test_gdn import HV, PREFIX, FakeLayer, H, K, V, conv_ref

LARGEST = 64  # the largest capture size of the configs below


def test_the_setting_and_what_it_needs():
    assert gdn_graph.mode_from_env({}) is False and gdn_graph.mode_from_env({gdn_graph.ENV: " ON "}) is True
    for bad in ("1", "yes", "full"):
        with pytest.raises(gdn_graph.GdnGraphError, match=f"{gdn_graph.ENV}='{bad}': expected off or on"):
            gdn_graph.mode_from_env({gdn_graph.ENV: bad})
    gdn_graph.check_settings(False, 0)  # off: nothing needed
    gdn_graph.check_settings(True, 512)
    with pytest.raises(gdn_graph.GdnGraphError, match="needs PREFILL_GATE_GDN_RECURRENT=on.*set PREFILL_GATE_GDN_GRAPH=off"):
        gdn_graph.check_settings(True, 0)


@pytest.fixture
def gdn_backend(monkeypatch):
    """vLLM's GDN backend, its builder restored after the test."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    monkeypatch.setattr(GDNAttentionBackend, "get_builder_cls", GDNAttentionBackend.get_builder_cls)
    return GDNAttentionBackend


def test_register_installs_the_builder_only_when_asked(gdn_backend, monkeypatch, caplog):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from prefill_gate import engine_patches

    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core", QwenGatedDeltaNetAttention._forward_core)
    for key in (gdn.CONV_ENV, gdn.WALK_ENV, gdn.CHUNK_ENV, gdn_graph.ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(gdn.ENV, "on")
    engine_patches.register()
    assert gdn_backend.get_builder_cls() is GDNAttentionMetadataBuilder and not gdn_graph.installed(gdn_backend)
    monkeypatch.setenv(gdn_graph.ENV, "on")
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    builder = gdn_backend.get_builder_cls()
    assert builder is not GDNAttentionMetadataBuilder and issubclass(builder, GDNAttentionMetadataBuilder)
    assert QwenGatedDeltaNetAttention._forward_core.prefill_gate_settings["conv"] == "ours"  # the graphs' convolution
    assert "whole CUDA graphs for mixed steps" in caplog.text and "PREFILL_GATE_GDN_GRAPH=on" in caplog.text
    engine_patches.register()  # every vLLM process registers: one builder, not a subclass of ours
    assert gdn_backend.get_builder_cls() is builder
    monkeypatch.setenv(gdn.CONV_ENV, "vllm")  # compose's default: the graphs need ours, and take it
    engine_patches.register()
    assert QwenGatedDeltaNetAttention._forward_core.prefill_gate_settings["conv"] == "ours"
    monkeypatch.delenv(gdn.CONV_ENV)
    monkeypatch.setenv(gdn.ENV, "off")
    with pytest.raises(gdn_graph.GdnGraphError, match="needs PREFILL_GATE_GDN_RECURRENT=on"):
        engine_patches.register()
    monkeypatch.setenv(gdn_graph.ENV, "sometimes")
    with pytest.raises(gdn_graph.GdnGraphError, match="expected off or on"):
        engine_patches.register()


def make_builder(model, mode="FULL", spec=0, max_seqs=16):
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    cfg = vllm_config(model, num_spec_tokens=spec, max_num_seqs=max_seqs)
    cfg.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, mode)
    cfg.compilation_config.max_cudagraph_capture_size = LARGEST
    spec_ = MambaSpec(block_size=16, shapes=((2 * H * K + HV * V, 3), (HV, V, K)),
                      dtypes=(torch.float32, torch.float32))
    cls = gdn_graph.builder_class(GDNAttentionMetadataBuilder, "always", CUDAGraphMode.FULL)
    return cls, cls(spec_, [PREFIX], cfg, torch.device("cpu")), cfg


def padded_step(lens, seq_lens, slots, pad_to, tokens):
    """The CommonAttentionMetadata a FULL graph's runner builds: ``pad_to`` sequences (those past
    the real ones with no tokens, sequence length 0 and the null slot), ``tokens`` tokens."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    extra = pad_to - len(lens)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] + [sum(lens)] * extra, dtype=torch.int32)
    seq = torch.tensor(seq_lens + [0] * extra, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=seq, num_reqs=pad_to,
        num_actual_tokens=tokens, max_query_len=max(lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(slots + [0] * extra, dtype=torch.int32).view(-1, 1),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), is_prefilling=None)


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    """vLLM's builders pin host memory for their copies when CUDA is there; a CPU step has none."""
    import vllm.utils.torch_utils
    import vllm.v1.attention.backends.utils as backend_utils

    monkeypatch.setattr(vllm.utils.torch_utils, "PIN_MEMORY", False, raising=False)
    monkeypatch.setattr(backend_utils, "PIN_MEMORY", False, raising=False)


def test_the_builder_pads_every_graph_step_into_the_same_buffers(tiny_model):
    cls, builder, cfg = make_builder(tiny_model)
    assert cls.get_cudagraph_support(cfg, None) == "always"
    # two decodes, a prompt continuing a cached state, a fresh prompt; padded to 7 sequences, 48 tokens
    step = builder.build(0, padded_step([1, 1, 9, 21], [40, 7, 30, 21], [5, 2, 7, 3], pad_to=7, tokens=48))
    assert getattr(step, gdn_graph.MARK) == 7 and step.num_actual_tokens == 48
    starts, slots, initial = builder.prefill_gate_buffers
    assert step.non_spec_query_start_loc.data_ptr() == starts.data_ptr()
    assert step.non_spec_state_indices_tensor.data_ptr() == slots.data_ptr()
    assert step.has_initial_state.data_ptr() == initial.data_ptr()
    assert step.non_spec_query_start_loc.tolist() == [0, 1, 2, 11, 32, 32, 32, 32]
    assert step.non_spec_state_indices_tensor.tolist() == [5, 2, 7, 3, 0, 0, 0]
    assert step.has_initial_state.tolist() == [True, True, True, False, False, False, False]
    # another step of another shape: the same buffers (what a replay reads), its own values
    other = builder.build(0, padded_step([1, 5], [90, 5], [4, 6], pad_to=7, tokens=8))
    assert getattr(other, gdn_graph.MARK) == 7
    assert other.non_spec_query_start_loc.data_ptr() == starts.data_ptr()
    assert other.non_spec_query_start_loc.tolist() == [0, 1, 6, 6, 6, 6, 6, 6]
    assert other.non_spec_state_indices_tensor.tolist() == [4, 6, 0, 0, 0, 0, 0]
    assert other.has_initial_state.tolist() == [True, False, False, False, False, False, False]
    # decodes only (vLLM leaves has_initial_state unset there): every decode continues its state
    decodes = builder.build(0, padded_step([1, 1, 1], [12, 30, 4], [1, 2, 3], pad_to=4, tokens=4))
    assert getattr(decodes, gdn_graph.MARK) == 4
    assert decodes.has_initial_state.tolist() == [True, True, True, False]
    assert decodes.non_spec_state_indices_tensor.tolist() == [1, 2, 3, 0]
    # the capture's dummy batch (vLLM's own would refuse a mixed one): built as a step
    dummy = builder.build_for_cudagraph_capture(padded_step([4] * 16, [4] * 16, [0] * 16, pad_to=16, tokens=LARGEST))
    assert getattr(dummy, gdn_graph.MARK) == 16 and dummy.has_initial_state.tolist() == [False] * 16
    # past the largest capture size no graph replays: vLLM's metadata as it was
    eager = builder.build(0, padded_step([1, 70], [40, 70], [5, 3], pad_to=2, tokens=71))
    assert not hasattr(eager, gdn_graph.MARK) and eager.non_spec_query_start_loc.data_ptr() != starts.data_ptr()


def test_the_builder_leaves_vllms_graphs_alone_where_mixed_steps_are_not_full_graphs(tiny_model, caplog):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    _, builder, _ = make_builder(tiny_model, mode="FULL_AND_PIECEWISE")  # vLLM's default: pieces for mixed steps
    with caplog.at_level(logging.WARNING, logger="vllm.prefill_gate"):
        step = builder.build(0, padded_step([1, 9], [40, 9], [5, 3], pad_to=2, tokens=10))
        builder.build(0, padded_step([1, 9], [40, 9], [5, 3], pad_to=2, tokens=10))
    assert not hasattr(step, gdn_graph.MARK)
    said = [r.getMessage() for r in caplog.records if gdn_graph.ENV in r.getMessage()]
    assert len(said) == 1 and "PIECEWISE, not full graphs" in said[0] and '"cudagraph_mode": "FULL"' in said[0]
    cls, builder, cfg = make_builder(tiny_model, spec=2)  # speculative decoding: vLLM's graphs
    assert cls.get_cudagraph_support(cfg, None) == GDNAttentionMetadataBuilder.get_cudagraph_support(cfg, None)
    assert not builder.graphs_whole_steps(8)


@pytest.mark.parametrize("walk", [None, (4, 1)])
def test_a_graph_step_runs_our_core_over_the_padding(tiny_model, walk):
    """The layer wrapper on a whole graph's step: our convolution and recurrence for every
    sequence the graph holds, whatever the step carries (a prompt past the limit included, and
    with vLLM's convolution asked for), matching the specification on the real tokens and
    touching nothing of the padding's."""
    _, builder, _ = make_builder(tiny_model)
    lens, has_initial, slots = [1, 1, 9, 21], [True, True, True, False], [5, 2, 7, 3]
    real, padded = sum(lens), 48
    step = builder.build(0, padded_step(lens, [40, 7, 30, 21], slots, pad_to=7, tokens=padded))
    g = torch.Generator().manual_seed(7)
    mixed_qkv = torch.randn(padded, 2 * H * K + HV * V, generator=g)
    ba = torch.randn(padded, 2 * HV, generator=g)
    b, a = ba[:, :HV], ba[:, HV:]
    layer = FakeLayer(seed=3)
    conv_before, ssm_before = layer.kv_cache[0].clone(), layer.kv_cache[1].clone()

    class Layer(FakeLayer):
        pass

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    vllm = SimpleNamespace(metadata_cls=GDNAttentionMetadata, is_conv_state_dim_first=lambda: True,
                           get_forward_context=lambda: SimpleNamespace(attn_metadata={PREFIX: step}),
                           causal_conv1d_fn=lambda *a, **kw: pytest.fail("vLLM's convolution in a graph"))
    gdn.install(Layer, 8, vllm, lambda message: None, walk=walk, conv="vllm")  # the 21-token prompt: past 8
    patched = Layer(seed=3)
    out = torch.full((padded, HV, V), 3.0)
    FakeLayer.calls.clear()
    patched._forward_core(mixed_qkv, b, a, out)
    assert FakeLayer.calls == []

    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    conv, conv_after = conv_ref(mixed_qkv[:real], layer.conv1d.weight[:, 0], layer.conv1d.bias, conv_before,
                                has_initial, slots, starts)
    q = conv[:, :H * K].reshape(real, H, K)
    k = conv[:, H * K:2 * H * K].reshape(real, H, K)
    v = conv[:, 2 * H * K:].reshape(real, HV, V)
    ref_out, ref_state = gated_delta_ref(q, k, v, a[:real], b[:real], layer.A_log, layer.dt_bias, ssm_before,
                                         torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
                                         torch.tensor(has_initial))
    assert torch.allclose(out[:real].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert (out[real:] == 3.0).all()
    assert torch.allclose(patched.kv_cache[1].double(), ref_state, atol=1e-5, rtol=1e-5)
    assert torch.allclose(patched.kv_cache[0], conv_after, atol=1e-6, rtol=1e-6)
    untouched = [n for n in range(conv_before.shape[0]) if n not in slots]  # the null slot (0) included
    assert torch.equal(patched.kv_cache[0][untouched], conv_before[untouched])
    assert torch.equal(patched.kv_cache[1][untouched], ssm_before[untouched])


@pytest.mark.gpu
def test_on_the_gpu_a_captured_core_replays_other_steps_exactly():
    """The layer core (our convolution, the 8x1 walk) captured once in a CUDA graph over a padded
    step of 64 tokens and 16 sequences, then replayed for steps of other shapes written into
    the same buffers: every replay's outputs and states bit for bit the eager core's on the
    unpadded step, from the same states."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from tests.engine.gdn_gpu import SIZES, make_layer
    from tests.engine.test_gdn import metadata

    tokens, seqs, slots_total = 64, 16, 24
    layer = make_layer(slots_total, seed=5)
    dim, HV_, V_ = layer.conv1d.weight.shape[0], SIZES["HV"], SIZES["V"]
    persistent = gdn_graph.buffers(seqs, "cuda")
    g = torch.Generator(device="cuda").manual_seed(9)
    qkv = torch.zeros(tokens, dim, dtype=torch.bfloat16, device="cuda")
    ba = torch.zeros(tokens, 2 * HV_, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(tokens, HV_, V_, dtype=torch.bfloat16, device="cuda")
    vllm = SimpleNamespace(is_conv_state_dim_first=_dim_first)

    def step(lens, slots, initial):
        """GDN metadata of a step in the persistent buffers, padded to the graph's shape."""
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

        extra = seqs - len(lens)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] + [sum(lens)] * extra, dtype=torch.int32)
        meta = GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=seqs, num_decode_tokens=0, num_spec_decodes=0,
            num_spec_decode_tokens=0, num_actual_tokens=tokens, has_initial_state=torch.tensor(initial + [False] * extra,
                                                                                                device="cuda"),
            non_spec_query_start_loc=starts.cuda(),
            non_spec_state_indices_tensor=torch.tensor(slots + [0] * extra, dtype=torch.int32, device="cuda"))
        return gdn_graph.padded_metadata(meta, SimpleNamespace(num_reqs=seqs), persistent)

    def core(meta):
        gdn.recurrent_core(layer, qkv, ba[:, :HV_], ba[:, HV_:], out, meta, vllm, conv="ours", seqs=seqs,
                           walk=(8, 1))

    capture_step = step([4] * seqs, [0] * seqs, [False] * seqs)  # the dummy batch: every slot the null one
    core(capture_step)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        core(capture_step)
    cases = [([1, 1, 1, 37, 5], [3, 7, 11, 2, 19], [True, True, True, False, True]),
             ([1] * 12, list(range(1, 13)), [True] * 12),
             ([50, 1, 9], [4, 22, 8], [True, True, False])]
    captured = layer.kv_cache  # the states the graph writes into
    for lens, slots, initial in cases:
        real = sum(lens)
        qkv.copy_(torch.randn(tokens, dim, generator=g, device="cuda").to(torch.bfloat16))
        ba.copy_(torch.randn(tokens, 2 * HV_, generator=g, device="cuda").to(torch.bfloat16))
        eager_layer = SimpleNamespace(**{**vars(layer), "kv_cache": tuple(t.clone() for t in captured)})
        step(lens, slots, initial)  # this step's values into the graph's buffers
        graph.replay()
        eager_out = torch.zeros(real, HV_, V_, dtype=torch.bfloat16, device="cuda")
        gdn.recurrent_core(eager_layer, qkv[:real], ba[:real, :HV_], ba[:real, HV_:], eager_out,
                           metadata(lens, initial, slots, device="cuda"), vllm, conv="ours", walk=(8, 1))
        torch.cuda.synchronize()
        assert torch.equal(out[:real], eager_out), lens
        assert torch.equal(captured[0], eager_layer.kv_cache[0]), lens
        assert torch.equal(captured[1], eager_layer.kv_cache[1]), lens


def _dim_first():
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()
