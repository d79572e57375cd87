"""causal_conv: a GDN step's causal convolution with the bounds read on the device.

On the CPU under Triton's interpreter: against a plain specification (every sequence shape a
step carries: decodes, prompts shorter than the state, prompts spanning several chunks, fresh
prompts whose slot holds an old state, padding), and bit for bit against vLLM 0.26's own
``causal_conv1d_fn`` over the same step, outputs and states. On a GPU (marked): the same
comparison with real compiled kernels, at the 27B hybrid's width.
"""

from __future__ import annotations

import os

import pytest
import torch

from prefill_gate.kernels.causal_conv import causal_conv
from tests.kernel_tests.cases import in_a_vllm_child

WIDTH = 4


def conv_spec(x, weight, bias, state, slots, has_initial, starts, silu=True):
    """Causal depthwise conv (+ SiLU) per sequence from the slot's last inputs (or zeros), in
    float64; returns (out, new state). Slot 0 is padding: no output (NaN), state untouched."""
    out = torch.full(x.shape, float("nan"), dtype=torch.float64)
    new = state.clone().double()
    for n, slot in enumerate(slots):
        lo, hi = int(starts[n]), int(starts[n + 1])
        if slot == 0:
            continue
        before = state[slot, :, :WIDTH - 1].double() if has_initial[n] else torch.zeros(x.shape[1], WIDTH - 1,
                                                                                      dtype=torch.float64)
        ext = torch.cat([before, x[lo:hi].T.double()], dim=1)
        for t in range(hi - lo):
            acc = (ext[:, t:t + WIDTH] * weight.double()).sum(1) + (0 if bias is None else bias.double())
            out[lo + t] = torch.nn.functional.silu(acc) if silu else acc
        new[slot, :, :WIDTH - 1] = ext[:, -(WIDTH - 1):]
    return out, new


