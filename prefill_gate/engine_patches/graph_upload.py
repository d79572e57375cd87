"""Captured CUDA graphs uploaded to the GPU before serving, not at their first step in service.

vLLM 0.26 captures a graph for each step size at start (``CUDAGraphWrapper``: the first call
with a batch descriptor captures, later calls replay) and never replays one before serving,
and PyTorch instantiates a graph without uploading it, so the first step of each size in
service also uploads that size's graphs: on a hybrid with piecewise graphs, ~65 of them (one
between each pair of splitting ops). Paced steps change size as the pacing follows the
target, so first uses keep coming long after start-up, each beside live streams. On an H100 a
first replay not uploaded cost 0-20 ms more than the next, uploaded never
(`bench/gpu/graph_first_replay.py`, bench/results/hybrid/h100/run-33e8a15/).

After vLLM's capture, this uploads every captured graph with the driver's ``cuGraphUpload``,
which prepares a graph on the device without running any of its kernels, on the stream vLLM
replays on. An upload that fails logs a warning and vLLM serves as it would have.

    PREFILL_GATE_GRAPH_UPLOAD   auto  where pacing is asked for (PREFILL_GATE_PACING) and vLLM
                                      runs the paced scheduler (--scheduler-cls prefill_gate...);
                                      any other vLLM here is left alone
                                on    any scheduler
                                off   vLLM's behaviour
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping

from prefill_gate.engine_patches.graphs import is_ours

ENV = "PREFILL_GATE_GRAPH_UPLOAD"
MODES = ("auto", "on", "off")
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


class GraphUploadError(ValueError):
    """PREFILL_GATE_GRAPH_UPLOAD holds a value the plugin cannot use."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "auto").strip().lower()
    if raw not in MODES:
        raise GraphUploadError(f"{ENV}={env.get(ENV)!r}: expected auto, on or off")
    return raw


def installed() -> bool:
    """Has this process wrapped vLLM's capture already (its module is loaded and carries ours;
    a later register() then updates the settings)?"""
    import sys

    runner_cls = getattr(sys.modules.get(RUNNER_MODULE), "GPUModelRunner", None)
    return hasattr(getattr(runner_cls, "capture_model", None), "prefill_gate_settings")


def applies(mode: str, scheduler_cls: object) -> bool:
    return mode == "on" or (mode == "auto" and is_ours(scheduler_cls))


def captured(wrappers: Iterable) -> list:
    """Every captured graph (``torch.cuda.CUDAGraph``) of vLLM's graph wrappers."""
    return [entry.cudagraph for wrapper in wrappers
            for entry in list(wrapper.concrete_cudagraph_entries.values()) if entry.cudagraph is not None]


def upload(graphs: Iterable, stream: int, driver) -> int:
    """``cuGraphUpload`` each graph's executable on ``stream`` (a CUstream handle); the count."""
    count = 0
    for graph in graphs:
        rc = driver.cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()), ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuGraphUpload returned CUDA error {rc}")
        count += 1
    return count


def install(runner_cls, wrapper_cls, mode: str, log: Callable[[str], None], warn: Callable[[str], None], *,
            driver: Callable[[], object] = lambda: ctypes.CDLL("libcuda.so.1"),
            stream: Callable[[], int] | None = None) -> None:
    """Wrap ``runner_cls.capture_model`` (vLLM's GPUModelRunner) so that every graph of
    ``wrapper_cls._all_instances`` is uploaded after it. ``stream()``: the CUstream vLLM
    replays on (default: vLLM's current stream). Installing again replaces the settings."""
    current = runner_cls.capture_model
    if hasattr(current, "prefill_gate_settings"):
        current.prefill_gate_settings.update(mode=mode, log=log, warn=warn, driver=driver, stream=stream)
        return
    original = current
    settings = {"mode": mode, "log": log, "warn": warn, "driver": driver, "stream": stream}

    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not applies(settings["mode"], self.vllm_config.scheduler_config.scheduler_cls):
            return result
        t0 = time.perf_counter()
        try:
            graphs = captured(list(wrapper_cls._all_instances))
            if not graphs:
                return result
            handle = settings["stream"]() if settings["stream"] else _vllm_stream()
            count = upload(graphs, handle, settings["driver"]())
            _synchronize()
        except Exception as exc:  # an upload must never stop vLLM: graphs then upload at first use
            settings["warn"](f"graph upload failed ({type(exc).__name__}: {exc}); each graph uploads at its first "
                             "step instead")
            return result
        settings["log"](f"uploaded {count} CUDA graphs before serving ({ENV}, "
                        f"{(time.perf_counter() - t0) * 1e3:.0f} ms)")
        return result

    capture_model.prefill_gate_settings = settings  # type: ignore[attr-defined]
    runner_cls.capture_model = capture_model


def _vllm_stream() -> int:
    from vllm.utils.torch_utils import current_stream

    return current_stream().cuda_stream


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
