"""Gated DeltaNet layers: a step's short prompts through the decodes' recurrence, one launch a layer.

On a Gated DeltaNet hybrid (Qwen3-Next, Qwen3.5/3.6) a step that carries a short prompt next
to live streams costs them far more than a decode step: on the H200 the 27B hybrid decodes in
~15 ms a step and a 200-400-token prompt beside the streams takes 85-115 ms (issue 50,
bench/results/graphs/h200/). Most of the difference is the GDN layers' prompt path, which runs
outside the CUDA graphs (vLLM's ``qwen_gdn_attention_core`` is a splitting op): per layer, 48 of
them, FLA's chunked algorithm (about ten kernels behind an autograd function and its input
guards), the state's gather, masked fill and scatter, the decodes' own recurrent launch, a
``torch.cat`` of both outputs and a copy. The GPU has ~0.1-0.2 ms of work a layer there; the
host launching it is the rest.

With this patch on, a step whose prompt tokens (all prompts of the step together) are at most
the limit runs the layer's core as: vLLM's own convolution over every sequence (the same call
as vLLM's), then ``prefill_gate.kernels.gated_delta.gated_delta_recurrent`` for decodes and
prompts together: one launch that reads q, k, v in place from the convolution's output, starts
each prompt from its cached state or from zero, walks the tokens in float32 and stores each
final state once, writing straight into the layer's output. Larger steps, speculative decoding
and decode-only steps take vLLM's path unchanged, except with PREFILL_GATE_GDN_GRAPH=on
(``gdn_graph``), where every step a whole graph replays takes this path, decode-only and past
the limit included (the graph fixed it at capture).

    PREFILL_GATE_GDN_RECURRENT  off   vLLM's path for every step (the plugin's default: it
                                      changes prompts' rounding; the stack turns it on)
                                on    steps with at most ON_TOKENS (512) prompt tokens
                                N     steps with at most N prompt tokens
    PREFILL_GATE_GDN_CHUNK      off   a prompt's tokens one by one (measured: the default)
                                16, 32   a prompt of at least that many tokens in chunks of
                                      it: matrix products a chunk instead of a dependent
                                      update a token (``gated_delta_recurrent(chunk=...)``);
                                      off unless asked: on an H100, chunks of 16 ran 0.73-0.75x
                                      the one launch's time at 300-512 tokens, the walk at 8x1
                                      0.53-0.63x (bench/results/gdn/h100/); the decodes keep
                                      a launch of their own, as with a walk

    PREFILL_GATE_GDN_WALK       off   decodes and prompts in one launch, 32 value rows and 4
                                      warps a program (the shape whose decodes matched vLLM's
                                      bits on the H200)
                                RxW   prompts token by token in a launch of their own, R value
                                      rows and W warps a program (e.g. 8x1); the decodes keep
                                      the launch above, and so their bits. Not with a chunk

    PREFILL_GATE_GDN_CONV       vllm  vLLM's ``causal_conv1d_fn`` for the step's convolution (default)
                                ours  ``prefill_gate.kernels.causal_conv``: the same arithmetic op for
                                      op (bit-identical, tested against vLLM's under Triton's
                                      interpreter; on a GPU by the marked test), its launch through
                                      the fast launcher and its bounds read on the device, with no
                                      per-call wrapper; off until timed on a GPU
                                      (bench/gpu/gdn_launch_time.py --conv)

Numerics: decodes are bit-identical to vLLM's (the same arithmetic as its recurrent kernel,
tested under Triton's interpreter); a prompt's tokens follow the recurrence token by token in
float32 (with chunks: in chunks of 16 or 32 with tf32 products) where vLLM's chunked form computes
in chunks of 64 with bfloat16 products, so prompt outputs and the states they leave differ by
rounding (tests/engine/test_gdn.py holds the glue to the specification on the CPU; the GPU test
compares both paths on real kernels). Token by token, a prompt's recurrence is n dependent
updates, so the limit keeps it to short prompts, where one launch beats a dozen; chunks make it
n / C rounds, which should move that crossover out (to be measured: bench/gpu/gdn_h200.sh). Measured on the H200 (bench/results/gdn/h200/: one 27B-sized layer,
4 decodes and one prompt): ours 0.15-0.90 ms a call against vLLM's 0.92-1.08 ms for prompts of
16-512 tokens, 1.88 ms against 1.01 at 1,024; a short prompt's cost to live streams fell from
86 to 44 ms at the median with the limit at 512.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping

from prefill_gate._env import FileWatch, read_settings_file
from prefill_gate.engine_patches.gdn_graph import MARK as GRAPH_MARK
from prefill_gate.kernels import launch

ENV = "PREFILL_GATE_GDN_RECURRENT"
CHUNK_ENV = "PREFILL_GATE_GDN_CHUNK"
WALK_ENV = "PREFILL_GATE_GDN_WALK"
CONV_ENV = "PREFILL_GATE_GDN_CONV"
CONVS = ("vllm", "ours")
ON_TOKENS = 512  # "on": the H200 sweep's last length where one launch still beats vLLM's path
MAX_TOKENS = 4096
CHUNKS = (16, 32)
# The settings a control file may change on a running server (PREFILL_GATE_PACING_CONTROL_FILE,
# the pacer's file: one file for the engine's settings), and how often the layers look at it.
CONTROL_KEYS = (ENV, CHUNK_ENV, WALK_ENV, CONV_ENV, launch.ENV)
CONTROL_POLL_SECONDS = 1.0
PACING_PREFIX = "PREFILL_GATE_PACING"  # engine_patches.config's settings
logger = logging.getLogger("vllm.prefill_gate")


class GdnRecurrentError(ValueError):
    """PREFILL_GATE_GDN_RECURRENT holds a value the plugin cannot use."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The prompt-token limit of a step sent through the recurrence; 0 when off."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "off").strip().lower()
    if raw == "off":
        return 0
    if raw == "on":
        return ON_TOKENS
    try:
        limit = int(raw)
    except ValueError:
        raise GdnRecurrentError(f"{ENV}={env.get(ENV)!r}: expected off, on or a token count") from None
    if not 1 <= limit <= MAX_TOKENS:
        raise GdnRecurrentError(f"{ENV}={limit}: expected a token count in 1..{MAX_TOKENS} (a prompt's "
                                "recurrence is sequential: long prompts belong to the chunked path)")
    return limit


