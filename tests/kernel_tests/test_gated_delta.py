"""gated_delta_recurrent: the gated delta rule for a step's decodes and short prefills, one launch.

On the CPU under Triton's interpreter: against the float64 specification
(``gated_delta_ref``), in the layouts the engine patch hands it (q, k, v as strided views of
the convolution's output, grouped value heads, the state in slots, prompts with and without a
computed prefix, padding slots), and against vLLM 0.26's own recurrent kernel (the one its
decodes and speculative verifies run), which it must match bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from prefill_gate.kernels.gated_delta import gated_delta_recurrent
from prefill_gate.kernels.reference import gated_delta_ref
from tests.kernel_tests.cases import in_a_vllm_child



def make_step(lens, H=2, HV=4, K=32, V=16, slots=8, dtype=torch.float32, seed=0, device="cpu"):
    """One step's inputs as the GDN layer has them after its convolution: a packed
    [tokens, q | k | v] tensor and views into it."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    mixed = torch.randn(tokens, 2 * H * K + HV * V, generator=g).to(dtype).to(device)
    ab = torch.randn(tokens, 2 * HV, generator=g).to(dtype).to(device)  # a and b interleaved: strided views
    return {
        "q": mixed[:, :H * K].view(tokens, H, K), "k": mixed[:, H * K:2 * H * K].view(tokens, H, K),
        "v": mixed[:, 2 * H * K:].view(tokens, HV, V), "a": ab[:, :HV], "b": ab[:, HV:],
        "A_log": (torch.randn(HV, generator=g) * 0.5).to(device),
        "dt_bias": (torch.randn(HV, generator=g) * 0.5).to(device),
        "state": torch.randn(slots, HV, V, K, generator=g).to(device),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
    }


def test_a_mixed_step_matches_the_specification():
    """Three decodes, a prompt continuing from a cached state, a fresh prompt whose slot holds
    a previous owner's state (it must start from zero) and a padding entry (slot 0: untouched)."""
    lens = [1, 1, 7, 1, 12, 2]
    step = make_step(lens)
    indices = torch.tensor([3, 5, 2, 6, 1, 0], dtype=torch.int32)
    has_initial = torch.tensor([True, True, True, True, False, True])
    ref_out, ref_state = gated_delta_ref(**step, state_indices=indices, has_initial=has_initial)
    state = step["state"].clone()
    out = torch.full((sum(lens), 4, 16), 7.0)
    gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial, out=out)
    kept = ~torch.isnan(ref_out)
    assert torch.allclose(out.double()[kept], ref_out[kept], atol=1e-5, rtol=1e-5)
    assert torch.allclose(state.double(), ref_state, atol=1e-5, rtol=1e-5)
    assert (out[-2:] == 7.0).all()  # the padding entry wrote nothing
    assert torch.equal(state[0], step["state"][0]) and torch.equal(state[7], step["state"][7])  # nor any other slot
    # The fresh prompt really started from zero: from its slot's old contents it differs.
    ref_stale, _ = gated_delta_ref(**step, state_indices=indices, has_initial=None)
    assert not torch.allclose(ref_stale[10:22], ref_out[10:22], atol=1e-3)


@pytest.mark.parametrize("block_v,stages", [(8, 1), (16, 2), (32, 3)])
def test_the_launch_shape_does_not_change_the_numbers(block_v, stages):
    """Value rows per program and the token loop's pipeline depth are speed knobs (the GPU
    sweep compares them): every shape gives the same bits as the default under the interpreter."""
    lens = [1, 1, 9, 1, 5, 1]
    step = make_step(lens, V=32)
    indices = torch.tensor([3, 5, 2, 6, 1, 7], dtype=torch.int32)
    has_initial = torch.tensor([True, True, False, True, True, True])
    base_state, state = step["state"].clone(), step["state"].clone()
    base = gated_delta_recurrent(**{**step, "state": base_state}, state_indices=indices, has_initial=has_initial)
    out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial,
                                block_v=block_v, stages=stages)
    assert torch.equal(out, base) and torch.equal(state, base_state)


