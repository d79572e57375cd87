"""engine_patches.gdn: short-prompt steps of a Gated DeltaNet layer through one recurrent launch.

On the CPU: the setting, which steps are taken, and the glue around the kernel (the conv call
vLLM makes, q/k/v cut into heads, a/b, state slots, fresh prompts from zero, the output in the
layer's buffer) against the float64 specification, through vLLM's real metadata class and the
wrapper installed on a layer class; the real layer class wrapped by register(). Triton's
interpreter runs the kernel. The GPU test runs vLLM's path and ours on the same step on real
kernels (bench/gpu/gdn_h200.sh runs it on the H200).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from prefill_gate.engine_patches import gdn
from prefill_gate.kernels.reference import gated_delta_ref

H, HV, K, V, WIDTH = 2, 4, 16, 16, 4
PREFIX = "model.layers.0.linear_attn"


def test_the_setting():
    assert gdn.mode_from_env({}) == 0
    assert gdn.mode_from_env({gdn.ENV: "off"}) == 0
    assert gdn.mode_from_env({gdn.ENV: " ON "}) == gdn.ON_TOKENS
    assert gdn.mode_from_env({gdn.ENV: "128"}) == 128
    for bad in ("sometimes", "0", "100000", "-5"):
        with pytest.raises(gdn.GdnRecurrentError, match=gdn.ENV):
            gdn.mode_from_env({gdn.ENV: bad})
    assert gdn.chunk_from_env({}) == 0 and gdn.chunk_from_env({gdn.CHUNK_ENV: "off"}) == 0
    assert gdn.chunk_from_env({gdn.CHUNK_ENV: " 32 "}) == 32
    for bad in ("on", "8", "48", "64", "128"):  # 64: wrong on an H100, no longer offered
        with pytest.raises(gdn.GdnRecurrentError, match=gdn.CHUNK_ENV):
            gdn.chunk_from_env({gdn.CHUNK_ENV: bad})
    assert gdn.walk_from_env({}) is None and gdn.walk_from_env({gdn.WALK_ENV: "off"}) is None
    assert gdn.walk_from_env({gdn.WALK_ENV: " 8X1 "}) == (8, 1) and gdn.walk_from_env({gdn.WALK_ENV: "128x8"}) == (128, 8)
    for bad in ("on", "8", "12x1", "8x3", "256x1", "0x1", "x", "8x1x1"):
        with pytest.raises(gdn.GdnRecurrentError, match=f"{gdn.WALK_ENV}='{bad}': expected off or ROWSxWARPS"):
            gdn.walk_from_env({gdn.WALK_ENV: bad})
    with pytest.raises(gdn.GdnRecurrentError, match="set one of the two"):
        gdn.walk_from_env({gdn.WALK_ENV: "8x1", gdn.CHUNK_ENV: "16"})
    assert gdn.conv_from_env({}) == "vllm" and gdn.conv_from_env({gdn.CONV_ENV: " Ours "}) == "ours"
    for bad in ("on", "mine", "fla"):
        with pytest.raises(gdn.GdnRecurrentError, match=f"{gdn.CONV_ENV}='{bad}': expected vllm or ours"):
            gdn.conv_from_env({gdn.CONV_ENV: bad})


def metadata(lens, has_initial, slots, spec=False, device="cpu"):
    """vLLM's GDN metadata for a step of decodes (length 1, first) and prompts."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    decodes = sum(1 for n in lens if n == 1)
    return GDNAttentionMetadata(
        num_prefills=len(lens) - decodes, num_prefill_tokens=sum(lens) - decodes, num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=sum(lens),
        has_initial_state=torch.tensor(has_initial, device=device),
        non_spec_query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                              device=device),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32, device=device),
        spec_sequence_masks=torch.ones(1, dtype=torch.bool) if spec else None)