def chunk_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The chunk a prompt's recurrence walks in (0: token by token)."""
    env = os.environ if environ is None else environ
    raw = (env.get(CHUNK_ENV) or "off").strip().lower()
    if raw in ("off", "0"):
        return 0
    if raw not in {str(c) for c in CHUNKS}:
        raise GdnRecurrentError(f"{CHUNK_ENV}={env.get(CHUNK_ENV)!r}: expected off or one of "
                                f"{', '.join(map(str, CHUNKS))} (tokens a chunk)")
    return int(raw)


def walk_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """The prompts' own launch shape, (value rows, warps) a program (None: one launch for all)."""
    env = os.environ if environ is None else environ
    raw = (env.get(WALK_ENV) or "off").strip().lower()
    if raw == "off":
        return None
    from prefill_gate.kernels.gated_delta import WARPS, valid_walk

    rows, _, warps = raw.partition("x")
    try:
        walk = int(rows), int(warps)
    except ValueError:
        walk = None
    if walk is None or walk[0] > 128 or not valid_walk(walk):
        raise GdnRecurrentError(f"{WALK_ENV}={env.get(WALK_ENV)!r}: expected off or ROWSxWARPS, value rows a "
                                f"program a power of two up to 128 and warps one of {', '.join(map(str, WARPS))} "
                                "(e.g. 8x1)")
    if chunk_from_env(env):
        raise GdnRecurrentError(f"{WALK_ENV} shapes the prompts' token walk; with {CHUNK_ENV} set they go in "
                                "chunks instead: set one of the two")
    return walk


def conv_from_env(environ: Mapping[str, str] | None = None) -> str:
    """Whose convolution an eligible step runs: vLLM's (``vllm``) or ours (``ours``)."""
    env = os.environ if environ is None else environ
    raw = (env.get(CONV_ENV) or "vllm").strip().lower()
    if raw not in CONVS:
        raise GdnRecurrentError(f"{CONV_ENV}={env.get(CONV_ENV)!r}: expected {' or '.join(CONVS)}")
    return raw