@pytest.mark.parametrize("block_v,walk", [(None, (8, 1)), (None, (4, 2)), (16, (64, 1)), (None, (32, 4))])
def test_the_prompts_own_launch_keeps_the_decodes_bits_and_the_rule(block_v, walk):
    """``walk``: the prompts in a launch of their own, their sums over the key columns in one
    round (``_update_walk``): the decodes' outputs and states are the one launch's bit for bit,
    the prompts' follow the specification to float32 rounding. Each sequence is computed by
    exactly one launch: a skipped one would keep its slot's old state, a twice-walked one would
    be two steps on, either far outside the tolerance."""
    lens = [1, 1, 9, 1, 5, 1]
    decodes, prompts = [0, 1, 3, 5], [2, 4]
    step = make_step(lens, V=32)
    indices = torch.tensor([3, 5, 2, 6, 1, 7], dtype=torch.int32)
    has_initial = torch.tensor([True, True, False, True, True, True])
    base_state, state = step["state"].clone(), step["state"].clone()
    base = gated_delta_recurrent(**{**step, "state": base_state}, state_indices=indices, has_initial=has_initial,
                                 block_v=block_v)
    out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial,
                                block_v=block_v, walk=walk)
    rows = step["cu_seqlens"].tolist()
    for n in decodes:
        assert torch.equal(out[rows[n]:rows[n + 1]], base[rows[n]:rows[n + 1]])
        assert torch.equal(state[indices[n]], base_state[indices[n]])
    ref_out, ref_state = gated_delta_ref(**step, state_indices=indices, has_initial=has_initial)
    for n in prompts:
        assert torch.allclose(out[rows[n]:rows[n + 1]].double(), ref_out[rows[n]:rows[n + 1]], atol=1e-5, rtol=1e-5)
        assert torch.allclose(state[indices[n]].double(), ref_state[indices[n]], atol=1e-5, rtol=1e-5)
    untouched = [i for i in range(8) if i not in indices.tolist()]
    assert torch.equal(state[untouched], step["state"][untouched])


def test_launch_shapes_are_checked():
    step = make_step([1, 4], V=32)
    indices = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        gated_delta_recurrent(**step, state_indices=indices, block_v=24)
    for walk in ((24, 1), (8, 3), (0, 1)):
        with pytest.raises(ValueError, match="walk: value rows a power of two"):
            gated_delta_recurrent(**step, state_indices=indices, walk=walk)
    with pytest.raises(ValueError, match="with chunk, prompts go in chunks"):
        gated_delta_recurrent(**make_step([1, 20], K=32, V=32), state_indices=indices, walk=(8, 1), chunk=16)


@pytest.mark.parametrize("chunk", [16, 32])
def test_prompts_in_chunks_match_the_specification(chunk):
    """``chunk``: a prompt of at least that many tokens goes in chunks (matrix products, the
    last chunk padded); decodes and shorter prompts token by token. Lengths cover a chunk
    exactly, several and a tail, one under a chunk; prompts continue a cached state or start
    fresh from a slot holding another request's state; a padding entry is skipped."""
    lens = [1, 40, 1, chunk, 2 * chunk + 1, chunk - 1, 17, 3]
    step = make_step(lens, V=16, slots=10, seed=11)
    indices = torch.tensor([3, 5, 2, 6, 1, 7, 4, 0], dtype=torch.int32)
    has_initial = torch.tensor([True, True, True, False, True, True, False, True])
    ref_out, ref_state = gated_delta_ref(**step, state_indices=indices, has_initial=has_initial)
    state = step["state"].clone()
    out = torch.full((sum(lens), 4, 16), 7.0)
    gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial, out=out,
                          chunk=chunk, block_v=16)
    kept = ~torch.isnan(ref_out)
    assert torch.allclose(out.double()[kept], ref_out[kept], atol=1e-5, rtol=1e-5)
    assert torch.allclose(state.double(), ref_state, atol=1e-5, rtol=1e-5)
    assert (out[-3:] == 7.0).all() and torch.equal(state[0], step["state"][0])  # the padding entry: untouched

    # Sequences shorter than a chunk take the token path: the same arithmetic as without chunks
    # (the same bits here; on a GPU the decodes' launch is the one without chunks, above).
    plain_state = step["state"].clone()
    plain = gated_delta_recurrent(**{**step, "state": plain_state}, state_indices=indices, has_initial=has_initial,
                                  block_v=16)
    short = [n for n, length in enumerate(lens) if length < chunk and indices[n] > 0]
    rows = torch.cat([torch.arange(int(step["cu_seqlens"][n]), int(step["cu_seqlens"][n + 1])) for n in short])
    assert torch.equal(out[rows], plain[rows])
    assert torch.equal(state[indices[short].long()], plain_state[indices[short].long()])