def test_which_steps_take_the_recurrence():
    step = metadata([1, 1, 30, 20], [True, True, False, True], [1, 2, 3, 4])
    assert gdn.eligible(step, 50) and not gdn.eligible(step, 49) and not gdn.eligible(step, 0)
    assert not gdn.eligible(metadata([1, 1], [True, True], [1, 2]), 50)  # decode-only: vLLM's graphs
    assert not gdn.eligible(metadata([1, 8], [True, True], [1, 2], spec=True), 50)
    assert not gdn.eligible(None, 50)


def conv_ref(x, weight, bias, state, has_initial, slots, starts):
    """Causal depthwise conv + SiLU per sequence, from the slot's last inputs (or zeros);
    returns (out [tokens, dim], the new states). ``state``: [slots, dim, WIDTH - 1]."""
    out, new = torch.empty_like(x), state.clone()
    for n in range(len(slots)):
        lo, hi = int(starts[n]), int(starts[n + 1])
        before = state[slots[n]] if has_initial[n] else torch.zeros_like(state[slots[n]])
        ext = torch.cat([before, x[lo:hi].T], dim=1)  # [dim, WIDTH - 1 + n]
        for t in range(hi - lo):
            out[lo + t] = torch.nn.functional.silu((ext[:, t:t + WIDTH] * weight).sum(1) + bias)
        new[slots[n]] = ext[:, -(WIDTH - 1):]
    return out, new


class FakeLayer:
    """What ``recurrent_core`` reads from vLLM's QwenGatedDeltaNetAttention."""

    calls: list = []

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        dim = 2 * H * K + HV * V
        self.prefix, self.tp_size, self.activation = PREFIX, 1, "silu"
        self.key_dim, self.head_k_dim, self.head_v_dim = H * K, K, V
        self.conv1d = SimpleNamespace(weight=torch.randn(dim, 1, WIDTH, generator=g) * 0.5,
                                      bias=torch.randn(dim, generator=g) * 0.1)
        self.A_log = torch.randn(HV, generator=g) * 0.5
        self.dt_bias = torch.randn(HV, generator=g) * 0.5
        self.kv_cache = (torch.randn(8, dim, WIDTH - 1, generator=g),  # conv state, dim first
                         torch.randn(8, HV, V, K, generator=g))

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        FakeLayer.calls.append(("vllm", mixed_qkv.shape[0]))


def fake_vllm(step):
    seen = []

    def causal_conv1d_fn(x, weight, bias, *, activation, conv_states, has_initial_state, cache_indices,
                         query_start_loc, metadata):
        assert activation == "silu" and metadata is step and x.shape[0] == weight.shape[0]  # [dim, tokens]
        seen.append("conv")
        out, new = conv_ref(x.T, weight, bias, conv_states, has_initial_state.tolist(), cache_indices.tolist(),
                            query_start_loc.tolist())
        conv_states.copy_(new)
        return out.T

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    return SimpleNamespace(
        metadata_cls=GDNAttentionMetadata, causal_conv1d_fn=causal_conv1d_fn, is_conv_state_dim_first=lambda: True,
        get_forward_context=lambda: SimpleNamespace(attn_metadata={PREFIX: step}), seen=seen)


@pytest.mark.parametrize("chunk,walk,conv", [(0, None, "vllm"), (16, None, "vllm"), (0, (4, 1), "vllm"),
                                             (0, (4, 1), "ours")])
