"""CUDA-graph sizes up to the step budget (engine_patches.graphs), on vLLM's own config path.

vLLM turns graphs off on the CPU before it sizes them, so these tests tell its platform it
has static graphs (what a CUDA platform says); everything else is the real VllmConfig.
"""

from __future__ import annotations

import pytest

from prefill_gate import engine_patches
from prefill_gate.engine_patches import _vllm, graphs

from .harness import model_dir

PACED = "prefill_gate.engine_patches.pacing.PacedAsyncScheduler"
VLLM_DEFAULT_64 = [1, 2, 4, *range(8, 129, 8)]  # --max-num-seqs 64: up to 2 x 64 tokens


@pytest.fixture
def gpu_like(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    # install() replaces the class attribute; monkeypatch puts vLLM's own back afterwards
    monkeypatch.setattr(_vllm.VllmConfig, "_set_cudagraph_sizes", _vllm.VllmConfig._set_cudagraph_sizes)


def config(tmp_path, *, scheduler_cls=None, budget=2048, seqs=64, compilation=None):
    from vllm.config import CacheConfig, CompilationConfig, DeviceConfig, ModelConfig, SchedulerConfig

    model = ModelConfig(model=str(model_dir(tmp_path)), skip_tokenizer_init=True, max_model_len=32768,
                        dtype="bfloat16", seed=0)
    scheduler = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=32768,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
    if scheduler_cls is not None:
        scheduler.scheduler_cls = scheduler_cls
    return _vllm.VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=CacheConfig(),
                            device_config=DeviceConfig(device="cpu"),
                            compilation_config=CompilationConfig(**(compilation or {})))


def sizes(cfg) -> list[int]:
    return list(cfg.compilation_config.cudagraph_capture_sizes)


def test_the_ladder_pads_a_step_by_less_than_a_quarter_and_ends_at_the_limit():
    assert graphs.ladder(128, 2048) == [160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896,
                                        1024, 1280, 1536, 1792, 2048]
    assert graphs.ladder(512, 1000)[-1] == 1000
    assert graphs.ladder(512, 512) == []
    full = graphs.extended_sizes(VLLM_DEFAULT_64, 8192)
    for n in range(1, 8193):  # every step size lands on a size at most 1/4 larger
        padded = next(s for s in full if s >= n)
        assert padded - n < max(n / 4, 8), n


def test_vllm_without_the_plugin_stops_at_two_graphs_per_sequence(tmp_path, gpu_like):
    assert sizes(config(tmp_path)) == VLLM_DEFAULT_64  # the 27B hybrid: 128


def test_the_paced_scheduler_gets_graphs_up_to_vllms_own_ceiling(tmp_path, gpu_like):
    messages = []
    graphs.install(_vllm.VllmConfig, "auto", messages.append)
    cfg = config(tmp_path, scheduler_cls=PACED)  # the hybrid: 2048 budget, 64 sequences
    assert sizes(cfg)[:len(VLLM_DEFAULT_64)] == VLLM_DEFAULT_64
    assert sizes(cfg)[len(VLLM_DEFAULT_64):] == [160, 192, 224, 256, 320, 384, 448, 512]
    assert cfg.compilation_config.max_cudagraph_capture_size == 512
    assert messages == ["CUDA graphs up to 512 tokens: 8 sizes added above vLLM's 128 "
                        "(160, 192, 224, 256, 320, 384, ...)"]


def test_where_vllm_already_reaches_512_auto_changes_nothing(tmp_path, gpu_like):
    graphs.install(_vllm.VllmConfig, "auto", lambda _: None)
    own = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # --max-num-seqs 256 (the 8B stack)
    assert sizes(config(tmp_path, scheduler_cls=PACED, seqs=256, budget=8192)) == own
    assert sizes(config(tmp_path, scheduler_cls=PACED, seqs=256, budget=300))[-1] == 300  # never past the budget


def test_other_vllms_in_the_environment_keep_their_sizes(tmp_path, gpu_like):
    graphs.install(_vllm.VllmConfig, "auto", lambda _: None)
    assert sizes(config(tmp_path)) == VLLM_DEFAULT_64  # vLLM's own scheduler
    graphs.install(_vllm.VllmConfig, "off", lambda _: None)
    assert sizes(config(tmp_path, scheduler_cls=PACED)) == VLLM_DEFAULT_64


def test_on_and_a_limit_cover_any_scheduler(tmp_path, gpu_like):
    graphs.install(_vllm.VllmConfig, "on", lambda _: None)
    assert sizes(config(tmp_path))[-1] == 512
    graphs.install(_vllm.VllmConfig, 1024, lambda _: None)
    assert sizes(config(tmp_path))[-1] == 1024
    assert sizes(config(tmp_path))[-4:] == [640, 768, 896, 1024]
    graphs.install(_vllm.VllmConfig, 100_000, lambda _: None)  # never past the batch budget
    assert sizes(config(tmp_path, budget=4096))[-1] == 4096


@pytest.mark.parametrize("compilation", [{"cudagraph_capture_sizes": [1, 2, 4, 8]},
                                         {"max_cudagraph_capture_size": 64}])
def test_sizes_the_user_chose_win(tmp_path, gpu_like, compilation):
    graphs.install(_vllm.VllmConfig, "on", lambda _: None)
    assert sizes(config(tmp_path, scheduler_cls=PACED, compilation=compilation))[-1] in (8, 64)


def test_no_graphs_means_no_sizes(tmp_path, gpu_like):
    graphs.install(_vllm.VllmConfig, "on", lambda _: None)
    assert sizes(config(tmp_path, compilation={"cudagraph_mode": "NONE"})) == []


def test_register_installs_it_and_refuses_a_bad_value(tmp_path, gpu_like, monkeypatch):
    monkeypatch.setenv(graphs.ENV, "2048")
    engine_patches.register()
    assert sizes(config(tmp_path))[-1] == 2048
    monkeypatch.setenv(graphs.ENV, "sometimes")
    with pytest.raises(graphs.GraphStepsError, match="PREFILL_GATE_GRAPH_STEPS='sometimes'"):
        engine_patches.register()
    monkeypatch.setenv(graphs.ENV, "0")
    with pytest.raises(graphs.GraphStepsError, match="1..1048576"):
        graphs.mode_from_env()