@pytest.mark.parametrize("chunk", [16, 32])
def test_with_chunks_the_decodes_keep_their_own_launch(monkeypatch, chunk):
    """On an H100 the chunks' program gave decodes other last bits than vLLM's (the token loop
    compiled differently beside CHUNK); the walk's decode launch gave vLLM's. With chunks the
    decodes must run in exactly that launch (grid, constants, warps: the same compiled program),
    and the chunks' launch must take no decode."""
    from prefill_gate.kernels import gated_delta
    from prefill_gate.kernels.launch import Launcher

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((grid, constants))

    monkeypatch.setattr(gated_delta, "_launch", Launcher(Recorder()))
    step = make_step([1, 40, 1, 3], K=32, V=32)
    indices = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    gated_delta_recurrent(**step, state_indices=indices, walk=(8, 1))
    walked = list(launches)
    launches.clear()
    gated_delta_recurrent(**step, state_indices=indices, chunk=chunk)
    decodes = [launch for launch in launches if launch[1]["ROWS"] != gated_delta.ROWS_PROMPTS.value]
    walk_decodes = [launch for launch in walked if launch[1]["ROWS"] == gated_delta.ROWS_DECODES.value]
    assert len(walk_decodes) == 1 and decodes == walk_decodes
    chunks = [constants for _, constants in launches if constants["CHUNK"]]
    assert [c["ROWS"] for c in chunks] == [gated_delta.ROWS_PROMPTS.value] and chunks[0]["CHUNK"] == chunk


