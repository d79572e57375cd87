"""Launching a compiled Triton kernel again without Triton's per-call work.

Each ``kernel[grid](...)`` call binds its arguments into a dict, derives their specialisation,
builds and hashes a cache key, parses the launch options, checks the kernel's globals and then
launches. On the H100 host that served the 27B hybrid that was ~90 us between two launches of
``gated_delta_recurrent`` under the profiler (bench/results/hybrid/h100/run-0261253/), and the
GDN patch launches twice a layer, 48 layers a mixed step, on the path the streams wait for.

``Launcher`` launches the first call of each specialisation through Triton (which compiles the
kernel if it has to) and keeps the compiled kernel it returns; a later call with the same key
goes straight to that kernel's launcher. The key is what Triton's own cache key is made of:
each argument's specialisation by Triton's own function (a pointer's dtype and whether it is
16-byte aligned, an integer's width and whether it is 1 or a multiple of 16), the constants, the
launch options, the debug and instrumentation settings and the device. So a call reuses only
the kernel Triton would have picked for it. What it skips: Triton's check that the kernel's
module globals have not changed since it compiled (ours are constants) and its pre-run hooks
(none are set on our kernels).

    PREFILL_GATE_FAST_LAUNCH   on   (default) repeat launches go straight to the compiled kernel
                               off  every launch through ``kernel[grid](...)``

On since its GPU test (tests/kernel_tests/test_gated_delta.py: both ways give the same bits) and
bench/gpu/gdn_launch_time.py ran on an H100 (bench/results/hybrid/h100/run-667ef4c/launch/: a layer
call's host work 75.8 against 90.7 us at a 300-token prompt, 109 against 148 us at 16 tokens).

Under Triton's interpreter (``TRITON_INTERPRET=1``) every call goes through Triton: there is no
compiled kernel to keep. On a Triton whose device cache is laid out otherwise than 3.6's (vLLM
0.26's), the first repeat launch finds out, turns fast launches off for that kernel, says so once
and goes through Triton.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping

from prefill_gate._env import switch

ENV = "PREFILL_GATE_FAST_LAUNCH"
logger = logging.getLogger("vllm.prefill_gate")


class FastLaunchError(ValueError):
    """PREFILL_GATE_FAST_LAUNCH holds a value other than on or off."""


def enabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    return switch(ENV, "on", FastLaunchError, environ)


class Launcher:
    """``Launcher(kernel)(grid, *args, num_warps=W, **constants)`` launches ``kernel`` as
    ``kernel[grid](*args, num_warps=W, **constants)`` does. ``args`` are the kernel's leading
    parameters, positionally; ``constants`` name the rest (defaults fill what they omit)."""

    def __init__(self, kernel, enabled: bool | None = None):
        self.kernel = kernel
        self.enabled = enabled_from_env() if enabled is None else enabled
        params = getattr(kernel, "params", None)
        self._compiled: dict[tuple, object] = {}
        self.fast_launches = 0  # launches that went straight to a kept kernel (tests, benches)
        # A JIT function has a binder and a compiled-kernel cache; the interpreter's has neither.
        self._jit = params is not None and hasattr(kernel, "device_caches")
        if self._jit:
            self._names = [p.name for p in params]
            self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __call__(self, grid: tuple[int, ...], *args, num_warps: int, **constants) -> None:
        if not (self.enabled and self._jit):
            self.kernel[grid](*args, num_warps=num_warps, **constants)
            return
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.runtime import driver

        device = driver.active.get_current_device()
        caches = self.kernel.device_caches.get(device)
        if caches is None:  # Triton has not launched this kernel on this device yet
            self._first(grid, args, num_warps, constants, device)
            return
        try:
            backend = caches[3]  # Triton 3.6's (kernel cache, key cache, target, backend, binder)
            key = (device, num_warps, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                   tuple(constants.items()),
                   tuple(native_specialize_impl(backend, a, False, True, True) for a in args))
        except (TypeError, AttributeError, IndexError, ValueError) as exc:
            # Another Triton than the one this was built on (vLLM 0.26's 3.6): its own launches
            # from now on, said once, rather than a serving engine failing on every layer.
            self.enabled = False
            logger.warning("prefill-gate: %s off for %s: this Triton's launch internals differ (%s: %s); "
                           "Triton launches it", ENV, getattr(self.kernel, "__name__", self.kernel), type(exc).__name__, exc)
            self.kernel[grid](*args, num_warps=num_warps, **constants)
            return
        compiled = self._compiled.get(key)
        if compiled is None:
            self._first(grid, args, num_warps, constants, device, key)
            return
        stream = driver.active.get_current_stream(device)
        full = self._arguments(args, constants)
        meta = compiled.launch_metadata(grid, stream, *full)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, meta, knobs.runtime.launch_enter_hook,
                     knobs.runtime.launch_exit_hook, *full)
        self.fast_launches += 1

    def _first(self, grid, args, num_warps, constants, device, key=None) -> None:
        """Launch through Triton and keep the compiled kernel it returns under ``key``."""
        compiled = self.kernel[grid](*args, num_warps=num_warps, **constants)
        if key is None:  # the binder exists now: the next call builds the key
            return
        if compiled is not None and not hasattr(compiled, "result") and hasattr(compiled, "function"):
            self._compiled[key] = compiled

    def _arguments(self, args: tuple, constants: dict) -> list:
        """Every parameter's value in the kernel's order, as Triton's launcher takes them."""
        full = list(args)
        for name in self._names[len(args):]:
            full.append(constants[name] if name in constants else self._defaults[name])
        return full
