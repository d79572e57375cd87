"""Step pacing: bound the prefill work of each engine step while requests decode.

vLLM's chunked prefill puts a long prompt's chunk and every streaming request's next
token in the same step, so each of those tokens waits for the chunk. These schedulers
change one thing about vLLM 0.26's `schedule()`: while any running request decodes and
prefill work is pending, the step's prefill tokens are bounded.

    PREFILL_GATE_PACING=cap       at most CAP_TOKENS prefill tokens per step
    PREFILL_GATE_PACING=cadence   INTERVAL decode-only steps between prefill steps,
                                  through vLLM's own `throttle_prefills` path
    PREFILL_GATE_PACING=adaptive  the prefill tokens whose predicted step time meets
                                  TARGET_ITL_MS, from a model fitted to measured steps
    PREFILL_GATE_PACING=off       vLLM's own scheduling, untouched (the kill switch)

Use `--scheduler-cls prefill_gate.engine_patches.pacing.PacedAsyncScheduler` when vLLM schedules
asynchronously (its default in 0.26) and `prefill_gate.engine_patches.pacing.PacedScheduler` with
`--no-async-scheduling`. With no request decoding nothing changes: a prompt that runs
alone pays nothing for pacing.

How the bound is applied, without re-implementing vLLM's scheduling loop: running
requests that decode are moved ahead of those still prefilling (stable order within
each group), so a prefilling request earlier in `running` can never take the budget
from the decodes behind it; then the step's token budget is set to the decodes' own
tokens (1 + k with k speculative tokens) plus the prefill cap, and the per-request
`long_prefill_token_threshold` to at most the cap, for the duration of one `super()`
call. Caps are whole KV blocks in hybrid align mode (never below one block: vLLM rounds a
smaller chunk down to nothing and the prefill never advances), unless SUB_BLOCK lets a bounded
step carry part of a block: then a long prompt's chunk may end inside a block but never runs
past a block boundary without ending on it, so the recurrent state every cached block holds is
still the state at its boundary (`_mamba_block_aligned_split`). By default caps keep
decode tokens + cap within the largest CUDA-graph capture size and lower it to a capture
size: vLLM pads a step up to the next one, and the pad tokens cost what real ones do.

Step durations for the adaptive fit are the intervals between `schedule()` calls: with
the synchronous loop, the interval after a call is that step's duration; with the async
batch queue (depth 2), it is the duration of the step scheduled one call earlier.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from prefill_gate._env import FileWatch
from prefill_gate.engine_patches import _vllm
from prefill_gate.engine_patches._vllm import AsyncScheduler, Request, Scheduler, SchedulerOutput
from prefill_gate.engine_patches.config import PacingConfig, PacingConfigError, read_control_file
from prefill_gate.engine_patches.cost_model import StepCostModel, features, is_mixed
from prefill_gate.engine_patches.short_first import Arrangement, ShortFirst
from prefill_gate.engine_patches.telemetry import PacingTelemetry

logger = _vllm.init_logger("vllm.prefill_gate.pacing")

# Intervals longer than this include idle time or a stall, not a step.
MAX_STEP_SECONDS = 2.0
# Adaptive mode keeps its starting cap until the fit has this many mixed steps (prefill
# next to decodes): a line through decode-only and prefill-only steps misses what a small
# mixed step costs (with piecewise graphs, several ms of its own).
MIN_FIT_SAMPLES = 8
# Adaptive mode's feedback on top of the model: it aims the predicted step time at
# target * aim and moves `aim` so that about AIM_QUANTILE of the measured mixed steps
# exceed the target (a stochastic quantile tracker), which absorbs what the model misses:
# its bias, the step-time jitter, and tokens the linear model cannot see.
AIM_QUANTILE = 0.05
AIM_RATE = 0.04
AIM_BOUNDS = (0.5, 1.25)
# After AIM_RECOVER_STEPS mixed steps in a row that filled their caps and each ran more than
# AIM_RECOVER_SLACK of the target under it, the aim rises at AIM_RATE, as fast as a step over the
# target lowers it: the pacer aims low, not a lucky step (at the quantile, with steps' jitter up
# to +-20%, eight such steps in a row come about 3 times in 10,000). After a slowdown no cap
# could escape (every step ~45 ms on the H100 whatever its prefill, bench/results/hybrid/h100/
# run-5b8f30f/) the aim sat at its floor and, at the quantile's slow rise (0.2% a step), took
# ~300 steps to come back, every long prompt in them prefilled at half the share it could.
AIM_RECOVER_SLACK = 0.2
AIM_RECOVER_STEPS = 8
# A mixed step whose host work (schedule() to vLLM's loop coming back after launching it) was at
# least the config's host_share (PREFILL_GATE_PACING_HOST_SHARE, 0.8; 0: never) of its time is
# host-bound: on the 27B hybrid the eager GDN path's launches, ~36 ms of a ~39 ms mixed step on
# the H100 whatever its prefill (16 tokens or 256; decode steps, graph replays, 4 ms of 20;
# bench/results/hybrid/h100/run-1a80097/). Such a step leaves the aim alone when it runs over: a
# smaller prefill would have kept the host as long. And while the median of the latest HOST_STEPS
# mixed steps is host-bound, the line cannot tell what a prefill costs (at a 40 ms target on the
# H100 it put the host's time on the attention term, the cap fell to ~15 tokens and long prompts
# took 12.3x their time alone): the pacer then runs CAP_TOKENS, stepping down from CUDA-graph
# sizes whose measured steps ran over the target.
HOST_STEPS = 16
# A CUDA-graph size above every size measured so far is tried only where the model puts its
# step this fraction of the target below it: the model is a line, and steps padded past a
# matrix-product tile cost more than the line says (cost_model; H100: 256 -> 320 tokens, 40 ->
# 51-56 ms); a size it has measured is judged by what it measured.
PROBE_MARGIN = 0.1
# How often schedule() looks at PREFILL_GATE_PACING_CONTROL_FILE's modification time.
CONTROL_POLL_SECONDS = 0.2
# Trace lines wait for their step's output (`done`); past this many waiting, the oldest is written
# as it is (a step whose output never came, e.g. the engine stopping).
TRACE_PENDING_MAX = 8


@dataclass(frozen=True)
class StepPlan:
    """What pacing does to one step: nothing, defer all prefill, or cap it."""

    defer: bool = False
    prefill_cap: int | None = None
    unreachable: bool = False  # adaptive: the target is below a step without prefill
    target_s: float | None = None  # adaptive: the step time this step aims to hold


@dataclass
class _StepRecord:
    tokens: int
    x: tuple[float, ...]
    filled: bool = False  # its prefill took all of a pacing cap
    target_s: float | None = None  # the step time it was planned to hold (adaptive)
    output: object = None  # the SchedulerOutput, to know it when vLLM's loop comes back
    scheduled_at: float = 0.0
    launched_at: float | None = None  # when the loop came back after launching it (get_grammar_bitmask)

    @property
    def host_s(self) -> float | None:
        """The engine host's work for the step, from schedule() to its launch."""
        return None if self.launched_at is None else self.launched_at - self.scheduled_at


