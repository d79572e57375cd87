"""vLLM 0.26.0 patches for prefill-gate, loaded as a vLLM general plugin.

    pip install "prefill-gate[engine]"   # registers the `vllm.general_plugins` entry point
    PREFILL_GATE_PACING=cap PREFILL_GATE_PACING_CAP_TOKENS=256 \\
      vllm serve MODEL --scheduler-cls prefill_gate.engine_patches.pacing.PacedAsyncScheduler

    PREFILL_GATE_SPEC_AS_DECODE=auto \
      vllm serve MODEL --attention-backend CUSTOM --dtype float16   # sm_70 row routing

`register()` runs in every vLLM process at start: it validates the PREFILL_GATE_PACING*,
PREFILL_GATE_SPEC_AS_DECODE and PREFILL_GATE_GRAPH_STEPS settings (a bad value stops vLLM
with a message naming the variable), points vLLM's CUSTOM attention slot at
`prefill_gate.engine_patches.attention`, extends CUDA-graph capture sizes to the step budget
when the paced scheduler is chosen (`graphs`: other vLLMs in the environment keep theirs)
and uploads the captured graphs before serving (`graph_upload`: where pacing is asked for),
sends Gated DeltaNet layers' short-prompt steps through one recurrent launch when
PREFILL_GATE_GDN_RECURRENT asks for it (`gdn`, off by default) and then compiles, before serving,
the kernels such a server would otherwise compile beside its first streams (`warmup`), logs Python's collections
that hold the process past PREFILL_GATE_GC_LOG_MS (`stalls`: 20 ms where pacing is on) and logs
what is active. The scheduler classes are chosen with `--scheduler-cls` and the backend with
`--attention-backend CUSTOM`; pacing has an environment kill switch (PREFILL_GATE_PACING=off).
"""

from __future__ import annotations

import logging
import os

# Under "vllm." so that vLLM's logging configuration (handler, format, level) covers it.
LOGGER = "vllm.prefill_gate"
ATTENTION_BACKEND = "prefill_gate.engine_patches.attention.SplitRowsAttentionBackend"
logger = logging.getLogger(LOGGER)


def register() -> None:
    from prefill_gate.engine_patches import _vllm, gdn, gdn_graph, graph_upload, graphs, stalls, warmup  # _vllm: the version check
    from prefill_gate.engine_patches.config import PacingConfig
    from prefill_gate.engine_patches.routing import mode_from_env
    from prefill_gate.kernels import launch

    config = PacingConfig.from_env()
    spec_as_decode = mode_from_env()
    graph_steps = graphs.mode_from_env()
    upload = graph_upload.mode_from_env()
    gdn_limit, gdn_chunk, gdn_walk = gdn.mode_from_env(), gdn.chunk_from_env(), gdn.walk_from_env()
    gdn_conv = gdn.conv_from_env()
    gdn_graphs = gdn_graph.mode_from_env()
    gdn_graph.check_settings(gdn_graphs, gdn_limit)
    if gdn_graphs:
        gdn_conv = "ours"  # the graphs' convolution (vLLM's cannot be replayed): the eager steps take it too
    gc_log_s = stalls.threshold_from_env()
    warm = warmup.enabled_from_env()
    fast_launch = launch.enabled_from_env()  # read again where the kernel loads; refused here first
    say = lambda message: logger.info("prefill-gate %s", message)  # noqa: E731
    warn = lambda message: logger.warning("prefill-gate %s", message)  # noqa: E731
    graphs.install(_vllm.VllmConfig, graph_steps, say)
    # auto: where pacing is asked for (vLLM's model-runner module loads only there)
    if upload == "on" or (upload == "auto" and config.mode != "off") or graph_upload.installed():
        runner = _vllm.graph_internals()
        graph_upload.install(runner.runner_cls, runner.wrapper_cls, upload, say, warn)
    if gdn_limit or gdn.installed():  # vLLM's GDN layer modules load only where the patch is asked for
        internals = _vllm.gdn_internals()
        gdn.install(internals.layer_cls, gdn_limit, internals, say, chunk=gdn_chunk, walk=gdn_walk,
                    control=os.environ.get("PREFILL_GATE_PACING_CONTROL_FILE") or None, conv=gdn_conv)
        if gdn_graphs:
            gdn_graph.install(internals.backend_cls, internals.builder_cls, _vllm.AttentionCGSupport.ALWAYS,
                              _vllm.CUDAGraphMode.FULL, say)
        if gdn_limit and warm:  # the kernels a GDN hybrid's service would otherwise compile in service
            warmup.install(_vllm.warmup_internals(), internals, say, warn)
    stalls.install(gc_log_s, logger)
    # A class path, so the backend (Triton kernels) loads only where CUSTOM is selected.
    _vllm.register_backend(_vllm.AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)
    logger.info("prefill-gate engine_patches for vLLM %s: %s; --attention-backend CUSTOM -> %s "
                "(PREFILL_GATE_SPEC_AS_DECODE=%s); %s=%s; %s=%s; %s=%s; %s=%s; %s=%s; %s=%s; %s=%s; %s=%s; %s=%s; %s=%s",
                _vllm.SUPPORTED_VLLM,
                config.describe(), ATTENTION_BACKEND, spec_as_decode, graphs.ENV, graph_steps, graph_upload.ENV,
                upload, gdn.ENV,
                gdn_limit or "off", gdn.CHUNK_ENV, gdn_chunk or "off", gdn.WALK_ENV,
                "x".join(map(str, gdn_walk)) if gdn_walk else "off", gdn.CONV_ENV, gdn_conv,
                gdn_graph.ENV, "on" if gdn_graphs else "off", stalls.ENV,
                f"{gc_log_s * 1e3:g}" if gc_log_s else "off", warmup.ENV, "on" if warm else "off", launch.ENV,
                "on" if fast_launch else "off")