def eligible(metadata, limit: int) -> bool:
    """Does this step's GDN metadata describe a step the recurrence takes: prompts totalling at
    most ``limit`` tokens, no speculative decoding, the mixed path's tensors present?"""
    return (limit > 0 and metadata is not None and metadata.spec_sequence_masks is None
            and 0 < metadata.num_prefills and metadata.num_prefill_tokens <= limit
            and metadata.has_initial_state is not None and metadata.non_spec_state_indices_tensor is not None
            and metadata.non_spec_query_start_loc is not None)


def recurrent_core(layer, mixed_qkv, b, a, core_attn_out, metadata, vllm, conv: str = "vllm",
                   seqs: int | None = None, **launch) -> None:
    """The layer's core for an eligible step: the convolution (vLLM's, or ours where ``conv`` is
    ``ours`` and it covers the layer), then one recurrent launch for every sequence. ``vllm``:
    ``_vllm.gdn_internals()``; ``launch``: the kernel's launch shape and walk (``block_v``,
    ``stages``, ``chunk``; the kernel's defaults unless given). ``seqs``: a whole graph's step
    (``gdn_graph``): every one of its sequences, padding included, through our convolution
    (vLLM's sizes its launch on the host, which a graph cannot replay)."""
    tokens = metadata.num_actual_tokens
    graphed = seqs is not None
    if not graphed:
        seqs = metadata.num_decodes + metadata.num_prefills
    conv_state = layer.kv_cache[0] if vllm.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    ssm_state = layer.kv_cache[1]
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    x = mixed_qkv[:tokens]
    starts, slots = metadata.non_spec_query_start_loc[:seqs + 1], metadata.non_spec_state_indices_tensor[:seqs]
    has_initial = metadata.has_initial_state[:seqs]
    from prefill_gate.kernels import causal_conv

    if (graphed or conv == "ours") and layer.activation in ("silu", "swish") and causal_conv.supported(
            x, weight, conv_state):
        conved = causal_conv.causal_conv(x, weight, layer.conv1d.bias, conv_state, slots, has_initial, starts)
    elif graphed:
        raise RuntimeError(f"PREFILL_GATE_GDN_GRAPH=on: our convolution does not cover this layer (activation "
                           f"{layer.activation}, {x.dtype}, width {weight.shape[-1]}); set PREFILL_GATE_GDN_GRAPH=off")
    else:
        conved = vllm.causal_conv1d_fn(
            x.transpose(0, 1), weight, layer.conv1d.bias, activation=layer.activation,
            conv_states=conv_state, has_initial_state=metadata.has_initial_state,
            cache_indices=metadata.non_spec_state_indices_tensor, query_start_loc=metadata.non_spec_query_start_loc,
            metadata=metadata,
        ).transpose(0, 1)
        if conved.stride(1) != 1:  # the conv writes channels-last for a dense input; a strided view may not be
            conved = conved.contiguous()
    _recurrence(layer, conved, a[:tokens], b[:tokens], ssm_state, core_attn_out[:tokens], starts, slots, has_initial,
                **launch)