@pytest.mark.parametrize("chunk,walk", [(16, None), (32, None), (0, (8, 1))])
def test_chunks_stay_exact_where_the_rule_is_hard(chunk, walk):
    """Inputs that break a careless chunked form: one key repeated with beta ~1 and no decay (the
    in-chunk system is as coupled as it gets; an inverse built from powers of A cancels away
    its precision), gates that close hard (log decays of ~-500 a token: a running sum in the
    thousands, where a last-token weight taken from a second sum is off by 1e-3) and two keys
    alternating. Every output and state within 1e-5 of the specification's largest value. The
    prompts' own launch (``walk``, its sums in one round) is held to the same."""
    lens = [64, 64, 64]
    step = make_step(lens, H=1, HV=2, V=16, seed=2)
    k, a, b = step["k"], step["a"], step["b"]
    k[0:64] = k[0:1].clone()
    b[0:64], a[0:64] = 30.0, -40.0
    a[64:128] = 25.0
    k[128:192:2], k[129:192:2] = k[128:129].clone(), k[129:130].clone()
    b[128:192], a[128:192] = 8.0, -30.0
    step["A_log"][:] = torch.tensor([3.0, -2.0])
    indices = torch.tensor([1, 2, 3], dtype=torch.int32)
    ref_out, ref_state = gated_delta_ref(**step, state_indices=indices)
    state = step["state"].clone()
    out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, chunk=chunk, block_v=16, walk=walk)
    assert (out.double() - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    assert (state.double() - ref_state).abs().max() <= 1e-5 * ref_state.abs().max()


def test_chunk_settings_are_checked():
    step = make_step([20])
    indices = torch.tensor([1], dtype=torch.int32)
    for chunk, block_v in ((8, 16), (24, 16), (64, 16), (16, 8)):  # 64: wrong on an H100 (see MAX_CHUNK)
        with pytest.raises(ValueError, match="chunk must be 0 or a power of two in 16..32"):
            gated_delta_recurrent(**step, state_indices=indices, chunk=chunk, block_v=block_v)
    with pytest.raises(ValueError, match="precision must be one of"):
        gated_delta_recurrent(**step, state_indices=indices, chunk=16, precision="fp8")


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("dtype,state_dtype,tol", [(torch.bfloat16, torch.float32, 2e-2),
                                                   (torch.float16, torch.bfloat16, 3e-2)])
def test_half_precision_inputs_and_states(dtype, state_dtype, tol, chunk):
    lens = [1, 5, 1, 20]
    step = make_step(lens, H=1, HV=2, K=16, V=16, dtype=dtype, seed=3)
    step["state"] = step["state"].to(state_dtype)
    indices = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    ref_out, ref_state = gated_delta_ref(**step, state_indices=indices)
    state = step["state"].clone()
    out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, chunk=chunk)
    assert out.dtype == dtype and state.dtype == state_dtype
    assert (out.double() - ref_out).abs().max() <= tol * ref_out.abs().max()
    assert (state.double() - ref_state).abs().max() <= tol * ref_state.abs().max()


def test_no_sequences_no_launch_and_bad_layouts_are_clear_errors():
    step = make_step([3])
    empty = {**step, "cu_seqlens": torch.tensor([0], dtype=torch.int32)}
    assert gated_delta_recurrent(**empty, state_indices=torch.zeros(0, dtype=torch.int32)).shape == (3, 4, 16)
    with pytest.raises(ValueError, match="q: want"):
        gated_delta_recurrent(**{**step, "q": step["q"].transpose(1, 2).contiguous().transpose(1, 2)},
                              state_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_recurrent(**{**step, "v": step["v"][:, :3]}, state_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="state: want"):
        gated_delta_recurrent(**{**step, "state": step["state"].transpose(2, 3)},
                              state_indices=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="an entry per sequence"):
        gated_delta_recurrent(**step, state_indices=torch.zeros(0, dtype=torch.int32))


def _against_vllm() -> None:
    """vLLM's recurrent kernel over the same step: per-token state indices that name the slot
    at a sequence's first token (read) and last (write), 0 (skip) between."""
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating_delta_rule_update

    lens = [1, 6, 1, 9, 1]
    step = make_step(lens, dtype=torch.bfloat16, seed=5)
    indices = torch.tensor([1, 3, 4, 5, 7], dtype=torch.int32)
    per_token = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    for n, length in enumerate(lens):
        per_token[n, 0] = per_token[n, length - 1] = indices[n]
    theirs_state = step["state"].clone()
    theirs, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=step["A_log"], a=step["a"], b=step["b"], dt_bias=step["dt_bias"], q=step["q"].unsqueeze(0),
        k=step["k"].unsqueeze(0), v=step["v"].unsqueeze(0), initial_state=theirs_state, inplace_final_state=True,
        cu_seqlens=step["cu_seqlens"], ssm_state_indices=per_token, use_qk_l2norm_in_kernel=True)
    ours_state = step["state"].clone()
    ours = gated_delta_recurrent(**{**step, "state": ours_state}, state_indices=indices)
    assert torch.equal(theirs.squeeze(0), ours), (theirs.squeeze(0).float() - ours.float()).abs().max()
    assert torch.equal(theirs_state, ours_state)
    print("identical")


def test_bit_identical_to_vllms_own_recurrent_kernel():
    """In a child: vLLM's kernels run under the interpreter only where vLLM was imported so."""
    pytest.importorskip("vllm")
    in_a_vllm_child("tests.kernel_tests.test_gated_delta:_against_vllm")