class Pacer:
    """Per-step decisions; no vLLM state, so the policy reads (and tests) on its own."""

    def __init__(
        self,
        config: PacingConfig,
        *,
        block_size: int | None = None,
        graph_sizes: Sequence[int] = (),
        model: StepCostModel | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size  # set only in hybrid align mode
        self.graph_sizes = tuple(sorted(graph_sizes))  # vLLM's capture sizes for mixed steps
        self.model = model or StepCostModel()
        self.deferred_in_row = 0
        self.aim = 0.95
        self.low_in_row = 0  # filled mixed steps in a row well under the target (adaptive)
        self._host_steps: deque[tuple[float, float]] = deque(maxlen=HOST_STEPS)  # mixed: (host s, s)

    @property
    def cap_block(self) -> int | None:
        """The unit caps are rounded to: the KV block in align mode, unless SUB_BLOCK."""
        return None if self.config.sub_block else self.block_size

    def take_measurements(self, old: Pacer) -> None:
        """Carry what ``old`` measured of the engine over to this pacer (new settings, the same
        engine): its mixed steps' host work, and its aim where the target is the same (the aim is
        learned for a target)."""
        self._host_steps = old._host_steps
        if self.config.target_itl_s == old.config.target_itl_s:
            self.aim = old.aim

    @property
    def host_bound(self) -> bool:
        """Are the latest mixed steps bound by the engine's host (their median host work at least
        the config's host_share of their median time)? Never with a share of 0."""
        steps, share = self._host_steps, self.config.host_share
        if not share or len(steps) < MIN_FIT_SAMPLES:
            return False
        return statistics.median(h for h, _ in steps) >= share * statistics.median(t for _, t in steps)

    @property
    def graph_limit(self) -> int | None:
        """The largest CUDA-graph capture size when the clamp applies."""
        return self.graph_sizes[-1] if self.graph_sizes and self.config.graph_clamp else None

    def plan(
        self,
        *,
        decoding: bool,
        prefill_pending: bool,
        decode_tokens: int,
        prefill_start: int,
        engine_throttle: bool = False,
        short_only: bool = False,
    ) -> StepPlan:
        """``short_only``: every pending prefill is a short prompt (SHORT_STEP_X applies)."""
        mode = self.config.mode
        if mode == "off" or not (decoding and prefill_pending):
            self.deferred_in_row = 0
            return StepPlan()
        if mode == "cadence":
            if self.deferred_in_row < self.config.interval or (
                engine_throttle and self.deferred_in_row < self.config.max_deferred
            ):
                self.deferred_in_row += 1
                return StepPlan(defer=True)
            self.deferred_in_row = 0
            return StepPlan()
        if mode == "cap":
            return StepPlan(prefill_cap=self._fit_cap(self.config.cap_tokens, decode_tokens))
        target = self.step_target(decode_tokens, short_only)
        cap = self._adaptive_cap(decode_tokens, prefill_start, target)
        if cap is None:  # no prefill size meets the target: the configured cap, not starvation
            return StepPlan(prefill_cap=self._fit_cap(self.config.cap_tokens, decode_tokens),
                            unreachable=True, target_s=target)
        return StepPlan(prefill_cap=self._fit_cap(cap, decode_tokens), target_s=target)

    def step_target(self, decode_rows: int, short_only: bool = False) -> float:
        """The step time an adaptive step aims to hold: the target, or, for a step whose pending
        prefill is all short prompts, SHORT_STEP_X times the predicted step without prefill where
        that is lower (once the model has its mixed steps). A short prompt then takes a step more
        and each of its steps costs the streams less; long prompts' steps keep the target."""
        target = self.config.target_itl_s
        assert target is not None
        x = self.config.short_step_x
        if short_only and x and self.model.mixed_samples >= MIN_FIT_SAMPLES:
            target = min(target, x * self.model.predict(features(decode_rows, [])))
        return target

    def _adaptive_cap(self, decode_rows: int, prefill_start: int, target: float) -> int | None:
        """The prefill tokens the fitted model allows within the target, or None when the
        model predicts that even a step without prefill takes longer than the target.

        The aim scales only the prefill's share of the target (target minus the predicted
        step without prefill): when steps come out slower than predicted the tracker
        shrinks the prefill, but it can never talk the budget down to nothing. A target
        the model says is out of reach (e.g. steps bound by the host CPU, whose time does
        not shrink with the prefill) falls back to CAP_TOKENS: smaller chunks would only
        slow the prompt, not speed up the decodes.
        """
        if self.model.mixed_samples < MIN_FIT_SAMPLES:
            return self.config.cap_tokens
        if self.host_bound and self.graph_sizes and self.config.graph_align:
            if statistics.median(h for h, _ in self._host_steps) >= target:
                return None  # the host alone takes longer than the target: no cap would do
            return self._within_measured_sizes(self.config.cap_tokens, decode_rows, target)
        base = self.model.predict(features(decode_rows, []))
        if base >= target:
            return None
        aimed = base + self.aim * (target - base)
        n = self.model.prefill_budget(aimed, decode_rows, prefill_start)
        if math.isinf(n):
            return self.config.cap_tokens
        return self._within_graph_costs(max(self.config.min_tokens, int(n)), decode_rows, prefill_start,
                                        min(aimed, target))

    def _within_measured_sizes(self, cap: int, decode_tokens: int, budget_s: float) -> int:
        """The cap on a host-bound engine: lowered past the CUDA-graph sizes whose recent mixed
        steps (`StepCostModel.measured`) took more than ``budget_s`` (the median, as measured: the
        line cannot price them); sizes with none are taken as they come."""
        sizes = self.graph_sizes
        cap = self._fit_cap(cap, decode_tokens)
        while True:
            size = self.graph_size(decode_tokens + cap)
            if size is None:
                return cap  # an eager step: no size to judge
            measured = self.model.measured(size)
            i = bisect.bisect_left(sizes, size)
            if measured is None or measured <= budget_s or i == 0 or sizes[i - 1] <= decode_tokens:
                return cap
            cap = sizes[i - 1] - decode_tokens
            if cap < self.config.min_tokens:
                return self.config.min_tokens

    def graph_size(self, tokens: int) -> int | None:
        """The CUDA-graph size a mixed step of ``tokens`` is padded to; None: it runs eagerly."""
        sizes = self.graph_sizes
        if not sizes or tokens > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, tokens)]

    def _within_graph_costs(self, cap: int, decode_tokens: int, prefill_start: int, budget_s: float) -> int:
        """The cap, lowered past CUDA-graph sizes the line underestimates: the step is padded
        to the size alignment lowers it to (`_fit_cap`); a size measured to run over
        ``budget_s`` (the line plus the size's measured excess), or one above every measured
        size whose line is not PROBE_MARGIN of the target below ``budget_s``, gives way to the
        next smaller size."""
        sizes = self.graph_sizes
        if not sizes or not self.config.graph_align:
            return cap
        assert self.config.target_itl_s is not None
        probe_budget = budget_s - PROBE_MARGIN * self.config.target_itl_s
        largest = self.model.largest_measured_size
        while True:
            total = decode_tokens + cap
            if self.graph_limit is not None:
                total = min(total, self.graph_limit)
            if total > sizes[-1]:
                return cap  # an eager step: no size to judge
            i = bisect.bisect_right(sizes, total) - 1
            if i < 0 or sizes[i] <= decode_tokens:
                return cap  # below every size that holds a prefill token: alignment keeps it
            size = sizes[i]
            predicted = self.model.predict(features(decode_tokens, [(prefill_start, size - decode_tokens)]))
            excess = self.model.excess(size)
            if excess is not None:
                fits = predicted + excess <= budget_s
            else:
                fits = size <= largest or predicted <= probe_budget
            if fits or i == 0 or sizes[i - 1] <= decode_tokens:
                return cap
            cap = sizes[i - 1] - decode_tokens  # the next smaller size, judged in turn
            if cap < self.config.min_tokens:
                return self.config.min_tokens

    def feedback(self, seconds: float, filled: bool = False, host_s: float | None = None,
                 target_s: float | None = None) -> None:
        """A measured step that ran prefill next to decodes (adaptive mode); ``filled``: its
        prefill took all the cap it was given; ``host_s``: the engine host's work to launch it;
        ``target_s``: the step time it was planned to hold (default: the target)."""
        if self.config.mode != "adaptive" or self.config.target_itl_s is None:
            return
        target = target_s or self.config.target_itl_s
        if host_s is not None:
            self._host_steps.append((host_s, seconds))
        if seconds > target:
            self.low_in_row = 0
            if host_s is not None and self.config.host_share and host_s >= self.config.host_share * seconds:
                return  # the host's step: a smaller prefill would have kept the host as long
            self.aim *= 1 - AIM_RATE
        else:
            if filled:  # a step its prompt's end or a block boundary cut short neither counts nor breaks the row
                self.low_in_row = self.low_in_row + 1 if seconds < (1 - AIM_RECOVER_SLACK) * target else 0
            fast = self.low_in_row >= AIM_RECOVER_STEPS
            self.aim *= 1 + (AIM_RATE if fast else AIM_RATE * AIM_QUANTILE / (1 - AIM_QUANTILE))
        self.aim = min(max(self.aim, AIM_BOUNDS[0]), AIM_BOUNDS[1])

    def _fit_cap(self, cap: int, decode_tokens: int) -> int:
        limit = self.graph_limit
        if limit is not None and decode_tokens < limit:
            cap = min(cap, limit - decode_tokens)
        quantum = self.config.step_quantum
        if quantum and (decode_tokens + cap) // quantum * quantum > decode_tokens:
            cap = (decode_tokens + cap) // quantum * quantum - decode_tokens
        if self.config.graph_align:
            cap = self._align_to_graph(cap, decode_tokens)
        cap = max(cap, 1)
        if self.cap_block:
            cap = max(self.cap_block, cap // self.cap_block * self.cap_block)
        return cap

    def _align_to_graph(self, cap: int, decode_tokens: int) -> int:
        """Lower the cap so the step fills a capture size: vLLM pads a step up to the next
        one and computes the pad tokens in full, so 256 prefill tokens + 1 decode cost a
        272-token step where 255 + 1 cost 256. Steps past the largest size run unpadded."""
        sizes = self.graph_sizes
        total = decode_tokens + cap
        if not sizes or total > sizes[-1]:
            return cap
        fit = sizes[bisect.bisect_right(sizes, total) - 1] if total >= sizes[0] else 0
        return fit - decode_tokens if fit > decode_tokens else cap


class _PacingMixin:
    """The `schedule()` override shared by both scheduler classes."""

    _schedule_lag = 0  # which earlier step the interval between two calls measures

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = PacingConfig.from_env()
        align = self._model_aligns = self.need_mamba_block_aligned_split
        self._graph_sizes = _mixed_step_graph_sizes(self.vllm_config)
        self.pacer = Pacer(
            config,
            block_size=self.cache_config.block_size if align else None,
            graph_sizes=self._graph_sizes,
        )
        self.pacing_clock = time.perf_counter
        self.pacing_telemetry = PacingTelemetry(config, self.pacer.model)
        self._pacing_steps: deque[_StepRecord] = deque(maxlen=4)
        self._pacing_last_call: float | None = None
        self.short_first = ShortFirst(self)
        self._arrangement: Arrangement | None = None  # this step's, during super().schedule()
        self._sub_block_step = False  # a bounded step with SUB_BLOCK on, during super().schedule()
        self._control_path = os.environ.get("PREFILL_GATE_PACING_CONTROL_FILE") or None
        self._control = FileWatch(self._control_path, CONTROL_POLL_SECONDS) if self._control_path else None
        trace = os.environ.get("PREFILL_GATE_PACING_TRACE_FILE") or None
        # line-buffered, so a killed engine leaves every step whose output came back in the file
        self._trace = open(trace, "a", buffering=1, encoding="utf-8") if trace else None  # noqa: SIM115 (open for the engine's life)
        self._trace_pending: deque[tuple[SchedulerOutput, dict]] = deque()  # lines awaiting `done`
        self._log_pacing()

    def _log_pacing(self) -> None:
        config = self.pacer.config
        piecewise = self.vllm_config.compilation_config.cudagraph_mode.mixed_mode() == _vllm.CUDAGraphMode.PIECEWISE
        if config.mode == "adaptive" and self._graph_sizes and piecewise and self.has_mamba_layers:
            # vLLM 0.26's Mamba and GDN metadata builders take full graphs for uniform batches
            # only, and it resolves FULL to FULL_AND_PIECEWISE for them: advice to ask for FULL
            # alone would change nothing here (gdn_graph's builder claims more: FULL stays).
            logger.warning(
                "prefill-gate adaptive pacing on a model with recurrent (Mamba or Gated DeltaNet) "
                "layers: vLLM graphs their steps whole only where every request decodes, so mixed "
                "steps replay piecewise; their time follows the host CPU and a step can pass the "
                "target (on a Gated DeltaNet hybrid PREFILL_GATE_GDN_GRAPH=on with cudagraph_mode "
                "FULL graphs them whole: docs/engine-patches.md)"
            )
        elif config.mode == "adaptive" and self._graph_sizes and piecewise:
            logger.warning(
                "prefill-gate adaptive pacing with piecewise CUDA graphs for mixed steps: their "
                "attention runs outside the graphs and their time follows the host CPU, which the "
                "target may not survive; start vLLM with --compilation-config "
                "'{\"cudagraph_mode\":\"FULL\"}' (docs/engine-patches.md)"
            )
        logger.info(
            "prefill-gate %s%s%s%s%s",
            config.describe(),
            f"; caps in whole blocks of {self.pacer.block_size}" if self.pacer.cap_block
            else f"; chunks may end inside a block of {self.pacer.block_size}, never cross a boundary"
            if self.pacer.block_size else "",
            f"; decode tokens + cap <= {self.pacer.graph_limit} (largest CUDA graph)"
            if self.pacer.graph_limit and config.mode in ("cap", "adaptive")
            else "",
            "; decode tokens + cap lowered to a CUDA-graph capture size"
            if self.pacer.graph_sizes and config.graph_align and config.mode in ("cap", "adaptive")
            else "",
            f"; control file {self._control_path}" if self._control_path else "",
        )

    def _poll_control_file(self, now: float) -> None:
        if not self._control.changed(now):  # unchanged, or absent: keep the running settings
            return
        try:
            config = read_control_file(self._control_path, os.environ)
        except (OSError, PacingConfigError) as exc:
            logger.error("prefill-gate pacing: control file ignored, settings kept: %s", exc)
            return
        old = self.pacer
        self.pacer = Pacer(config, block_size=old.block_size, graph_sizes=self._graph_sizes, model=old.model)
        self.pacer.take_measurements(old)
        self.pacing_telemetry.config = config
        self._log_pacing()

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        now = self.pacing_clock()
        if self._control is not None:
            self._poll_control_file(now)
        if self.pacer.config.mode == "off":
            return super().schedule(throttle_prefills)
        self._observe_step_time(now)

        step = self.current_step + 1  # super().schedule() increments it first
        config = self.pacer.config
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if _vllm.is_decoding(request) else prefills).append(request)
        decode_tokens = {r.request_id: _vllm.decode_tokens(self, r, step) for r in decodes}
        # A request whose last token is already in flight (async scheduling) gets no token
        # this step: it does not make the step a decode step.
        decoding = any(decode_tokens.values())
        short_run: list[Request] = []
        paces_short = bool(config.short_tokens and config.mode in ("cap", "adaptive"))
        split = ([], prefills)
        if paces_short and (decoding or config.short_when_idle):
            split = self.short_first.split_running(prefills, config.short_tokens)
        # SHORT_WHEN_IDLE: with nothing decoding, a short prompt beside a long prefill bounds the
        # step as a stream would, so its first token comes after one bounded step, not after the
        # long prompt's next whole chunk
        bounded = decoding or (config.short_when_idle and paces_short and bool(split[1])
                               and (bool(split[0]) or self.short_first.short_waiting(config.short_tokens)))
        short_first = paces_short and bounded
        if short_first:  # long prefills take their clamped share first, short ones the rest
            short_run, prefills = split
        ordered = decodes + prefills + short_run
        if any(a is not b for a, b in zip(self.running, ordered)):
            self.running[:] = ordered
        # SHORT_STEP_X: nothing long running or waiting, so the step's prefill is short prompts'
        short_only = (short_first and not prefills and bool(config.short_step_x)
                      and not self.short_first.long_waiting(config.short_tokens))
        plan = self.pacer.plan(
            decoding=bounded,
            prefill_pending=bool(short_run or prefills or self.waiting or self.skipped_waiting),
            decode_tokens=sum(decode_tokens.values()),
            prefill_start=(prefills or short_run)[0].num_computed_tokens if prefills or short_run else 0,
            engine_throttle=throttle_prefills,
            short_only=short_only,
        )

        arrangement = None
        if plan.defer:
            # vLLM disables its throttle while prefill capacity is saturated (a DP
            # balancing heuristic); the cadence is bounded by MAX_DEFERRED instead.
            self.prefill_capacity_bound = False
            output = super().schedule(True)
        elif plan.prefill_cap is not None:
            if short_first:
                arrangement = self.short_first.arrange(
                    cap=plan.prefill_cap, short_run=short_run, long_run=prefills,
                    short_tokens=config.short_tokens, long_min_share=config.long_min_share,
                    block_size=self.pacer.cap_block)
            output = self._schedule_capped(sum(decode_tokens.values()) + plan.prefill_cap, plan.prefill_cap,
                                           arrangement)
        else:
            output = super().schedule(throttle_prefills and config.mode != "cadence")

        self._record_step(output, {r.request_id for r in decodes}, plan, now, arrangement)
        return output

    def _schedule_capped(self, budget: int, cap: int, arrangement: Arrangement | None) -> SchedulerOutput:
        config = self.scheduler_config
        saved_budget = self.max_num_scheduled_tokens
        saved_threshold = config.long_prefill_token_threshold
        self.max_num_scheduled_tokens = min(saved_budget, budget)
        config.long_prefill_token_threshold = (
            cap if saved_threshold <= 0 else min(saved_threshold, cap)
        )
        self._arrangement = arrangement
        self._sub_block_step = self._model_aligns and self.pacer.config.sub_block
        try:
            with self.short_first.applied(arrangement):
                return super().schedule(False)
        finally:
            self._arrangement = None
            self._sub_block_step = False
            self.max_num_scheduled_tokens = saved_budget
            config.long_prefill_token_threshold = saved_threshold

    def _mamba_block_aligned_split(self, request: Request, num_new_tokens: int, *args) -> int:
        """The per-request seam both of vLLM's loops call after sizing a chunk (see
        prefill_gate.engine_patches.short_first): this step's clamp on long prefills, then vLLM's own
        block alignment where the model needs it."""
        arrangement = self._arrangement
        if arrangement is not None:
            num_new_tokens = arrangement.clamp(request.request_id, num_new_tokens)
        if self._model_aligns:
            wanted = num_new_tokens
            num_new_tokens = super()._mamba_block_aligned_split(request, num_new_tokens, *args)
            if num_new_tokens == 0 and wanted > 0 and self._sub_block_step:
                num_new_tokens = self._within_block(request, wanted, *args)
        if arrangement is not None:
            arrangement.took(request.request_id, num_new_tokens)
        return num_new_tokens

    def _within_block(self, request: Request, wanted: int, local_computed: int = 0,
                      external_computed: int = 0) -> int:
        """A chunk vLLM's alignment rounded to nothing (it ends before the next block
        boundary): the part of it up to that boundary, where the state is cached.

        vLLM keeps a request's running recurrent state in the slot of the block that holds
        its last computed token, copies it into the next block's slot when a step starts
        past a boundary, and caches a block when the request's tokens fill it. A chunk that
        ends inside a block leaves the state in that block's slot, the next chunk continues
        from the same slot, and the chunk that reaches the boundary ends on it (vLLM's own
        split stops a chunk that starts inside a block at the next boundary), so the state a
        cached block holds is its boundary's. From the prompt's last full block on, vLLM does
        not align chunks at all, so nothing is left to do there."""
        block = self.cache_config.block_size
        start = request.num_computed_tokens + local_computed + external_computed
        last_cached = request.num_tokens - request.num_tokens % block
        if self.use_eagle:
            last_cached = max(last_cached - block, 0)
        if start >= last_cached:
            return 0
        return min(wanted, (start // block + 1) * block - start)

    def _record_step(self, output: SchedulerOutput, decode_ids: set[str], plan: StepPlan,
                     now: float, arrangement: Arrangement | None = None) -> None:
        decode_rows = 0
        chunks: list[tuple[int, int]] = []
        for req_id, n in output.num_scheduled_tokens.items():
            if req_id in decode_ids:
                decode_rows += 1
            else:
                # _update_after_schedule has already advanced num_computed_tokens.
                start = self.requests[req_id].num_computed_tokens - n
                chunks.append((start, n))
        x = features(decode_rows, chunks)
        prefill = sum(n for _, n in chunks)
        filled = plan.prefill_cap is not None and prefill >= plan.prefill_cap
        self._pacing_steps.append(_StepRecord(output.total_num_scheduled_tokens, x, filled, plan.target_s, output, now))
        short_tokens = 0
        if arrangement is not None and (arrangement.long_ids or arrangement.waiting_order is not None):
            # a short prompt went ahead of a long one that wanted the same tokens
            short_tokens = sum(n for rid, n in output.num_scheduled_tokens.items() if rid in arrangement.short_ids)
        self.pacing_telemetry.step(
            decode_rows=decode_rows,
            prefill_tokens=sum(n for _, n in chunks),
            plan_cap=plan.prefill_cap,
            deferred=plan.defer,
            unreachable=plan.unreachable,
            short_first=short_tokens > 0,
        )
        if self._trace is not None and output.total_num_scheduled_tokens:
            self._trace_step(output, now, decode_rows, chunks, plan, x, short_tokens)

    def _trace_step(self, output: SchedulerOutput, now: float, decode_rows: int, chunks: list[tuple[int, int]],
                    plan: StepPlan, x: tuple[float, ...], short_tokens: int) -> None:
        """One JSON line per step with work in it while pacing is on: what was scheduled
        and why (`short_first_tokens`: prefill tokens short prompts took ahead of a long one).
        `t` is when schedule() was called; `launched`, when vLLM's engine loop came back to the
        scheduler after launching the step's forward pass (`get_grammar_bitmask`: the host's
        work for the step until then, the eager GDN path's included); `done`, when its output
        reached the scheduler (`update_from_output`), all on the same clock (null where the
        loop did not call). With the synchronous loop a step lasts until the next line's `t`;
        with async scheduling the interval after a step's `t` is its own host work (`launched -
        t`) plus the wait for the step before it: the previous step's time where the GPU is
        the bottleneck, about nothing where the host is. `unix`: the same moment as `t` on the
        wall clock, to set the steps beside a client's record of its gaps (`bench mixed`'s
        `t0_unix`). `host_bound`: the cap came from the sizes' measured steps (`Pacer.host_bound`).
        `graph_size`: the CUDA-graph size vLLM pads the step to (null: eager). A line is written
        once its step's output came back, so lines stay in step order."""
        adaptive = self.pacer.config.mode == "adaptive"
        record = {
            "step": self.current_step, "t": round(now, 6), "unix": round(time.time(), 4),
            "mode": self.pacer.config.mode,
            "decode_rows": decode_rows, "chunks": chunks, "cap": plan.prefill_cap,
            "deferred": plan.defer, "unreachable": plan.unreachable,
            "short_first_tokens": short_tokens,
            "aim": round(self.pacer.aim, 4) if adaptive else None,
            "target_s": None if plan.target_s is None else round(plan.target_s, 6),
            "predicted_s": round(self.pacer.model.predict(x), 6) if adaptive else None,
            "host_bound": self.pacer.host_bound if adaptive else None,
            "graph_size": self.pacer.graph_size(output.total_num_scheduled_tokens),
            "launched": None, "done": None,
        }
        self._trace_pending.append((output, record))
        self._flush_trace()

    def _stamp_trace(self, output: SchedulerOutput, key: str, now: float) -> None:
        for pending, record in self._trace_pending:
            if pending is output:
                record[key] = round(now, 6)
                return

    def _flush_trace(self, everything: bool = False) -> None:
        assert self._trace is not None
        pending = self._trace_pending
        while pending and (everything or pending[0][1]["done"] is not None or len(pending) > TRACE_PENDING_MAX):
            self._trace.write(json.dumps(pending.popleft()[1], separators=(",", ":")) + "\n")

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput):
        """vLLM's engine loop calls this right after launching the step (both loops): the host's
        work for the step ends here."""
        if self._pacing_steps and self._pacing_steps[-1].output is scheduler_output:
            now = self.pacing_clock()
            self._pacing_steps[-1].launched_at = now
            if self._trace_pending:
                self._stamp_trace(scheduler_output, "launched", now)
        return super().get_grammar_bitmask(scheduler_output)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output):
        if self._trace_pending:
            self._stamp_trace(scheduler_output, "done", self.pacing_clock())
            self._flush_trace()
        return super().update_from_output(scheduler_output, model_runner_output)

    def shutdown(self) -> None:
        if self._trace is not None:
            self._flush_trace(everything=True)
        super().shutdown()

    def _observe_step_time(self, now: float) -> None:
        last, self._pacing_last_call = self._pacing_last_call, now
        if last is None or self.pacer.config.mode != "adaptive":
            return
        steps = self._pacing_steps
        lag = self._schedule_lag
        if len(steps) < 1 + lag:
            return
        measured = steps[-1 - lag]
        # Every step between the measured one and now must have run (no idle gap).
        if any(s.tokens == 0 for s in list(steps)[-1 - lag :]):
            return
        seconds = now - last
        if 0 < seconds < MAX_STEP_SECONDS:
            self.pacer.model.observe(measured.x, seconds, size=self.pacer.graph_size(measured.tokens))
            if is_mixed(measured.x):
                self.pacer.feedback(seconds, measured.filled, measured.host_s, measured.target_s)
            self.pacing_telemetry.fitted(seconds, self.pacer.aim, self.pacer.host_bound)


def _mixed_step_graph_sizes(vllm_config) -> tuple[int, ...]:
    """The CUDA-graph sizes a step with prefill in it is padded to; () when such steps
    run eagerly (enforce_eager, cudagraph_mode NONE or FULL_DECODE_ONLY)."""
    compilation = vllm_config.compilation_config
    if vllm_config.model_config.enforce_eager or compilation.cudagraph_mode is None:
        return ()
    if compilation.cudagraph_mode.mixed_mode() == _vllm.CUDAGraphMode.NONE:
        return ()
    return tuple(sorted(compilation.cudagraph_capture_sizes or ()))


class PacedScheduler(_PacingMixin, Scheduler):
    """vLLM's synchronous scheduler with step pacing (`--no-async-scheduling`)."""

    _schedule_lag = 0


class PacedAsyncScheduler(_PacingMixin, AsyncScheduler):
    """vLLM's async scheduler (0.26's default) with step pacing."""

    _schedule_lag = 1