def _recurrence(layer, conv, a, b, ssm_state, out, starts, slots, has_initial, **launch) -> None:
    """The recurrent launch over a step's convolved q, k, v (``conv``: [tokens, conv dim])."""
    from prefill_gate.kernels.gated_delta import MIN_DOT, gated_delta_recurrent

    if launch.get("chunk") and min(layer.head_k_dim, layer.head_v_dim) < MIN_DOT:
        launch = {**launch, "chunk": 0}  # heads too small for a matrix product's tile: token by token
    key_dim, tokens = layer.key_dim // layer.tp_size, conv.shape[0]
    # views of the conv output's columns (this runs 48 times a step, on the host, on the path the
    # streams wait for: one view and one split where the heads are alike, no ``unflatten`` wrapper)
    if layer.head_k_dim == layer.head_v_dim:
        heads_k = key_dim // layer.head_k_dim
        q, k, v = conv.view(tokens, -1, layer.head_k_dim).split(
            [heads_k, heads_k, conv.shape[1] // layer.head_v_dim - 2 * heads_k], dim=1)
    else:
        q = conv[:, :key_dim].view(tokens, -1, layer.head_k_dim)
        k = conv[:, key_dim:2 * key_dim].view(tokens, -1, layer.head_k_dim)
        v = conv[:, 2 * key_dim:].view(tokens, -1, layer.head_v_dim)
    gated_delta_recurrent(q, k, v, _rows(a), _rows(b), layer.A_log, layer.dt_bias, ssm_state, starts, slots,
                          has_initial, out=out, **launch)


def warm_up(layer, conv: str = "vllm", conv_state_dim_first: bool = True, max_seqs: int = 64, **launch) -> None:
    """Compile the recurrent kernel's launches (and our convolution's, where ``conv`` is
    ``ours``) for ``layer``'s shapes now, before any stream
    waits on it (``launch``: as ``recurrent_core`` gets it). The GDN path runs only for steps
    with a short prompt, which vLLM's own warm-up never makes, so without this the kernel
    compiles at the first such step in service. One decode and one two-token prompt, both in
    state slot 0, vLLM's null block: the kernel returns before it reads or writes any state.
    The tensors have the dtypes, 16-byte alignment and divisibility of strides a real step's
    have, which is what Triton keys its compilations on."""
    import torch

    weight, ssm_state = layer.conv1d.weight, layer.kv_cache[1]
    device, dtype, heads = weight.device, weight.dtype, ssm_state.shape[1]
    qkv = torch.zeros(3, weight.size(0), dtype=dtype, device=device)
    a, b = torch.zeros(3, heads, dtype=dtype, device=device), torch.zeros(3, heads, dtype=dtype, device=device)
    out = torch.empty(3, heads, layer.head_v_dim, dtype=dtype, device=device)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    has_initial = torch.zeros(2, dtype=torch.bool, device=device)
    if conv == "ours":
        from prefill_gate.kernels import causal_conv

        state = layer.kv_cache[0] if conv_state_dim_first else layer.kv_cache[0].transpose(-1, -2)
        weights = weight.view(weight.size(0), weight.size(2))
        if causal_conv.supported(qkv, weights, state):
            causal_conv.causal_conv(qkv, weights, layer.conv1d.bias, state, slots, has_initial, starts)
            # steps of more sequences than the kernel's vector of them: one compiled kernel per
            # doubling, up to the engine's max_num_seqs (null slots, no tokens: nothing runs)
            for seqs in causal_conv.seq_buckets(max_seqs)[1:]:
                none = torch.zeros(seqs, dtype=torch.int32, device=device)
                causal_conv.causal_conv(qkv, weights, layer.conv1d.bias, state, none, none.bool(),
                                        torch.zeros(seqs + 1, dtype=torch.int32, device=device))
    _recurrence(layer, qkv, a, b, ssm_state, out, starts, slots, has_initial, **launch)


def _rows(x):
    """[tokens, heads] with unit head stride (what the kernel reads), copying only if needed."""
    x = x.reshape(x.shape[0], -1)
    return x if x.stride(1) == 1 else x.contiguous()


def installed() -> bool:
    """Has this process wrapped vLLM's GDN layer already (its module is loaded and carries ours)?"""
    import sys

    module = sys.modules.get("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn")
    layer_cls = getattr(module, "QwenGatedDeltaNetAttention", None)
    return hasattr(getattr(layer_cls, "_forward_core", None), "prefill_gate_settings")


def control_key(key: str) -> bool:
    """May a control file set ``key``? Pacing's settings, and the GDN patch's: the pacer and the
    layers read the same file, and each refuses a file naming anything else (a typo)."""
    return key.startswith(PACING_PREFIX) or key in CONTROL_KEYS


class Control:
    """The GDN settings of a running server, re-read from its control file when the file
    changes (looked at no more than once a second, from the layers' own calls): the patch on or
    off, its limit, the walk, chunks and fast launches, so that one server measures them side by
    side. An emptied file gives back the environment's settings; a file with a bad value is
    logged and the running settings kept. Start the server with the patch on: its warm-up
    compiles the kernel only then (turned on later, the first short prompt compiles it)."""

    def __init__(self, path: str, settings: dict, log: Callable[[str], None] = logger.info,
                 clock: Callable[[], float] = time.monotonic, environ: Mapping[str, str] | None = None):
        self.path, self.settings, self.log, self.clock = path, settings, log, clock
        self.environ = os.environ if environ is None else environ
        self._watch = FileWatch(path, CONTROL_POLL_SECONDS)

    def poll(self) -> None:
        if not self._watch.changed(self.clock()):  # unchanged, or absent: the running settings
            return
        try:
            merged = {**self.environ, **read_settings_file(self.path, control_key, GdnRecurrentError)}
            settings = {"limit": mode_from_env(merged), "chunk": chunk_from_env(merged), "walk": walk_from_env(merged),
                        "conv": conv_from_env(merged)}
            fast = launch.enabled_from_env(merged)
        except (OSError, ValueError) as exc:
            logger.error("prefill-gate Gated DeltaNet: control file ignored, settings kept: %s", exc)
            return
        if settings == {k: self.settings[k] for k in settings} and fast == _fast_launch(None):
            return
        self.settings.update(settings)
        _fast_launch(fast)
        walk = settings["walk"]
        self.log(f"Gated DeltaNet settings from {self.path}: {ENV}={settings['limit'] or 'off'}, "
                 f"{CHUNK_ENV}={settings['chunk'] or 'off'}, {WALK_ENV}={'x'.join(map(str, walk)) if walk else 'off'}, "
                 f"{CONV_ENV}={settings['conv']}, {launch.ENV}={'on' if fast else 'off'}")


def _fast_launch(enabled: bool | None) -> bool:
    """Our kernels' fast launches: set them (``enabled``) and say whether they are on."""
    from prefill_gate.kernels import causal_conv, gated_delta

    if enabled is not None:
        gated_delta._launch.enabled = causal_conv._launch.enabled = enabled
    return gated_delta._launch.enabled


def install(layer_cls, limit: int, vllm, log, chunk: int = 0, walk: tuple[int, int] | None = None,
            control: str | None = None, conv: str = "vllm") -> None:
    """Wrap ``layer_cls._forward_core`` so that eligible steps take ``recurrent_core``. Installing
    again only replaces the settings (register() runs in every process); limit 0 restores vLLM's.
    ``control``: a control file the layers re-read their settings from (``Control``)."""
    current = layer_cls._forward_core
    if hasattr(current, "prefill_gate_settings"):
        current.prefill_gate_settings.update(limit=limit, chunk=chunk, walk=walk, conv=conv)
        current.prefill_gate_control[0] = Control(control, current.prefill_gate_settings, log) if control else None
        return
    if limit <= 0:
        return
    original = current
    settings = {"limit": limit, "chunk": chunk, "walk": walk, "conv": conv}
    watch = [Control(control, settings, log) if control else None]

    @functools.wraps(original)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if watch[0] is not None:
            watch[0].poll()
        attn = vllm.get_forward_context().attn_metadata
        metadata = attn.get(self.prefix) if isinstance(attn, dict) else None
        if not isinstance(metadata, vllm.metadata_cls):
            return original(self, mixed_qkv, b, a, core_attn_out)
        graph_seqs = getattr(metadata, GRAPH_MARK, None)  # a whole graph's step: its path is fixed
        if graph_seqs is None and not eligible(metadata, settings["limit"]):
            return original(self, mixed_qkv, b, a, core_attn_out)
        recurrent_core(self, mixed_qkv, b, a, core_attn_out, metadata, vllm, conv=settings["conv"],
                       seqs=graph_seqs, chunk=settings["chunk"], walk=settings["walk"])

    _forward_core.prefill_gate_settings = settings
    _forward_core.prefill_gate_control = watch
    layer_cls._forward_core = _forward_core
    how = (f"prompts in chunks of {chunk} ({CHUNK_ENV})" if chunk else
           f"prompts token by token in a launch of their own, {walk[0]} value rows and {walk[1]} warps a program "
           f"({WALK_ENV})" if walk else "prompts token by token")
    log(f"Gated DeltaNet: steps with at most {limit} prompt tokens run one recurrent launch a layer ({ENV}), "
        f"{how}; {CONV_ENV}={conv}")
