"""PREFILL_GATE_GRAPH_UPLOAD: every captured CUDA graph uploaded once vLLM's capture is done.

On the CPU: the setting; the wrapper around capture (every captured graph of every wrapper
uploaded on the replay stream, uncaptured entries skipped, vLLM's return value kept, a failed
upload a warning and never a stopped vLLM, auto only for the paced scheduler); register()
installing it on vLLM's real classes only where pacing is asked for. On a GPU: a real graph
uploaded through the driver, then replayed, computes what it captured.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from prefill_gate.engine_patches import graph_upload

PACED = "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"


class Graph:
    def __init__(self, handle: int):
        self.handle = handle

    def raw_cuda_graph_exec(self) -> int:
        return self.handle


class Wrapper:
    _all_instances: list = []

    def __init__(self, *graphs):
        self.concrete_cudagraph_entries = {i: SimpleNamespace(cudagraph=g) for i, g in enumerate(graphs)}


class Driver:
    def __init__(self, rc: int = 0):
        self.rc, self.calls = rc, []

    def cuGraphUpload(self, graph, stream):  # noqa: N802 (the driver's name)
        self.calls.append((graph.value, stream.value))
        return self.rc


def runner_cls(scheduler: str):
    class Runner:
        vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=scheduler))

        def capture_model(self):
            return 4096  # vLLM returns the graphs' memory

    return Runner


def installed(scheduler: str, mode: str, driver: Driver, *wrappers):
    logs, warnings = [], []
    Runner = runner_cls(scheduler)  # noqa: N806

    class Wrappers(Wrapper):
        _all_instances = list(wrappers)

    graph_upload.install(Runner, Wrappers, mode, logs.append, warnings.append, driver=lambda: driver,
                         stream=lambda: 77)
    return Runner(), logs, warnings


def test_the_setting():
    assert graph_upload.mode_from_env({}) == "auto"
    assert graph_upload.mode_from_env({graph_upload.ENV: " OFF "}) == "off"
    with pytest.raises(graph_upload.GraphUploadError, match="PREFILL_GATE_GRAPH_UPLOAD='sometimes'"):
        graph_upload.mode_from_env({graph_upload.ENV: "sometimes"})


def test_every_captured_graph_is_uploaded_on_the_replay_stream_after_capture():
    driver = Driver()
    runner, logs, warnings = installed(PACED, "auto", driver, Wrapper(Graph(1), None, Graph(2)), Wrapper(Graph(3)))
    assert driver.calls == []  # nothing before capture
    assert runner.capture_model() == 4096
    assert driver.calls == [(1, 77), (2, 77), (3, 77)] and warnings == []
    assert len(logs) == 1 and logs[0].startswith(f"uploaded 3 CUDA graphs before serving ({graph_upload.ENV}")


def test_auto_leaves_other_schedulers_alone_and_on_does_not():
    driver = Driver()
    runner, logs, _ = installed("vllm.v1.core.sched.async_scheduler.AsyncScheduler", "auto", driver, Wrapper(Graph(1)))
    assert runner.capture_model() == 4096 and driver.calls == [] and logs == []
    runner, logs, _ = installed("vllm.v1.core.sched.async_scheduler.AsyncScheduler", "on", driver, Wrapper(Graph(1)))
    runner.capture_model()
    assert driver.calls == [(1, 77)]
    runner, _, _ = installed(PACED, "off", Driver(), Wrapper(Graph(1)))
    assert runner.capture_model() == 4096


def test_a_failed_upload_warns_and_vllm_serves_on():
    driver = Driver(rc=700)
    runner, logs, warnings = installed(PACED, "on", driver, Wrapper(Graph(1), Graph(2)))
    assert runner.capture_model() == 4096
    assert driver.calls == [(1, 77)] and logs == []
    assert len(warnings) == 1 and "CUDA error 700" in warnings[0] and "at its first step" in warnings[0]

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    Runner = runner_cls(PACED)  # noqa: N806
    warnings.clear()
    graph_upload.install(Runner, type("W", (), {"_all_instances": [Wrapper(Graph(1))]}), "on", logs.append,
                         warnings.append, driver=no_driver, stream=lambda: 0)
    assert Runner().capture_model() == 4096 and "OSError" in warnings[0]


def test_installing_again_updates_the_settings_and_wraps_once():
    driver = Driver()
    Runner = runner_cls(PACED)  # noqa: N806
    wrappers = type("W", (), {"_all_instances": [Wrapper(Graph(5))]})
    graph_upload.install(Runner, wrappers, "on", print, print, driver=lambda: driver, stream=lambda: 1)
    wrapped = Runner.capture_model
    graph_upload.install(Runner, wrappers, "off", print, print, driver=lambda: driver, stream=lambda: 1)
    assert Runner.capture_model is wrapped
    Runner().capture_model()
    assert driver.calls == []


def test_register_wraps_vllms_capture_only_where_pacing_is_asked_for(monkeypatch, caplog):
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from prefill_gate import engine_patches

    original = GPUModelRunner.capture_model
    original = getattr(original, "__wrapped__", original)  # another test's register() may have wrapped it
    monkeypatch.setattr(GPUModelRunner, "capture_model", original)
    assert isinstance(CUDAGraphWrapper._all_instances, type(CUDAGraphWrapper._all_instances))  # vLLM keeps them
    for name in ("PREFILL_GATE_PACING", graph_upload.ENV):
        monkeypatch.delenv(name, raising=False)
    engine_patches.register()
    assert GPUModelRunner.capture_model is original  # stock vLLM here: untouched
    monkeypatch.setenv("PREFILL_GATE_PACING", "cap")
    with caplog.at_level(logging.INFO, logger="vllm.prefill_gate"):
        engine_patches.register()
    assert GPUModelRunner.capture_model.__wrapped__ is original and f"{graph_upload.ENV}=auto" in caplog.text
    monkeypatch.setenv(graph_upload.ENV, "off")
    engine_patches.register()  # off after on: the wrapper stays and does nothing
    assert GPUModelRunner.capture_model.prefill_gate_settings["mode"] == "off"
    monkeypatch.setenv(graph_upload.ENV, "later")
    with pytest.raises(graph_upload.GraphUploadError):
        engine_patches.register()


@pytest.mark.gpu
def test_on_the_gpu_an_uploaded_graph_replays_what_it_captured():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    import ctypes

    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    x.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.synchronize()
    assert float(x.sum()) == 0.0  # capture runs nothing
    count = graph_upload.upload([graph], torch.cuda.current_stream().cuda_stream, ctypes.CDLL("libcuda.so.1"))
    torch.cuda.synchronize()
    assert count == 1 and float(x.sum()) == 0.0  # an upload runs nothing either
    graph.replay()
    torch.cuda.synchronize()
    assert float(x.sum()) == 3.0 * 1024
