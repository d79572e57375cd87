"""Whole CUDA graphs for a Gated DeltaNet hybrid's mixed steps (``PREFILL_GATE_GDN_GRAPH``).

vLLM 0.26 replays a full graph for a GDN hybrid's decode-only steps only: its GDN metadata
builder claims ``UNIFORM_BATCH``, so the model runner resolves ``cudagraph_mode`` FULL to full
graphs for decodes and graph pieces for the rest, and every step with a prompt in it runs the
48 GDN layer cores eagerly between 65 pieces. On the H100s that is most of a mixed step's
~38 ms, whatever its prefill: the host launching the cores (the profile at ``0261253``: the
cores 35 of a mixed step's 62 ms of profiled host time; bench/results/hybrid/).

With this on, the GDN builder says ``ALWAYS``, so under ``cudagraph_mode`` FULL vLLM captures
and replays one graph per capture size for every step up to the largest, prompts and all. What
makes the GDN core replayable:

- its launches take every sequence bound from the device: our convolution
  (``prefill_gate.kernels.causal_conv``, which finds each program's sequence and chunk from
  the step's ``query_start_loc``) and our recurrence (``gated_delta_recurrent``), over a grid
  sized by the padded token and sequence counts, which a capture size fixes;
- the step's per-sequence metadata (start offsets, state slots, whether a state was cached)
  is copied into buffers allocated once (``padded_metadata``), so a replay reads this step's
  values where the capture read the dummy batch's; the sequences vLLM pads a graph's batch
  with have no tokens and the null slot, which both kernels skip;
- the layers' core takes that path for every such step (``gdn.install`` sees the mark),
  whatever the step holds: the graph fixes the path at capture.

    PREFILL_GATE_GDN_GRAPH  off  vLLM's graphs (the plugin's default: ``on`` needs the launch
                                 settings below; the stack's deploy files set them and turn it on)
                            on   the above; needs PREFILL_GATE_GDN_RECURRENT on, vLLM's
                                 ``--compilation-config '{"cudagraph_mode": "FULL"}'`` and no
                                 speculative decoding (with it, vLLM's graphs); every step then
                                 takes our convolution, whatever PREFILL_GATE_GDN_CONV says
                                 (vLLM's sizes its launch on the host from each step's lengths,
                                 which a graph cannot replay)

Steps above the largest capture size run eagerly as before (the recurrence for short prompts
under ``PREFILL_GATE_GDN_RECURRENT``'s limit, vLLM's chunked path for the rest); inside the
graphs every prompt walks the recurrence, so keep the capture sizes at or under that limit
(512). A running server's control file cannot change the graphs' path (it was fixed at
capture); it still changes the eager steps'.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping

ENV = "PREFILL_GATE_GDN_GRAPH"
MARK = "prefill_gate_graph_seqs"  # on a step's GDN metadata: the padded sequence count its graph holds
logger = logging.getLogger("vllm.prefill_gate")


class GdnGraphError(ValueError):
    """PREFILL_GATE_GDN_GRAPH holds a value the plugin cannot use, or a setting it needs is off."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "off").strip().lower()
    if raw not in ("off", "on"):
        raise GdnGraphError(f"{ENV}={env.get(ENV)!r}: expected off or on")
    return raw == "on"


def check_settings(graph: bool, limit: int) -> None:
    """Refuse a graph mode whose core could not be replayed: the recurrence off."""
    if graph and limit <= 0:
        raise GdnGraphError(f"{ENV}=on needs PREFILL_GATE_GDN_RECURRENT=on: the graphs replay the recurrent path "
                            f"(to run without it, set {ENV}=off as well; compose: GDN_GRAPH=off)")


def buffers(max_seqs: int, device):
    """The persistent per-sequence metadata a graph reads: start offsets, state slots, whether
    each sequence starts from a cached state."""
    import torch

    return (torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
            torch.zeros(max_seqs, dtype=torch.int32, device=device),
            torch.zeros(max_seqs, dtype=torch.bool, device=device))