@pytest.mark.gpu
def test_on_the_gpu_against_the_specification():
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    lens = [1] * 16 + [300, 64]
    step = make_step(lens, H=16, HV=48, K=128, V=128, slots=40, dtype=torch.bfloat16, seed=9, device="cuda")
    indices = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda")
    has_initial = torch.tensor([True] * 17 + [False], device="cuda")
    ref_out, ref_state = gated_delta_ref(**{k: v.cpu() for k, v in step.items()}, state_indices=indices.cpu(),
                                         has_initial=has_initial.cpu())
    state = step["state"].clone()
    out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial)
    assert (out.double().cpu() - ref_out).abs().max() <= 2e-2 * ref_out.abs().max()
    assert (state.double().cpu() - ref_state).abs().max() <= 1e-3 * ref_state.abs().max()
    # Prompts in chunks: tf32 products round the state's increments to ~5e-4 each (10-bit
    # mantissas), float32 ("ieee") ones as the token walk does.
    base_out, base_state = out, state
    for walk in ((8, 1), (4, 1), (16, 2)):  # the prompts' own launch: the same walk in other programs
        state = step["state"].clone()
        out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial,
                                    walk=walk)
        assert torch.equal(out[:16], base_out[:16]) and torch.equal(state[1:17], base_state[1:17]), walk  # decodes
        assert (out.double().cpu() - ref_out).abs().max() <= 2e-2 * ref_out.abs().max(), walk
        assert (state.double().cpu() - ref_state).abs().max() <= 1e-3 * ref_state.abs().max(), walk
    for chunk, precision, state_tol in ((16, "tf32", 5e-3), (32, "tf32", 5e-3),
                                        (16, "ieee", 1e-3)):
        state = step["state"].clone()
        out = gated_delta_recurrent(**{**step, "state": state}, state_indices=indices, has_initial=has_initial,
                                    chunk=chunk, precision=precision)
        assert (out.double().cpu() - ref_out).abs().max() <= 2e-2 * ref_out.abs().max(), (chunk, precision)
        err = (state.double().cpu() - ref_state).abs().max() / ref_state.abs().max()
        assert err <= state_tol, (chunk, precision, err)


@pytest.mark.gpu
def test_on_the_gpu_fast_launches_give_tritons_bits(monkeypatch):
    """Repeat launches straight to the kept kernel (PREFILL_GATE_FAST_LAUNCH) compute what
    Triton's own launch does, bit for bit, decodes and the walk's prompts, also where a later
    step's tensors sit elsewhere (another kernel's specialisation: an unaligned view)."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    from prefill_gate.kernels import gated_delta
    from prefill_gate.kernels.launch import Launcher

    lens = [1] * 4 + [300]
    step = make_step(lens, H=16, HV=48, K=128, V=128, slots=40, dtype=torch.bfloat16, seed=11, device="cuda")
    indices = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda")
    has_initial = torch.tensor([True] * 4 + [False], device="cuda")

    def run(launcher, a):
        monkeypatch.setattr(gated_delta, "_launch", launcher)
        state = step["state"].clone()
        out = gated_delta_recurrent(**{**step, "a": a, "state": state}, state_indices=indices,
                                    has_initial=has_initial, walk=(8, 1))
        return out, state

    unaligned = torch.empty(step["a"].shape[0] * 48 + 1, dtype=step["a"].dtype, device="cuda")[1:].view(-1, 48)
    unaligned.copy_(step["a"])
    fast = Launcher(gated_delta._gated_delta_kernel, enabled=True)
    slow = Launcher(gated_delta._gated_delta_kernel, enabled=False)
    for a in (step["a"], unaligned):
        want = run(slow, a)
        for _ in range(3):
            got = run(fast, a)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert fast.fast_launches >= 4  # each shape's third launch on went straight to its kernel
