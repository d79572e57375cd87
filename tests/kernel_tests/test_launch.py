"""prefill_gate.kernels.launch: repeat launches straight to the compiled kernel Triton chose.

No GPU here: Triton's driver and the compiled kernel are stand-ins that record what they are
asked, but the kernel's parameters are a real JIT function's and the arguments' specialisation
is Triton's own (its CUDA backend for sm_90), so what a key tells apart is what Triton tells apart.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from prefill_gate.kernels import launch as launch_mod
from prefill_gate.kernels.launch import FastLaunchError, Launcher, enabled_from_env


def _kernel(x, y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = 0):  # noqa: N803 - Triton's constants
    pass


class Compiled:
    """A compiled kernel's launch surface: what ``Launcher`` calls on it."""

    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.runs.append(args)


class Jit:
    """A JIT kernel's surface: a real JIT function's parameters, Triton's CUDA backend in the
    device cache its first launch creates, and the launches that went through it."""

    def __init__(self):
        self.params = JITFunction(_kernel).params
        self.device_caches = {}
        self.slow = []
        self.compiled = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.device_caches[0] = ({}, {}, None, make_backend(GPUTarget("cuda", 90, 32)), None)
            self.slow.append((grid, args, kwargs))
            self.compiled.append(Compiled())
            return self.compiled[-1]
        return launch


class Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(driver, "_active", Driver())
    return Jit()


def test_the_setting_reads_on_and_off_and_refuses_anything_else():
    assert enabled_from_env({}) and enabled_from_env({"PREFILL_GATE_FAST_LAUNCH": " On "})  # on since its GPU run
    assert not enabled_from_env({"PREFILL_GATE_FAST_LAUNCH": "off"})
    with pytest.raises(FastLaunchError, match="expected on or off"):
        enabled_from_env({"PREFILL_GATE_FAST_LAUNCH": "1"})


def test_a_repeat_launch_goes_straight_to_the_kept_kernel_with_every_parameter_in_order(jit):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    launch = Launcher(jit, enabled=True)
    for _ in range(3):
        launch((4, 2), x, y, 32, 0.5, BLOCK=16, num_warps=4)
    # the first two through Triton (the first creates the device cache the key needs, the
    # second keeps the kernel), the third straight to it
    assert len(jit.slow) == 2 and launch.fast_launches == 1
    assert jit.slow[0] == ((4, 2), (x, y, 32, 0.5), {"BLOCK": 16, "num_warps": 4})
    kept = jit.compiled[1]
    (run,) = kept.runs
    assert run[:7] == (4, 2, 1, 1234, "function", "packed", None)
    assert run[9:] == (x, y, 32, 0.5, 16, 0)  # FLAG's default fills the constant left out


@pytest.mark.parametrize("change, same", [
    (lambda a: {**a, "x": torch.zeros(64)[1:]}, False),  # no longer 16-byte aligned
    (lambda a: {**a, "x": torch.zeros(64)[4:]}, True),  # 16 bytes on: still aligned
    (lambda a: {**a, "y": torch.zeros(64, dtype=torch.float16)}, False),  # another dtype
    (lambda a: {**a, "n": 1}, False),  # Triton makes 1 a constant
    (lambda a: {**a, "n": 17}, False),  # no longer a multiple of 16
    (lambda a: {**a, "n": 48}, True),  # still a multiple of 16
    (lambda a: {**a, "n": 2 ** 31 + 16}, False),  # 64-bit
    (lambda a: {**a, "scale": 3.0}, True),  # floats are not specialised
    (lambda a: {**a, "BLOCK": 32}, False),  # another constant
    (lambda a: {**a, "num_warps": 8}, False),  # another launch option
])
def test_a_launch_reuses_a_kernel_only_where_triton_would_pick_the_same(jit, change, same):
    base = {"x": torch.zeros(64), "y": torch.zeros(64, dtype=torch.bfloat16), "n": 32, "scale": 0.5,
            "BLOCK": 16, "num_warps": 4}
    launch = Launcher(jit, enabled=True)

    def go(a):
        launch((4,), a["x"], a["y"], a["n"], a["scale"], BLOCK=a["BLOCK"], num_warps=a["num_warps"])

    go(base), go(base)  # kept
    go(change(base))
    assert launch.fast_launches == (1 if same else 0)
    assert len(jit.slow) == (2 if same else 3)
    go(change(base))  # the changed one is kept in its turn
    assert launch.fast_launches == (2 if same else 1)


def test_off_or_under_the_interpreter_every_launch_goes_through_triton(jit, monkeypatch):
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    off = Launcher(jit, enabled=False)
    for _ in range(3):
        off((4,), x, y, 32, 0.5, BLOCK=16, num_warps=4)
    assert len(jit.slow) == 3 and off.fast_launches == 0

    class Interpreted:  # the interpreter's function: no binder, no compiled kernels
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Interpreted.calls += 1
            return launch

    interpreted = Launcher(Interpreted(), enabled=True)
    for _ in range(3):
        interpreted((4,), x, y, 32, 0.5, BLOCK=16, num_warps=4)
    assert Interpreted.calls == 3 and interpreted.fast_launches == 0


def test_the_gated_delta_kernel_launches_through_a_launcher_that_reads_the_setting(monkeypatch):
    from prefill_gate.kernels import gated_delta

    assert isinstance(gated_delta._launch, Launcher) and gated_delta._launch.kernel is gated_delta._gated_delta_kernel
    monkeypatch.setenv(launch_mod.ENV, "off")
    assert not Launcher(gated_delta._gated_delta_kernel).enabled
    assert triton.next_power_of_2(300) == gated_delta._pow2(300) == 512 and gated_delta._pow2(1) == 1


def test_a_triton_whose_launch_internals_differ_gets_its_own_launches_back_said_once(jit, caplog):
    """On another Triton than 3.6 the device cache may hold something else where the backend
    was: the launch goes through Triton, fast launches turn off for that kernel, one warning."""
    x, y = torch.zeros(64), torch.zeros(64)
    launch = Launcher(jit, enabled=True)
    launch((1,), x, y, 64, 0.5, num_warps=4, BLOCK=64)  # the first: through Triton, which fills the cache
    jit.device_caches[0] = ({}, {}, None)  # a layout with no backend at [3]
    with caplog.at_level("WARNING", logger="vllm.prefill_gate"):
        for _ in range(3):
            launch((1,), x, y, 64, 0.5, num_warps=4, BLOCK=64)
            jit.device_caches[0] = ({}, {}, None)
    assert len(jit.slow) == 4 and launch.fast_launches == 0 and not launch.enabled
    assert caplog.text.count("PREFILL_GATE_FAST_LAUNCH off") == 1 and "IndexError" in caplog.text