def padded_metadata(metadata, common, persistent):
    """``metadata`` (vLLM's ``GDNAttentionMetadata`` for a non-speculative step) with its
    per-sequence tensors copied into ``persistent`` (``buffers``) for all ``common.num_reqs``
    sequences of the step as the runner padded it, marked with that count (``MARK``).
    Padded sequences keep what the runner gave them (no tokens, the null slot) and start from
    no state. None when the step has more sequences than the buffers hold."""
    starts, slots, initial = persistent
    n = common.num_reqs
    if n + 1 > starts.numel():
        return None
    source_starts = metadata.non_spec_query_start_loc
    source_slots = metadata.non_spec_state_indices_tensor
    if source_starts is None or source_slots is None or source_starts.numel() < n + 1 or source_slots.numel() < n:
        return None
    starts[:n + 1].copy_(source_starts[:n + 1], non_blocking=True)
    slots[:n].copy_(source_slots[:n], non_blocking=True)
    if metadata.has_initial_state is not None and metadata.has_initial_state.numel() >= n:
        initial[:n].copy_(metadata.has_initial_state[:n], non_blocking=True)
    else:  # a step of decodes only: vLLM leaves it unset; every decode continues a state
        initial[:n].copy_(common.compute_num_computed_tokens()[:n] > 0, non_blocking=True)
    padded = dataclasses.replace(metadata, non_spec_query_start_loc=starts[:n + 1],
                                 non_spec_state_indices_tensor=slots[:n], has_initial_state=initial[:n])
    setattr(padded, MARK, n)
    return padded


def builder_class(base, always, full_mode):
    """A subclass of vLLM's GDN metadata builder (``base``) that claims ``always`` (vLLM's
    ``AttentionCGSupport.ALWAYS``) without speculative decoding and, while the runner's mixed
    steps are full graphs (``full_mode``: vLLM's ``CUDAGraphMode.FULL``), pads every step up to
    the largest capture size into persistent buffers (``padded_metadata``)."""

    class GraphedGDNMetadataBuilder(base):
        prefill_gate_graphed = True

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            if vllm_config.speculative_config is not None:
                return base.get_cudagraph_support(vllm_config, kv_cache_spec)
            return always

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self.prefill_gate_buffers = buffers(vllm_config.scheduler_config.max_num_seqs, device)
            self.prefill_gate_said = False

        def graphs_whole_steps(self, num_tokens: int) -> bool:
            """Does a step of ``num_tokens`` (padded) replay a full graph with prompts in it?
            (Read each step: vLLM resolves the graph mode after the builders exist.) The first
            time it cannot, because of the mode, says so once: the setting would do nothing."""
            config = self.compilation_config
            largest = config.max_cudagraph_capture_size
            mixed = config.cudagraph_mode.mixed_mode()
            if mixed != full_mode and not self.prefill_gate_said and not self.use_spec_decode:
                self.prefill_gate_said = True
                logger.warning("prefill-gate %s=on, but vLLM runs mixed steps as %s, not full graphs: start it with "
                               "--compilation-config '{\"cudagraph_mode\": \"FULL\"}' (another attention backend "
                               "that claims less than ALWAYS also turns FULL down)", ENV, getattr(mixed, "name", mixed))
            return (not self.use_spec_decode and mixed == full_mode and largest is not None and num_tokens <= largest)

        def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
                  num_decode_draft_tokens_cpu=None, fast_build=False):
            metadata = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                                     num_decode_draft_tokens_cpu, fast_build)
            if metadata.spec_sequence_masks is not None or not self.graphs_whole_steps(
                    common_attn_metadata.num_actual_tokens):
                return metadata
            padded = padded_metadata(metadata, common_attn_metadata, self.prefill_gate_buffers)
            return metadata if padded is None else padded

        def build_for_cudagraph_capture(self, common_attn_metadata):
            if self.graphs_whole_steps(common_attn_metadata.num_actual_tokens):
                return self.build(0, common_attn_metadata)  # the dummy batch as a real step
            return super().build_for_cudagraph_capture(common_attn_metadata)

    return GraphedGDNMetadataBuilder


def installed(backend_cls) -> bool:
    return getattr(backend_cls.get_builder_cls(), "prefill_gate_graphed", False)


def install(backend_cls, base, always, full_mode, log: Callable[[str], None]) -> None:
    """Point vLLM's GDN backend (``backend_cls``) at ``builder_class(base, ...)``, once."""
    if installed(backend_cls):
        return
    builder = builder_class(base, always, full_mode)
    backend_cls.get_builder_cls = staticmethod(lambda: builder)
    log(f"Gated DeltaNet: whole CUDA graphs for mixed steps ({ENV}=on): the GDN builder claims ALWAYS; with "
        "--compilation-config '{\"cudagraph_mode\": \"FULL\"}' every step up to the largest capture size replays "
        "one graph, its GDN cores our convolution and recurrence over persistent, padded metadata")