def test_the_layer_core_matches_the_specification(chunk, walk, conv):
    """A step of two decodes, a prompt continuing a cached state and a fresh prompt whose slot
    holds another request's old state, padded to 48 tokens as a graph-less step may be; with
    PREFILL_GATE_GDN_CHUNK=16 the 21-token prompt goes in chunks, with PREFILL_GATE_GDN_WALK
    both prompts in a launch of their own, with PREFILL_GATE_GDN_CONV=ours our convolution
    instead of vLLM's call."""
    lens, has_initial, slots = [1, 1, 9, 21], [True, True, True, False], [5, 2, 7, 3]
    step = metadata(lens, has_initial, slots)
    tokens, padded = sum(lens), 48
    g = torch.Generator().manual_seed(1)
    mixed_qkv = torch.randn(padded, 2 * H * K + HV * V + 24, generator=g)[:, :2 * H * K + HV * V]  # a strided view
    ba = torch.randn(padded, 2 * HV, generator=g)
    b, a = ba[:, :HV], ba[:, HV:]
    layer = FakeLayer()
    conv_before, ssm_before = layer.kv_cache[0].clone(), layer.kv_cache[1].clone()

    class Layer(FakeLayer):
        pass

    vllm = fake_vllm(step)
    gdn.install(Layer, 64, vllm, lambda message: None, chunk=chunk, walk=walk, conv=conv)
    assert Layer._forward_core.prefill_gate_settings == {"limit": 64, "chunk": chunk, "walk": walk, "conv": conv}
    patched = Layer()
    patched.kv_cache = tuple(t.clone() for t in layer.kv_cache)
    out = torch.zeros(padded, HV, V)
    FakeLayer.calls.clear()
    patched._forward_core(mixed_qkv, b, a, out)
    assert vllm.seen == (["conv"] if conv == "vllm" else []) and FakeLayer.calls == []  # our path

    conv, conv_after = conv_ref(mixed_qkv[:tokens], layer.conv1d.weight[:, 0], layer.conv1d.bias, conv_before,
                                has_initial, slots, step.non_spec_query_start_loc.tolist())
    q = conv[:, :H * K].reshape(tokens, H, K)
    k = conv[:, H * K:2 * H * K].reshape(tokens, H, K)
    v = conv[:, 2 * H * K:].reshape(tokens, HV, V)
    ref_out, ref_state = gated_delta_ref(q, k, v, a[:tokens], b[:tokens], layer.A_log, layer.dt_bias, ssm_before,
                                         step.non_spec_query_start_loc, step.non_spec_state_indices_tensor,
                                         step.has_initial_state)
    assert torch.allclose(out[:tokens].double(), ref_out, atol=1e-5, rtol=1e-5)
    assert (out[tokens:] == 0).all()  # the padding rows stay as vLLM leaves them
    assert torch.allclose(patched.kv_cache[1].double(), ref_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(patched.kv_cache[0], conv_after)  # (ours: the same inputs copied, so exactly)

    # A step past the limit, and one with no metadata for this layer, are vLLM's.
    Layer._forward_core.prefill_gate_settings["limit"] = 29
    patched._forward_core(mixed_qkv, b, a, out)
    vllm.get_forward_context = lambda: SimpleNamespace(attn_metadata=None)
    patched._forward_core(mixed_qkv, b, a, out)
    assert FakeLayer.calls == [("vllm", padded), ("vllm", padded)]
    gdn.install(Layer, 0, vllm, lambda message: None)  # off again: the limit, not a second wrapper
    assert Layer._forward_core.prefill_gate_settings["limit"] == 0


@pytest.mark.parametrize("walk", [None, (4, 1)])
def test_the_core_with_our_convolution_is_blind_to_a_graphs_padding(walk):
    """What a CUDA graph over padded mixed steps would hand the core (issue 50's whole-graph
    steps; vLLM pads a FULL graph's batch so): more tokens than the sequences hold (rows of
    garbage at the end) and sequences past the real ones with no tokens and vLLM's null slot.
    With PREFILL_GATE_GDN_CONV=ours every bound is read on the device, so the padded call must
    give the real tokens' outputs and every state exactly as the unpadded call does, and touch
    nothing else: a padding error here would corrupt recurrent state silently."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    lens, has_initial, slots = [1, 1, 9, 21], [True, True, True, False], [5, 2, 7, 3]
    real, padded_tokens, pad_seqs = sum(lens), 48, 3
    g = torch.Generator().manual_seed(4)
    mixed_qkv = torch.randn(padded_tokens, 2 * H * K + HV * V, generator=g)
    ba = torch.randn(padded_tokens, 2 * HV, generator=g)
    layer = FakeLayer(seed=2)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def step(tokens, extra):
        return GDNAttentionMetadata(
            num_prefills=2 + extra, num_prefill_tokens=tokens - 2, num_decodes=2, num_decode_tokens=2,
            num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=tokens,
            has_initial_state=torch.tensor(has_initial + [False] * extra),
            non_spec_query_start_loc=torch.tensor(starts + [real] * extra, dtype=torch.int32),
            non_spec_state_indices_tensor=torch.tensor(slots + [0] * extra, dtype=torch.int32),
            spec_sequence_masks=None)

    runs = []
    for tokens, extra in ((real, 0), (padded_tokens, pad_seqs)):
        kv = tuple(t.clone() for t in layer.kv_cache)
        core = SimpleNamespace(**{**vars(layer), "kv_cache": kv})
        out = torch.full((padded_tokens, HV, V), 3.0)
        gdn.recurrent_core(core, mixed_qkv, ba[:, :HV], ba[:, HV:], out, step(tokens, extra), fake_vllm(None),
                           conv="ours", walk=walk)
        runs.append((out, kv))
    (out, kv), (out_padded, kv_padded) = runs
    assert torch.equal(out[:real], out_padded[:real])
    assert torch.equal(kv[0], kv_padded[0]) and torch.equal(kv[1], kv_padded[1])
    untouched = [n for n in range(layer.kv_cache[0].shape[0]) if n not in slots]
    assert torch.equal(kv_padded[0][untouched], layer.kv_cache[0][untouched])  # the null slot (0) included
    assert torch.equal(kv_padded[1][untouched], layer.kv_cache[1][untouched])
    assert (out_padded[real:] == 3.0).all()  # the padding rows: not written


def test_register_wraps_vllms_layer_only_when_asked(monkeypatch, caplog):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from prefill_gate import engine_patches

    original = QwenGatedDeltaNetAttention._forward_core
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core", original)  # restored after the test
    monkeypatch.delenv(gdn.ENV, raising=False)
    engine_patches.register()
    assert QwenGatedDeltaNetAttention._forward_core is original
    monkeypatch.setenv(gdn.ENV, "on")
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    wrapped = QwenGatedDeltaNetAttention._forward_core
    assert wrapped.prefill_gate_settings == {"limit": gdn.ON_TOKENS, "chunk": 0, "walk": None, "conv": "vllm"}
    assert wrapped.__wrapped__ is original
    assert f"at most {gdn.ON_TOKENS} prompt tokens run one recurrent launch" in caplog.text
    assert "prompts token by token" in caplog.text and "PREFILL_GATE_GDN_WALK=off" in caplog.text
    monkeypatch.setenv(gdn.WALK_ENV, "8x1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert wrapped.prefill_gate_settings == {"limit": gdn.ON_TOKENS, "chunk": 0, "walk": (8, 1), "conv": "vllm"}
    assert "PREFILL_GATE_GDN_WALK=8x1" in caplog.text
    monkeypatch.setenv(gdn.CONV_ENV, "ours")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert wrapped.prefill_gate_settings["conv"] == "ours" and "PREFILL_GATE_GDN_CONV=ours" in caplog.text
    monkeypatch.setenv(gdn.CONV_ENV, "theirs")
    with pytest.raises(gdn.GdnRecurrentError, match="PREFILL_GATE_GDN_CONV='theirs'"):
        engine_patches.register()
    monkeypatch.delenv(gdn.CONV_ENV)
    monkeypatch.delenv(gdn.WALK_ENV)
    monkeypatch.setenv(gdn.CHUNK_ENV, "32")
    engine_patches.register()
    assert wrapped.prefill_gate_settings == {"limit": gdn.ON_TOKENS, "chunk": 32, "walk": None, "conv": "vllm"}
    monkeypatch.setenv(gdn.CHUNK_ENV, "12")
    with pytest.raises(gdn.GdnRecurrentError, match="PREFILL_GATE_GDN_CHUNK='12'"):
        engine_patches.register()
    monkeypatch.delenv(gdn.CHUNK_ENV)
    monkeypatch.setenv(gdn.ENV, "off")
    engine_patches.register()
    assert QwenGatedDeltaNetAttention._forward_core is wrapped and wrapped.prefill_gate_settings["limit"] == 0
    monkeypatch.setenv(gdn.ENV, "lots")
    with pytest.raises(gdn.GdnRecurrentError, match="PREFILL_GATE_GDN_RECURRENT='lots'"):
        engine_patches.register()
    monkeypatch.setenv(gdn.ENV, "on")
    monkeypatch.setenv("PREFILL_GATE_FAST_LAUNCH", "yes")
    with pytest.raises(ValueError, match="PREFILL_GATE_FAST_LAUNCH='yes': expected on or off"):
        engine_patches.register()
    monkeypatch.setenv("PREFILL_GATE_FAST_LAUNCH", "on")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert "PREFILL_GATE_FAST_LAUNCH=on" in caplog.text


@pytest.mark.gpu
def test_on_the_gpu_vllms_path_and_ours_agree():
    """One mixed step of a real-sized layer (48 value heads of 128, 16 key heads) through
    vLLM's conv and chunked path and through ours, from the same states."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from tests.engine.gdn_gpu import compare_paths

    worst = compare_paths(prompt_lens=[300, 37], decodes=8)
    assert worst["out_rel"] <= 2e-2 and worst["state_rel"] <= 2e-2 and worst["decode_out_equal"], worst
    chunked = compare_paths(prompt_lens=[300, 37], decodes=8, launch={"chunk": 16})  # PREFILL_GATE_GDN_CHUNK=16
    assert chunked["out_rel"] <= 2e-2 and chunked["state_rel"] <= 2e-2 and chunked["decode_out_equal"], chunked
    for walk in ((8, 1), (4, 1), (16, 2)):  # PREFILL_GATE_GDN_WALK: the decodes keep their launch and bits
        walked = compare_paths(prompt_lens=[300, 37], decodes=8, launch={"walk": walk})
        assert walked["out_rel"] <= 2e-2 and walked["state_rel"] <= 2e-2 and walked["decode_out_equal"], (walk, walked)
    # PREFILL_GATE_GDN_CONV=ours: the decodes' bits and the convolution states exactly vLLM's
    ours = compare_paths(prompt_lens=[300, 37], decodes=8, launch={"walk": (8, 1), "conv": "ours"})
    assert ours["out_rel"] <= 2e-2 and ours["state_rel"] <= 2e-2, ours
    assert ours["decode_out_equal"] and ours["conv_state_equal"], ours



def test_the_control_file_switches_the_layers_settings_on_a_running_server(tmp_path, monkeypatch):
    """PREFILL_GATE_PACING_CONTROL_FILE (the pacer's) also carries the GDN settings: the layers
    look at it at most once a second, take a changed file's settings, keep theirs on a bad one,
    and get the environment's back from an emptied file; the fast launches follow."""
    from prefill_gate.engine_patches import config
    from prefill_gate.kernels import causal_conv, gated_delta

    assert gdn.PACING_PREFIX == config.PREFIX and config.control_key is gdn.control_key  # one rule, both readers
    monkeypatch.setattr(gated_delta._launch, "enabled", False)
    monkeypatch.setattr(causal_conv._launch, "enabled", False)  # (restored after the test, as the line above)
    control, now, said = tmp_path / "control.env", [100.0], []
    env = {gdn.ENV: "on", gdn.WALK_ENV: "8x1", "PREFILL_GATE_FAST_LAUNCH": "off"}  # the server's own: launches off
    settings = {"limit": gdn.ON_TOKENS, "chunk": 0, "walk": (8, 1), "conv": "vllm"}
    watch = gdn.Control(str(control), settings, said.append, clock=lambda: now[0], environ=env)
    stamps = iter(range(10**18, 10**19, 10**9))

    def write(text):
        control.write_text(text)
        os.utime(control, ns=(next(stamps), next(stamps)))

    watch.poll()  # no file: the running settings
    assert settings == {"limit": gdn.ON_TOKENS, "chunk": 0, "walk": (8, 1), "conv": "vllm"} and said == []
    write("PREFILL_GATE_PACING_TARGET_ITL_MS=40\nPREFILL_GATE_GDN_RECURRENT=off\nPREFILL_GATE_FAST_LAUNCH=on\n")
    now[0] += 1.0
    watch.poll()
    assert settings["limit"] == 0 and gated_delta._launch.enabled  # vLLM's path, fast launches on
    assert "PREFILL_GATE_GDN_RECURRENT=off" in said[-1] and "PREFILL_GATE_FAST_LAUNCH=on" in said[-1]
    write("PREFILL_GATE_GDN_RECURRENT=256\nPREFILL_GATE_GDN_CONV=ours\n")
    now[0] += 0.5
    watch.poll()  # within the second: not looked at
    assert settings["limit"] == 0
    now[0] += 0.6
    watch.poll()
    assert settings == {"limit": 256, "chunk": 0, "walk": (8, 1), "conv": "ours"} and not gated_delta._launch.enabled
    assert "PREFILL_GATE_GDN_CONV=ours" in said[-1]
    write("PREFILL_GATE_GDN_WALK=3x1\n")  # not a launch shape: refused, settings kept
    now[0] += 1.1
    watch.poll()
    assert settings["limit"] == 256 and settings["walk"] == (8, 1)
    write("PREFILL_GATE_GDN_RECURRENT=128\nPREFILL_GATE_GDN_WLAK=4x1\n")  # a typo: refused, settings kept
    now[0] += 1.1
    watch.poll()
    assert settings["limit"] == 256
    write("")  # emptied: the environment's
    now[0] += 1.1
    watch.poll()
    assert settings == {"limit": gdn.ON_TOKENS, "chunk": 0, "walk": (8, 1), "conv": "vllm"}
    write("PREFILL_GATE_FAST_LAUNCH=on\n")
    now[0] += 1.1
    watch.poll()
    assert gated_delta._launch.enabled and causal_conv._launch.enabled
    write("")
    now[0] += 1.1
    watch.poll()
    assert not gated_delta._launch.enabled and not causal_conv._launch.enabled  # the environment's again


def test_the_wrapper_looks_at_the_control_file_on_its_calls(tmp_path):
    step = metadata([1, 5], [True, False], [2, 3])
    control = tmp_path / "control.env"
    control.write_text("PREFILL_GATE_GDN_RECURRENT=off\n")

    class Layer(FakeLayer):
        pass

    vllm = fake_vllm(step)
    gdn.install(Layer, 64, vllm, lambda message: None, control=str(control))
    patched = Layer()
    FakeLayer.calls.clear()
    mixed_qkv = torch.zeros(8, 2 * H * K + HV * V)
    ab = torch.zeros(8, 2 * HV)
    patched._forward_core(mixed_qkv, ab[:, :HV], ab[:, HV:], torch.zeros(8, HV, V))
    assert Layer._forward_core.prefill_gate_settings["limit"] == 0 and FakeLayer.calls == [("vllm", 8)]
    gdn.install(Layer, 64, vllm, lambda message: None)  # installed again without one: no file read
    control.write_text("PREFILL_GATE_GDN_RECURRENT=128\n")
    patched._forward_core(mixed_qkv, ab[:, :HV], ab[:, HV:], torch.zeros(8, HV, V))
    assert Layer._forward_core.prefill_gate_settings["limit"] == 64
