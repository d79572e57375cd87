"""Short prompts first, inside a paced step.

Pacing bounds a step's prefill tokens while requests decode. In vLLM 0.26's `schedule()`
the running loop goes first and the waiting loop only spends what budget is left, so a
long prompt mid-prefill (a running request) takes the whole bounded budget every step and
a short prompt that arrives waits for the long one to finish: with a 512-token cap and a
28k prompt, 49 steps. Sorting the waiting queue alone changes nothing.

While a step is bounded, this module arranges it so that prompts with at most
SHORT_TOKENS left to compute go first:

  - the long prefills together are clamped to the cap minus what the short ones need,
    but never below LONG_MIN_SHARE of the cap (one whole block in hybrid align mode), so
    a steady stream of short prompts cannot starve a long one;
  - the running list is ordered decodes, long prefills (clamped), short prefills: the
    short ones get everything the clamp left, and the waiting loop what they leave;
  - the waiting queue is seen short-first for this one call (within a priority, under
    `--scheduling-policy priority`), so a long prompt waiting ahead cannot take the
    budget reserved for the short ones behind it.

The clamp reaches vLLM through the one per-request seam between its loops:
`_mamba_block_aligned_split(request, num_new_tokens)`, which both loops call (when
`need_mamba_block_aligned_split` is set) right after they size a request's chunk. The
scheduler overrides it to apply the clamp, then vLLM's own block alignment where the
model needs it. Short prompts are not clamped: the step's lowered per-request threshold
(the cap) never binds below the budget they are given.

"Left to compute" for a waiting prompt is its tokens minus the prefix vLLM's cache holds
(a read-only lookup, only for prompts longer than SHORT_TOKENS, remembered while the
prompt waits): an agent's 30k-token turn whose 29.7k are cached is short.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

# Waiting requests looked at per step: enough to fill any bounded step with short
# prompts, few enough that a long queue costs the scheduler nothing noticeable.
MAX_SCAN = 256


def reserve_for_short(cap: int, short_demand: int, long_pending: bool, long_min_share: float,
                      block_size: int | None = None) -> int:
    """Prefill tokens of a capped step given to short prompts ahead of long ones: their
    demand, but no more than leaves a pending long prompt its share of the cap."""
    if short_demand <= 0:
        return 0
    if not long_pending:
        return min(short_demand, cap)
    floor = math.ceil(long_min_share * cap)
    if block_size:
        floor = max(block_size, -(-floor // block_size) * block_size)
    return max(0, min(short_demand, cap - floor))


@dataclass
class Arrangement:
    """One step's short-first arrangement."""

    reserve: int  # prefill tokens for short prompts ahead of long ones
    allowance: int  # prefill tokens the long running prefills may take together
    long_ids: frozenset[str]
    short_ids: frozenset[str]  # short prefills running or waiting (telemetry)
    waiting_order: list | None = None  # the waiting queue as this step sees it
    spent: int = field(default=0)

    def clamp(self, request_id: str, num_new_tokens: int) -> int:
        if request_id not in self.long_ids:
            return num_new_tokens
        return min(num_new_tokens, max(0, self.allowance - self.spent))

    def took(self, request_id: str, num_new_tokens: int) -> None:
        if request_id in self.long_ids:
            self.spent += num_new_tokens


