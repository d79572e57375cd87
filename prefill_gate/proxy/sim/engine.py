"""A step-level model of vLLM's chunked-prefill engine.

Scheduling follows vLLM's V1 scheduler in the shape that matters for the overlap:
a token budget per step (``max_num_batched_tokens``); every decoding request
gets its token first; then prompt chunks, first come first served, each capped by
``long_prefill_token_threshold`` and what is left of the budget; at most
``max_num_seqs`` requests run; prompts reuse whole cached blocks of earlier prompts
(prefix caching), and at least the last prompt token is always computed. With
``pacing_cap``, it paces like engine_patches' cap mode: while a request decodes, a step's
prefill is capped, and short prompts go before long ones within the cap
(``pacing_short_tokens``, ``pacing_long_min_share``: prefill_gate.engine_patches.short_first's rule;
``pacing_sub_block``: PREFILL_GATE_PACING_SUB_BLOCK, a capped step may end a chunk inside a block;
``pacing_short_when_idle``: PREFILL_GATE_PACING_SHORT_WHEN_IDLE, short-first with nothing decoding).

``plan()`` is pure arithmetic (tests check it against hand-computed step
sequences); ``run()`` sleeps each step for the time the ``CostModel`` gives.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from prefill_gate.engine_patches.short_first import reserve_for_short, short_first_order


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step: ``base`` (a decode-only step of one row, under a CUDA
    graph) + ``mixed`` when the step carries prompt tokens + ``per_decode_row`` per extra
    row + ``per_prefill_token`` + ``attention`` x sum(chunk tokens x mean context they
    attend to) + ``decode_kv`` x decode context tokens; x a lognormal jitter. A step that carries
    prompt tokens takes at least ``base + mixed_floor``: where small mixed steps run eagerly the
    host's kernel launches bound them however few tokens they hold (a 27B hybrid's 300-token
    step: ~100 ms of host time against ~15 ms of prefill compute), and a large step's GPU work
    hides the same launches. ``graph_tokens`` > 0: a step of more tokens than that (decode rows
    and prompt tokens) runs without vLLM's CUDA graphs and costs ``eager`` more (off in the
    presets; the H200 with Qwen3-8B: ~14 ms for a 432-token slice beside one stream, ~40-50 ms
    for 512-768 tokens). ``eager_tail``: the share of those eager steps that take ``eager_tail_s``
    more (a busy host launching them: on an H100 host 1 in ~20 eager steps stalled streams
    ~75 ms longer, none within the graph; bench/results/defaults/h100/run-b953a47/).
    ``graph_per_prefill_token`` > 0: a step within the graphs costs that per prompt token
    instead of ``per_prefill_token`` (the stack's Gated DeltaNet path walks a short step's
    prompt token by token, ~0.09 ms a token on the H200's 27B hybrid, where a larger step's
    chunked kernels cost ~0.05)."""

    base: float
    mixed: float = 0.0
    per_decode_row: float = 0.0
    per_prefill_token: float = 0.0
    attention: float = 0.0
    decode_kv: float = 0.0
    jitter: float = 0.0  # sigma of log(step time)
    frontend_per_token: float = 0.0  # delay before a text prompt reaches the engine (the front end's work)
    arrival_per_token: float = 0.0  # engine stall when a text prompt arrives (added to the next step)
    frontend_per_id: float = 0.0  # the same two for a prompt given as token ids (no tokenizer on
    arrival_per_id: float = 0.0  # the way; what remains is parsing, hashing and bookkeeping)
    mixed_floor: float = 0.0
    graph_tokens: float = 0.0
    eager: float = 0.0
    eager_tail: float = 0.0
    eager_tail_s: float = 0.0
    graph_per_prefill_token: float = 0.0

    def step_seconds(self, decode_contexts: list[int], chunks: list[tuple[int, int]]) -> float:
        """``chunks``: (tokens, context before the chunk) for each prompt chunk."""
        t = self.base + self.per_decode_row * max(0, len(decode_contexts) - 1) + self.decode_kv * sum(decode_contexts)
        eager = self.eager_step(len(decode_contexts) + sum(n for n, _ in chunks))
        per_token = self.graph_per_prefill_token if self.graph_per_prefill_token and not eager \
            else self.per_prefill_token
        if chunks:
            t += self.mixed
            for n, start in chunks:
                t += per_token * n + self.attention * n * (start + n / 2)
            t = max(t, self.base + self.mixed_floor)
        if eager:
            t += self.eager
        return t

    def eager_step(self, tokens: int) -> bool:
        """Does a step of ``tokens`` (decode rows and prompt tokens) run past the CUDA graphs?"""
        return bool(self.graph_tokens) and tokens > self.graph_tokens

    def scaled(self, factor: float) -> "CostModel":
        return CostModel(self.base * factor, self.mixed * factor, self.per_decode_row * factor,
                         self.per_prefill_token * factor, self.attention * factor, self.decode_kv * factor,
                         self.jitter, self.frontend_per_token * factor, self.arrival_per_token * factor,
                         self.frontend_per_id * factor, self.arrival_per_id * factor, self.mixed_floor * factor,
                         self.graph_tokens, self.eager * factor, self.eager_tail, self.eager_tail_s * factor,
                         self.graph_per_prefill_token * factor)


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0  # 0: no per-request cap
    pacing_cap: int = 0  # engine_patches' cap mode: prefill tokens per step while decoding (0: off)
    pacing_short_tokens: int = 1024  # ... and its short-first rule (0: arrival order)
    pacing_long_min_share: float = 0.5
    pacing_sub_block: bool = False  # ... and in align mode, chunks that end inside a block while capped
    pacing_short_when_idle: bool = False  # ... and with nothing decoding, a short prompt beside a long one caps too
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_cache_blocks: int = 1 << 16
    # Hybrid models in prefix caching's align mode: a chunk that does not finish its prompt
    # ends on a block boundary (vLLM's _mamba_block_aligned_split; one that starts inside a
    # block stops at the next boundary); none fits: the prompt waits a step.
    align_chunks: bool = False


