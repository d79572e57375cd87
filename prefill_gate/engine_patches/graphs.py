"""CUDA graphs for the small mixed steps: capture sizes up to 512 tokens whatever --max-num-seqs.

vLLM 0.26 captures CUDA graphs up to min(2 x --max-num-seqs, 512) tokens, so with a small
--max-num-seqs a step that carries a short prompt next to the decodes runs eagerly: every
kernel launched from Python, one by one. On a host-bound model that is most of the step.
The 27B Gated DeltaNet hybrid at --max-num-seqs 64 captures up to 128 tokens, and a
200-400-token prompt cost its streams a step of 115 ms at the median, 181 ms at worst; with
graphs up to the step budget, 92 and 130 ms (bench/results/graphs/h200/, issue 50).

Only the small steps gain. The same runs measured what larger graphs cost: a long prompt alone
took 9% longer on the hybrid (its 1,568-token align-mode chunks padded to the 1,792 graph, and
a stream's worst gap beside it grew from 181 to 202 ms) and 13% longer on the 8B dense model
with full graphs up to 8,192 tokens. Large steps are GPU-bound: launching them from a graph
saves little, and the padding and the graphs' fixed attention setup cost compute. So the plugin fills in vLLM's own ceiling, 512 tokens,
where --max-num-seqs set it lower, and goes past it only when told to:

    PREFILL_GATE_GRAPH_STEPS  auto  sizes up to 512 tokens (at most --max-num-batched-tokens)
                                    when vLLM runs the paced scheduler (--scheduler-cls
                                    prefill_gate...); any other vLLM in this environment is
                                    left alone (the default)
                              on    the same for any scheduler
                              off   vLLM's own sizes
                              N     up to N tokens (at most --max-num-batched-tokens), any scheduler

Sizes are added only when the user set neither `cudagraph_capture_sizes` nor
`max_cudagraph_capture_size` (a choice of theirs wins) and graphs are on. Below vLLM's own
largest size nothing changes; above it the sizes climb in LADDER_PER_OCTAVE steps per
doubling, so vLLM pads a step by less than a quarter of its tokens (pacing cuts its own
steps to a captured size and pays nothing), and the largest size is the limit itself.

The sizes go in through vLLM's own path: `VllmConfig._set_cudagraph_sizes` runs as usual,
then runs again with the extended list as if the user had written it, so the filtering,
sequence-parallel rounding and bookkeeping are vLLM's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

ENV = "PREFILL_GATE_GRAPH_STEPS"
MODES = ("auto", "on", "off")
# Sizes per doubling above vLLM's own largest capture size: a step is padded by < 1/4.
LADDER_PER_OCTAVE = 4
# auto and on: vLLM's own ceiling. Past it steps are GPU-bound and graphs cost more than they
# save (the measurements above).
AUTO_LIMIT = 512
PACKAGE = "prefill_gate.engine_patches"


class GraphStepsError(ValueError):
    """PREFILL_GATE_GRAPH_STEPS holds a value the plugin cannot use."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> str | int:
    """"auto", "on", "off" or a token limit, validated (an error names the variable)."""
    env = os.environ if environ is None else environ
    raw = (env.get(ENV) or "auto").strip().lower()
    if raw in MODES:
        return raw
    try:
        limit = int(raw)
    except ValueError:
        raise GraphStepsError(f"{ENV}={env.get(ENV)!r}: expected auto, on, off or a token count") from None
    if not 1 <= limit <= 1 << 20:
        raise GraphStepsError(f"{ENV}={limit}: expected a token count in 1..{1 << 20}")
    return limit


def ladder(low: int, high: int, per_octave: int = LADDER_PER_OCTAVE) -> list[int]:
    """Sizes above ``low`` up to and including ``high``: ``per_octave`` evenly spaced steps per
    doubling (each a multiple of 16), the last one ``high`` itself."""
    sizes: list[int] = []
    size = low
    while size < high:
        step = max(16, (1 << (size.bit_length() - 1)) // per_octave)
        size = min((size // step + 1) * step, high)
        sizes.append(size)
    return sizes


def covering_limit(mode: str | int, scheduler_cls: object, max_num_batched_tokens: int) -> int | None:
    """The size graphs should reach, or None to leave vLLM's sizes as they are."""
    if mode == "off":
        return None
    if mode == "auto" and not is_ours(scheduler_cls):
        return None
    if isinstance(mode, int):
        return min(mode, max_num_batched_tokens)
    return min(AUTO_LIMIT, max_num_batched_tokens)


def extended_sizes(sizes: Sequence[int], limit: int) -> list[int]:
    """vLLM's sizes with the ladder from their largest up to ``limit``."""
    low = max(sizes) if sizes else 0
    return sorted(set(sizes) | set(ladder(low, limit))) if limit > low else sorted(sizes)


def describe_sizes(before: Sequence[int], after: Sequence[int]) -> str:
    added = sorted(set(after) - set(before))
    if not added:
        return f"CUDA graphs: vLLM's {len(before)} sizes up to {max(before, default=0)} tokens"
    return (f"CUDA graphs up to {after[-1]} tokens: {len(added)} sizes added above vLLM's "
            f"{max(before, default=0)} ({', '.join(map(str, added[:6]))}{', ...' if len(added) > 6 else ''})")


def install(vllm_config_cls, mode: str | int, log) -> None:
    """Wrap ``vllm_config_cls._set_cudagraph_sizes`` so that configs built from now on get the
    covering sizes for ``mode``; ``log(message)`` is told what was added for each config.
    Installing again only replaces the mode and the log (register() runs in every process)."""
    current = vllm_config_cls._set_cudagraph_sizes
    if hasattr(current, "prefill_gate_settings"):
        current.prefill_gate_settings.update(mode=mode, log=log)
        return
    original = current
    settings = {"mode": mode, "log": log}

    @functools.wraps(original)
    def set_cudagraph_sizes(self) -> None:
        compilation = self.compilation_config
        user_sizes = compilation.cudagraph_capture_sizes is not None
        user_max = compilation.max_cudagraph_capture_size is not None
        compile_sizes = compilation.compile_sizes
        original(self)
        if user_sizes or user_max:
            return
        limit = covering_limit(settings["mode"], self.scheduler_config.scheduler_cls,
                               self.scheduler_config.max_num_batched_tokens)
        before = list(compilation.cudagraph_capture_sizes or ())
        if limit is None or not before:  # not covering, or graphs are off
            return
        after = extended_sizes(before, limit)
        if after != before:
            compilation.cudagraph_capture_sizes = after
            compilation.max_cudagraph_capture_size = None
            compilation.compile_sizes = compile_sizes
            original(self)
        settings["log"](describe_sizes(before, list(compilation.cudagraph_capture_sizes)))

    set_cudagraph_sizes.prefill_gate_settings = settings  # type: ignore[attr-defined]
    vllm_config_cls._set_cudagraph_sizes = set_cudagraph_sizes


def is_ours(scheduler_cls: object) -> bool:
    name = scheduler_cls if isinstance(scheduler_cls, str) else getattr(scheduler_cls, "__module__", "")
    return isinstance(name, str) and name.startswith(PACKAGE + ".")