class ShortFirst:
    """The scheduler-side half: classify, arrange, apply for one `schedule()` call."""

    def __init__(self, scheduler) -> None:
        from prefill_gate.engine_patches import _vllm  # here, so that the pure rule above imports without vLLM

        self._vllm = _vllm
        self.scheduler = scheduler
        self._cached: dict[str, tuple[int, int]] = {}  # request id -> (num_tokens, cached tokens)

    def remaining(self, request) -> int:
        """Prompt tokens a request still has to compute (running or waiting)."""
        if request.num_computed_tokens > 0:
            return request.num_tokens - request.num_computed_tokens
        return request.num_tokens - self._cached_tokens(request)

    def _cached_tokens(self, request) -> int:
        seen = self._cached.get(request.request_id)
        if seen is not None and seen[0] == request.num_tokens:
            return seen[1]
        cached = self._vllm.cached_prefix_tokens(self.scheduler, request)
        self._cached[request.request_id] = (request.num_tokens, cached)
        return cached

    def short_waiting(self, short_tokens: int) -> bool:
        """Does a short prompt wait that could start this step (a running slot free)?"""
        sched = self.scheduler
        if sched.max_num_running_reqs <= len(sched.running):
            return False
        return any(self.remaining(r) <= short_tokens for r in itertools.islice(sched.waiting, MAX_SCAN))

    def long_waiting(self, short_tokens: int) -> bool:
        """Does a prompt with more than ``short_tokens`` left to compute wait (the first MAX_SCAN
        of each queue looked at)?"""
        sched = self.scheduler
        for queue in (sched.waiting, sched.skipped_waiting):
            if any(self.remaining(r) > short_tokens for r in itertools.islice(queue, MAX_SCAN)):
                return True
        return False

    def split_running(self, prefills: list, short_tokens: int) -> tuple[list, list]:
        """Running prefills as (short, long), each in running order."""
        short, long = [], []
        for r in prefills:
            (short if self.remaining(r) <= short_tokens else long).append(r)
        return short, long

    def arrange(self, *, cap: int, short_run: list, long_run: list, short_tokens: int,
                long_min_share: float, block_size: int | None) -> Arrangement | None:
        """The step's arrangement; None when no short prompt waits or prefills (vLLM's
        order stands)."""
        sched = self.scheduler
        slots = sched.max_num_running_reqs - len(sched.running)
        waiting, short_wait, passed_long = [], [], False
        for i, request in enumerate(sched.waiting):
            if i >= MAX_SCAN:
                break
            waiting.append(request)
            # Only a prompt that gets a running slot this step can use the budget.
            if len(short_wait) < slots and self.remaining(request) <= short_tokens:
                short_wait.append(request)
                passed_long = passed_long or len(waiting) > len(short_wait)
        self._forget(sched.waiting)
        if not short_run and not short_wait:
            return None
        demand = sum(self.remaining(r) for r in short_run + short_wait)
        reserve = reserve_for_short(cap, demand, bool(long_run), long_min_share, block_size)
        allowance = cap - reserve
        if block_size:
            allowance = max(block_size, allowance // block_size * block_size)
        order = None
        if passed_long:  # a short prompt waits behind a longer one: show it first
            priority = sched.policy == self._vllm.SchedulingPolicy.PRIORITY
            order = short_first_order(waiting, {id(r) for r in short_wait}, priority)
        return Arrangement(
            reserve, allowance,
            frozenset(r.request_id for r in long_run),
            frozenset(r.request_id for r in short_run + short_wait),
            order,
        )

    def _forget(self, waiting) -> None:
        if len(self._cached) > 4 * MAX_SCAN:  # requests that left the queue
            live = {r.request_id for r in waiting}
            self._cached = {k: v for k, v in self._cached.items() if k in live}

    @contextlib.contextmanager
    def applied(self, arrangement: Arrangement | None) -> Iterator[None]:
        """For one `super().schedule()`: the clamp seam on, the waiting queue reordered;
        both restored after, whatever happens (requests the call admitted leave the queue,
        requests it preempted join it at the front, as vLLM would have done)."""
        sched = self.scheduler
        if arrangement is None:
            yield
            return
        saved_flag = sched.need_mamba_block_aligned_split
        sched.need_mamba_block_aligned_split = True
        original = sched.waiting
        if arrangement.waiting_order is not None:
            sched.waiting = self._vllm.fcfs_queue(arrangement.waiting_order + [
                r for i, r in enumerate(original) if i >= len(arrangement.waiting_order)])
        try:
            yield
        finally:
            sched.need_mamba_block_aligned_split = saved_flag
            if sched.waiting is not original:
                shown, sched.waiting = sched.waiting, original
                left = {id(r) for r in shown}
                known = {id(r) for r in original}
                original.remove_requests([r for r in original if id(r) not in left])
                for r in reversed([r for r in shown if id(r) not in known]):
                    original.prepend_request(r)  # preempted during the call


def short_first_order(waiting: list, short: set[int], priority: bool = False) -> list:
    """Short prompts (their ``id()`` in ``short``) ahead of longer ones, stably; with
    ``priority``, within each request priority."""
    keyed = [((r.priority if priority else 0), id(r) not in short, i) for i, r in enumerate(waiting)]
    return [waiting[k[2]] for k in sorted(keyed)]