@dataclass(eq=False)
class SimRequest:
    prompt: list[int]
    max_tokens: int
    id: int = 0
    num_computed: int = 0
    num_cached: int = 0
    num_output: int = 0
    finished: bool = False
    aborted: bool = False
    events: asyncio.Queue | None = None  # token indices (int), then None at the end
    arrived: float = 0.0  # time.monotonic() when added; token timing for /metrics
    last_token_at: float = 0.0
    block_hashes: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def context(self) -> int:
        return self.num_computed + self.num_output


@dataclass
class StepPlan:
    decodes: list[SimRequest] = field(default_factory=list)
    chunks: list[tuple[SimRequest, int]] = field(default_factory=list)  # (request, prompt tokens this step)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.chunks)

    def summary(self) -> tuple[int, list[int]]:
        """(decode rows, prompt chunk sizes): what a test compares against."""
        return len(self.decodes), [n for _, n in self.chunks]


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a block's hash covers its prefix)."""
    out, h = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        out.append(h)
    return out


class PrefixCache:
    """Which full prompt blocks the engine still holds (LRU by block)."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def hit_blocks(self, hashes: list[int], touch: bool = True) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            if touch:
                self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Engine:
    def __init__(self, config: EngineConfig, cost: CostModel, seed: int = 0):
        self.config = config
        self.cost = cost
        self.rng = random.Random(seed)
        # The eager steps' tails draw from a stream of their own: the k-th eager step stalls or
        # not whatever else drew (jitter, rendered text) before it.
        self.tail_rng = random.Random(f"{seed}:eager-tail")
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.cache = PrefixCache(config.prefix_cache_blocks)
        self.steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count(1)
        self._wakeup: asyncio.Event | None = None
        self._stall = 0.0
        # Called as on_token(request, seconds since arrival or since the previous token,
        # first) for every emitted token; the server turns it into vLLM's histograms.
        self.on_token: Callable[[SimRequest, float, bool], None] | None = None

    # ------------------------------------------------------------------ intake
    def add(self, req: SimRequest, token_ids: bool = False) -> SimRequest:
        """``token_ids``: the prompt came as ids (its arrival costs the engine less)."""
        req.id = next(self._ids)
        req.arrived = time.monotonic()
        if self.config.enable_prefix_caching:
            req.block_hashes = block_hashes(req.prompt, self.config.block_size)
        self.waiting.append(req)
        # A long prompt's arrival stall (``CostModel.arrival_per_token``) is fitted on stock vLLM,
        # where the seed pair's stream shows one gap more than the prompt has chunks: on the H200's
        # 8B, 32-59 ms before the first of four 8,192-token chunk steps (bench/results/h200/run1/
        # direct-8192.json, bench/results/mixed/h200/run-0976992/pair-direct-3.json); on the 27B
        # hybrid 146-153 ms before its chunk steps (bench/results/hybrid/h200/run-4031669/
        # direct-2048*.json; with prefix caching 17 whole blocks and a last step of 1,944 tokens).
        # The engine patches' paced runs show none: the 8B's stream kept its gaps at the paced
        # step, 15-16 ms at most, through the arrival (bench/results/mixed/h200/pairs/
        # pair-paced*.json, bench/results/graphs/h200/dense/pair-paced-graphs-*.json), and the
        # hybrid paced at 1,568 tokens gave 19 gaps for its 19 chunks, the first 104 ms
        # (run-4031669/paced-cap-1568.json; paced adaptively: 89 ms, paced-adaptive-60.json).
        # So a paced engine (``pacing_cap``) is charged no arrival stall.
        if not self.config.pacing_cap:
            self._stall += (self.cost.arrival_per_id if token_ids else self.cost.arrival_per_token) * req.prompt_len
        if self._wakeup is not None:
            self._wakeup.set()
        return req

    def abort(self, req: SimRequest) -> None:
        if req.finished:
            return
        req.aborted = req.finished = True
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- scheduling
    def _cap(self, remaining: int, budget: int, start: int = 0, capped: bool = False) -> int:
        """The chunk of a prompt with ``remaining`` tokens left from ``start``, in ``budget``."""
        cfg = self.config
        n = min(remaining, budget)
        if cfg.long_prefill_token_threshold > 0:
            n = min(n, cfg.long_prefill_token_threshold)
        if cfg.align_chunks and cfg.enable_prefix_caching:
            block = cfg.block_size
            prompt_len = start + remaining
            last = prompt_len - prompt_len % block  # the last boundary whose state is cached
            next_boundary = (start // block + 1) * block
            end = start + n
            if end < last:
                end = end // block * block
            stops = (next_boundary if start % block and next_boundary <= last else 0, last)
            end = min((s for s in stops if start < s < end), default=end)
            if end <= start and capped and cfg.pacing_sub_block and start < last:
                end = min(start + n, next_boundary)
            n = max(end - start, 0)
        return n

    def plan(self) -> StepPlan:
        """Choose this step's work; mutates only the waiting/running lists (admission)."""
        plan = StepPlan()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        for req in self.running:  # decodes first
            if not req.prefilling and budget > 0:
                plan.decodes.append(req)
                budget -= 1
        prefilling = [r for r in self.running if r.prefilling]
        long_ids: set[int] = set()
        long_budget = budget
        paced = bool((plan.decodes or self._short_beside_long(prefilling)) and cfg.pacing_cap > 0)
        if paced:  # a paced engine (engine_patches, cap)
            block = self._cap_block()
            cap = max(block, cfg.pacing_cap // block * block) if block else cfg.pacing_cap
            budget = long_budget = min(budget, cap)
            if cfg.pacing_short_tokens:
                prefilling, long_ids, long_budget = self._short_first(prefilling, budget)
        for req in prefilling:  # then running prompts (long ones clamped, as engine_patches)
            room = min(budget, long_budget) if req.id in long_ids else budget
            n = self._cap(req.prompt_len - req.num_computed, room, req.num_computed, paced) if room > 0 else 0
            if n > 0:
                plan.chunks.append((req, n))
                budget -= n
                if req.id in long_ids:
                    long_budget -= n
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            cached = 0
            if self.config.enable_prefix_caching:
                hit = self.cache.hit_blocks(req.block_hashes) * self.config.block_size
                cached = min(hit, req.prompt_len - 1)
            n = self._cap(req.prompt_len - cached, budget, cached, paced)
            if n == 0:
                break  # align mode: the budget does not reach a block boundary
            self.waiting.pop(0)
            if self.config.enable_prefix_caching:
                req.num_cached = req.num_computed = cached
            self.running.append(req)
            plan.chunks.append((req, n))
            budget -= n
        return plan

    def _short_beside_long(self, prefilling: list[SimRequest]) -> bool:
        """SHORT_WHEN_IDLE's condition, with nothing decoding: a long prompt prefills and a short
        one prefills or waits (with a running slot for it)."""
        cfg = self.config
        if not (cfg.pacing_short_when_idle and cfg.pacing_short_tokens):
            return False
        short = cfg.pacing_short_tokens
        if not any(self._remaining(r) > short for r in prefilling):
            return False
        slots = len(self.running) < cfg.max_num_seqs
        return (any(self._remaining(r) <= short for r in prefilling)
                or (slots and any(self._remaining(r) <= short for r in self.waiting[:256])))

    def _cap_block(self) -> int | None:
        """The unit of a paced step's cap: whole KV blocks in align mode, as engine_patches'
        Pacer, unless sub-block chunks are allowed."""
        cfg = self.config
        aligned = cfg.align_chunks and cfg.enable_prefix_caching and not cfg.pacing_sub_block
        return cfg.block_size if aligned else None

    def _remaining(self, req: SimRequest) -> int:
        if req.num_computed or not self.config.enable_prefix_caching:
            return req.prompt_len - req.num_computed
        hit = self.cache.hit_blocks(req.block_hashes, touch=False) * self.config.block_size
        return req.prompt_len - min(hit, req.prompt_len - 1)

    def _short_first(self, prefilling: list[SimRequest], cap: int) -> tuple[list[SimRequest], set[int], int]:
        """engine_patches' short-first rule in a capped step: long prompts first but clamped
        to what the short ones leave them (at least their share of the cap), then short
        running prompts; waiting short prompts move ahead of waiting long ones."""
        cfg = self.config
        left = {id(r): self._remaining(r) for r in prefilling + self.waiting[:256]}
        short = [r for r in prefilling if left[id(r)] <= cfg.pacing_short_tokens]
        long = [r for r in prefilling if left[id(r)] > cfg.pacing_short_tokens]
        slots = cfg.max_num_seqs - len(self.running)
        waiting_short = [r for r in self.waiting[:256] if left[id(r)] <= cfg.pacing_short_tokens][:slots]
        if not short and not waiting_short:
            return long, set(), cap
        if waiting_short:
            self.waiting[:256] = short_first_order(self.waiting[:256], {id(r) for r in waiting_short})
        demand = sum(left[id(r)] for r in short + waiting_short)
        block = self._cap_block()
        reserve = reserve_for_short(cap, demand, bool(long), cfg.pacing_long_min_share, block)
        allowance = max(block, (cap - reserve) // block * block) if block else cap - reserve
        return long + short, {r.id for r in long}, allowance

    def step_seconds(self, plan: StepPlan) -> float:
        t = self.cost.step_seconds([r.context for r in plan.decodes], [(n, r.num_computed) for r, n in plan.chunks])
        if self.cost.jitter:
            t *= math.exp(self.rng.gauss(0.0, self.cost.jitter))
        if self.cost.eager_tail and self.cost.eager_step(plan.num_tokens):
            if self.tail_rng.random() < self.cost.eager_tail:
                t += self.cost.eager_tail_s
        t += self._stall
        self._stall = 0.0
        return t

    def apply(self, plan: StepPlan) -> list[SimRequest]:
        """The step ran: advance requests, emit tokens; returns the requests that finished."""
        self.steps += 1
        done = []
        for req in plan.decodes:
            if not req.finished:
                self._emit(req, done)
        for req, n in plan.chunks:
            if req.finished:
                continue
            req.num_computed += n
            self.prompt_tokens_total += n
            if self.config.enable_prefix_caching:
                self.cache.insert(req.block_hashes[: req.num_computed // self.config.block_size])
            if not req.prefilling:  # the last chunk samples the first token
                self._emit(req, done)
        for req in done:
            self.running.remove(req)
        return done

    def _emit(self, req: SimRequest, done: list[SimRequest]) -> None:
        if self.on_token is not None:
            now = time.monotonic()
            first = req.num_output == 0
            self.on_token(req, now - (req.arrived if first else req.last_token_at), first)
            req.last_token_at = now
        req.num_output += 1
        self.generation_tokens_total += 1
        if req.events is not None:
            req.events.put_nowait(req.num_output)
        if req.num_output >= req.max_tokens:
            req.finished = True
            if req.events is not None:
                req.events.put_nowait(None)
            done.append(req)

    # --------------------------------------------------------------------- loop
    async def run(self) -> None:
        """Step while there is work; sleep on an event otherwise. Steps are paced on the
        loop clock so that time spent relaying tokens does not stretch the model."""
        loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        next_at = loop.time()
        while True:
            if not self.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                next_at = loop.time()
            plan = self.plan()
            if plan.num_tokens == 0:  # e.g. max_num_seqs reached with nothing to do
                await asyncio.sleep(0.001)
                continue
            next_at = max(next_at, loop.time() - 0.05) + self.step_seconds(plan)
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            self.apply(plan)