def make_step(lens, dim=300, slots=12, dtype=torch.float32, seed=0, state_dim_first=True):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    x = torch.randn(tokens, dim + 20, generator=g).to(dtype)[:, :dim]  # rows strided, as a view of mixed_qkv
    weight = (torch.randn(dim, WIDTH, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(dim, generator=g) * 0.1).to(dtype)
    if state_dim_first:
        state = torch.randn(slots, dim, WIDTH - 1, generator=g).to(dtype)
    else:  # vLLM's other layout: [slots, WIDTH - 1, dim], handed over as a transposed view
        state = torch.randn(slots, WIDTH - 1, dim, generator=g).to(dtype).transpose(1, 2)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, bias, state, starts


# decodes; a 2-token prompt continuing a state (shorter than the state: shifted in); a fresh
# 19-token prompt over three chunks whose slot holds an old state; a 1-token fresh prompt;
# an 8-token prompt (exactly one chunk); a padding entry (slot 0)
LENS = [1, 1, 2, 19, 1, 8, 3]
SLOTS = [4, 9, 2, 7, 5, 11, 0]
INITIAL = [True, True, True, False, False, True, True]


@pytest.mark.parametrize("dim_first", [True, False])
def test_a_mixed_step_matches_the_specification(dim_first):
    x, weight, bias, state, starts = make_step(LENS, state_dim_first=dim_first)
    # the slots as vLLM's GDN metadata has them: a column of the block table (strided)
    table = torch.tensor([[s, 99, 98] for s in SLOTS], dtype=torch.int32)
    slots = table[:, 0]
    has_initial = torch.tensor(INITIAL)
    ref_out, ref_state = conv_spec(x, weight, bias, state, SLOTS, INITIAL, starts)
    before = state.clone()
    out = torch.full(x.shape, 7.0)
    causal_conv(x, weight, bias, state, slots, has_initial, starts, out=out)
    real = ~torch.isnan(ref_out)
    assert torch.allclose(out.double()[real], ref_out[real], atol=1e-5, rtol=1e-5)
    assert (out[~real] == 7.0).all()  # the padding entry wrote nothing
    assert torch.allclose(state.double(), ref_state, atol=0, rtol=0)  # states are copies of inputs
    for slot in set(range(state.shape[0])) - set(SLOTS[:-1]):
        assert torch.equal(state[slot], before[slot])  # no other slot touched


def test_no_bias_no_activation_and_the_grid_as_an_upper_bound():
    """Without bias or SiLU; and a step whose last sequences are empty (padded starts, as a graph
    over a padded batch has them): programs past the last chunk do nothing."""
    lens = [1, 13, 0, 0]
    x, weight, _, state, starts = make_step(lens, dim=40, seed=3)
    slots = torch.tensor([3, 5, 6, 8], dtype=torch.int32)
    has_initial = torch.tensor([True, True, True, True])
    ref_out, ref_state = conv_spec(x, weight, None, state, slots.tolist(), has_initial.tolist(), starts, silu=False)
    out = causal_conv(x, weight, None, state, slots, has_initial, starts, silu=False)
    assert out.shape == (14, 40) and out.is_contiguous()
    assert torch.allclose(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert torch.allclose(state.double(), ref_state, atol=0, rtol=0)  # empty sequences: their states kept


def test_refuses_what_it_does_not_cover():
    x, weight, bias, state, starts = make_step([3])
    slots, has_initial = torch.tensor([1], dtype=torch.int32), torch.tensor([True])
    with pytest.raises(ValueError, match="contiguous channels"):
        causal_conv(x.t().contiguous().t(), weight, bias, state, slots, has_initial, starts)
    with pytest.raises(ValueError, match="weight"):
        causal_conv(x, weight[:, :3], bias, state, slots, has_initial, starts)
    with pytest.raises(ValueError, match="dtype"):
        causal_conv(x, weight, bias, state.double(), slots, has_initial, starts)
    with pytest.raises(ValueError, match="2 sequences need 3 starts"):
        causal_conv(x, weight, bias, state, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([True, True]),
                    starts)


def random_steps(count: int, seed: int = 0) -> list[tuple[list[int], list[int], list[bool]]]:
    """``count`` steps of 1-9 sequences, lengths around the chunk and state sizes (1-4, 7-9,
    15-17, 30), distinct slots with now and then vLLM's null slot (0), mixed has_initial."""
    import random

    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        n = rng.randint(1, 9)
        lens = sorted((rng.choice([1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 30]) for _ in range(n)), key=lambda x: x != 1)
        slots = [0 if rng.random() < 0.1 else s for s in rng.sample(range(1, 21), n)]
        steps.append((lens, slots, [rng.random() < 0.6 for _ in range(n)]))
    return steps


def _against_vllm(device: str = "cpu", dim: int = 300, steps=None) -> None:
    """vLLM's causal_conv1d_fn over the same steps (default: the mixed step above and 6 random
    ones), with the chunk lists its GDN metadata builder makes (``compute_causal_conv1d_metadata``),
    the call the GDN patch makes today."""
    from types import SimpleNamespace

    import vllm.utils.torch_utils
    import vllm.v1.attention.backends.utils as backend_utils
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    if device == "cpu":  # the builder pins its host lists for the copy to a GPU; no pinning without one
        vllm.utils.torch_utils.PIN_MEMORY = backend_utils.PIN_MEMORY = False
        _static_grid_for_the_interpreter()

    steps = steps or [(LENS, SLOTS, INITIAL), *random_steps(6)]
    # Triton's interpreter has no bfloat16 arithmetic of its own (numpy has none): both kernels give
    # garbage alike there, so bfloat16 is compared on a GPU only.
    for dtype in (torch.float32,) if device == "cpu" else (torch.bfloat16, torch.float32):
        for n, (lens, slots, initial) in enumerate(steps):
            x, weight, bias, state, starts = make_step(list(lens), dim=dim, dtype=dtype, seed=11 + n,
                                                       slots=max(slots) + 2)
            x, weight, bias, state, starts = (t.to(device) for t in (x, weight, bias, state, starts))
            slot_t = torch.tensor(slots, dtype=torch.int32, device=device)
            has_initial = torch.tensor(initial, device=device)
            nums, batch_ptr, offsets = compute_causal_conv1d_metadata(starts.cpu(), device=torch.device(device))
            metadata = SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)
            theirs_state = state.clone()
            theirs = causal_conv1d_fn(x.transpose(0, 1), weight, bias, activation="silu", conv_states=theirs_state,
                                      has_initial_state=has_initial, cache_indices=slot_t, query_start_loc=starts,
                                      metadata=metadata).transpose(0, 1)
            ours_state = state.clone()
            ours = causal_conv(x, weight, bias, ours_state, slot_t, has_initial, starts)
            real = torch.tensor([s != 0 for i, s in enumerate(slots) for _ in range(lens[i])], device=device)
            what = (dtype, lens, slots, initial)
            assert theirs[real].isfinite().all(), what
            assert torch.equal(theirs[real], ours[real]), (what, (theirs[real].float() - ours[real].float()).abs().max())
            assert torch.equal(theirs_state, ours_state), what
    print("identical")


def _static_grid_for_the_interpreter() -> None:
    """vLLM's grid function stores its chunk lists into the launch's arguments (``META``), which
    under Triton's interpreter are already converted: the kernel would get raw torch tensors.
    Evaluate that grid on the call's own arguments first and launch with the grid it gives; the
    wrapper's arguments stay vLLM's."""
    import vllm.model_executor.layers.mamba.ops.causal_conv1d as module

    kernel = module._causal_conv1d_fwd_kernel

    class StaticGrid:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                meta = {**dict(zip(kernel.arg_names, args)), **kwargs}
                return kernel[grid(meta) if callable(grid) else grid](*args, **kwargs)
            return launch

    module._causal_conv1d_fwd_kernel = StaticGrid()


def test_bit_identical_to_vllms_own_convolution():
    """In a child: vLLM's kernels run under the interpreter only where vLLM was imported so."""
    pytest.importorskip("vllm")
    in_a_vllm_child("tests.kernel_tests.test_causal_conv:_against_vllm")


@pytest.mark.gpu
def test_on_the_gpu_bit_identical_to_vllms_convolution():
    """The 27B hybrid's conv width (10,240 channels), 16 decodes and prompts of 300 and 37 tokens."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)")
    lens = [1] * 16 + [300, 37, 2]
    _against_vllm("cuda", dim=10240, steps=[(lens, list(range(1, len(lens) + 1)), [True] * 17 + [False, True]),
                                            *random_steps(20, seed=1)])
