"""Sliced prefill: warm the upstream's prefix cache with growing prefixes of a prompt.

vLLM caches a prompt's KV blocks (automatic prefix caching) and a later prompt that
starts with the same token ids computes only what follows them. So a long prompt can be
prefilled next to live streams as a series of small requests over growing, block-aligned
prefixes of its exact token ids (``/v1/completions``, ``max_tokens: 1``), one at a time,
each a short engine step for the streams; then the client's own request, unchanged,
finds all but the tail cached. Correctness never depends on it: a prefix the engine did
not keep only costs the final request its prefill again (and shows in
``prefill_gate_slice_cache_miss_tokens_total``).

The token ids come from the upstream's ``/tokenize``, asked with everything vLLM's chat
endpoint renders the prompt with; a request carrying what ``/tokenize`` cannot express
(images, ``truncate_prompt_tokens``, ``tool_choice: none``...) or asking for
``prompt_logprobs`` (which bypasses the cache) is not sliceable and is held instead.

Slice sizes follow the protected streams: the largest gap a protected stream on that
upstream saw while each slice ran feeds a cost model of slices there (per token, and per
token of context), and each slice is the largest predicted to keep the streams within
``slice_gap_ms`` and, by the model's recent errors, within ``max_gap_ms``; within
``[min_slice_tokens, max_slice_tokens]``, in whole KV blocks (``SliceSizer``). A slice
waits (at most ``slice_settle_ms``) until no other request on its upstream is prefilling:
an interactive prompt's prefill in the same engine step would add its cost to the slice's
in the streams' gap, and the slice would delay that request's first token.

With ``slice_inflight`` 2, the next slice is sent while one runs, half a round trip after
it: vLLM caches a request's KV blocks when it schedules them, so a slice arriving while the
previous one computes finds its prefix cached in the very next step, and the engine's
intake of one slice (parsing the ids, hashing every block: ~12 ms plus ~1 us a token on
the H200) runs under the other's step instead of between steps. Slices meeting in one step
by mistake are still correct (each layer writes the step's KV before attending).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence

from prefill_gate.engine_patches.cost_model import solve_augmented

# A slice's own answer is one token of JSON: anything longer is not vLLM.
MAX_SLICE_ANSWER_BYTES = 64 * 1024


def tokenize_payload(body: dict, endpoint: str) -> dict | None:
    """The ``/tokenize`` request that renders this request's prompt as vLLM 0.26 would
    (chat: the same template arguments, merged the same way), ``{"ids": [...]}`` for a
    token-id prompt, or None when the request cannot be sliced faithfully."""
    if body.get("prompt_logprobs") or body.get("truncate_prompt_tokens") is not None:
        return None  # prompt logprobs bypass the prefix cache; truncation changes the prompt
    if body.get("mm_processor_kwargs") or body.get("media_io_kwargs"):
        return None
    model = body.get("model")
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return {"ids": prompt}
        if isinstance(prompt, str):
            return {"model": model, "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        return None  # batches of prompts
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(_text_only(m) for m in messages):
        return None
    if body.get("tools") and body.get("tool_choice") == "none":
        return None  # the server may render without tools (exclude_tools_when_tool_choice_none)
    payload: dict[str, Any] = {
        "model": model, "messages": messages,
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "add_special_tokens": body.get("add_special_tokens", False),
    }
    for key in ("chat_template", "tools"):
        if body.get(key) is not None:
            payload[key] = body[key]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    # What the chat endpoint adds to the template's arguments and /tokenize does not take.
    if body.get("documents") is not None:
        kwargs["documents"] = body["documents"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort != "auto":
            kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in (body.get("chat_template_kwargs") or {}):
            kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        payload["chat_template_kwargs"] = kwargs
    return payload


def _text_only(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if isinstance(content, list):
        return all(isinstance(p, dict) and p.get("type", "text") == "text" for p in content)
    return content is None or isinstance(content, str)


class IdPrefixes:
    """One JSON encoding of the ids, cut at block boundaries: a slice's ``prompt`` costs a
    slice of bytes, not an encoding of its whole prefix."""

    def __init__(self, ids: Sequence[int], block: int):
        self.n = len(ids)
        self.block = block
        text = ",".join(map(str, ids))
        self._text = text.encode()
        self._ends = []  # byte offset after each whole block's last id
        pos = 0
        for i, tok in enumerate(ids):
            pos += len(str(tok)) + (1 if i else 0)
            if (i + 1) % block == 0:
                self._ends.append(pos)

    def json(self, tokens: int) -> bytes:
        """``[id, ...]`` of the first ``tokens`` ids (a multiple of the block)."""
        return b"[" + self._text[: self._ends[tokens // self.block - 1]] + b"]"


# The cost model: how many recent slices it is fitted to, how much less each older one
# weighs, how many it needs before it sizes slices, and which quantile of its recent errors
# it keeps as a margin below ``max_gap``.
COST_KEPT = 64
COST_DECAY = 0.97
COST_MIN_SLICES = 8
COST_TAIL_QUANTILE = 0.97
# A size no larger than this many times the largest slice the model was fitted to: it
# extrapolates only so far.
COST_EXTRAPOLATE = 1.5
# Gross breaks: a slice whose protected gap passed BREAK_FACTOR x the promise is a tail the
# cost model's margin cannot price (seen on an H100 host: 1.2% of slices at 95-120 ms where the
# same size cost 25-40 ms before and after, all of them eager steps past vLLM's 512-token CUDA
# graph; none below it). Where, among the last BREAK_MEMORY slices, the slices larger than some
# size broke at least BREAK_EVIDENCE times and more often than BREAK_SHARE of them, while the
# slices up to that size did not, slices stay at or below it (``SliceSizer.ceiling``), fitted
# to those slices alone, until the breaks leave the memory.
BREAK_FACTOR = 1.5
BREAK_MEMORY = 1024
BREAK_EVIDENCE = 2
BREAK_SHARE = 0.01
BREAK_CUT = 0.9
# A step in the engine's cost: vLLM replays a CUDA graph for a step within its largest
# captured size (512 tokens by default) and runs a larger one eagerly, so on the H200 a
# 496-token slice cost the streams ~14-18 ms and a 512-640-token one ~40-50 ms. Slices whose
# gaps all stay under STEP_RATIO of what one line through every slice predicts for them (where
# no line fits: of the median gap of the slices just above them, at most STEP_SPAN times their
# size) ran below such a step (``find_step``).
STEP_RATIO = 0.6
STEP_SPAN = 1.5


@dataclass(frozen=True)
class CostFit:
    """``gap = a + b*n + c*n*(p + n/2)`` in seconds: the largest protected gap while a slice
    of ``n`` new tokens after a cached prefix of ``p`` runs (a step's fixed part, the slice's
    per-token work, its attention over the context: ``n`` tokens at a mean context of
    ``p + n/2``). ``margin``: the recent errors' high quantile (seconds, >= 0).

    Where the slices show a step in the engine's cost (``find_step``), the line is fitted to
    the slices above it and holds for sizes above ``step_at``; ``step_gap`` is what slices of
    at most ``step_at`` tokens cost."""

    a: float
    b: float
    c: float
    margin: float
    largest: int  # the largest slice among the fitted ones
    step_at: int = 0  # slices of at most this many tokens ran below a step in the cost (0: none seen)
    step_gap: float = 0.0  # their largest gap, seconds

    def gap(self, n: int, p: int) -> float:
        return self.a + self.b * n + self.c * n * (p + n / 2)

    def tokens_within(self, aim_s: float, p: int) -> float:
        """The (real) slice size whose predicted gap is ``aim_s`` at prefix ``p`` (0 if even
        one token is predicted over it)."""
        room = aim_s - self.a
        if room <= 0:
            return 0.0
        slope = self.b + self.c * p  # the quadratic c/2 n^2 + slope n - room = 0, for n >= 0
        if self.c <= 0:
            return room / slope if slope > 0 else 0.0
        return 2 * room / (slope + (slope * slope + 2 * self.c * room) ** 0.5)


def find_step(obs: Sequence[tuple[int, int, float]], line: CostFit | None = None) -> tuple[int, float]:
    """``(step_at, step_gap)``: the largest size ``t`` at which the engine's cost steps up,
    and the largest gap of the slices of at most ``t`` tokens; ``(0, 0.0)`` when the slices
    show no step. The slices of at most ``t`` tokens must all cost less than ``STEP_RATIO``
    of: what ``line`` (one line fitted to every slice) predicts for each, or, where no line
    fits, the median gap of the slices of ``t`` to ``STEP_SPAN * t`` tokens after no longer a
    prefix. A smooth cost cannot pass: a line explains it, slices deeper into a prompt
    included."""
    sizes = sorted({n for n, _, _ in obs})
    for t in reversed(sizes[:-1]):
        below = [(n, p, g) for n, p, g in obs if n <= t]
        if line is not None:
            cheap = all(g < STEP_RATIO * line.gap(n, p) for n, p, g in below)
        else:
            deepest = max(p for _, p, _ in below)
            above = sorted(g for n, p, g in obs if t < n <= STEP_SPAN * t and p <= deepest)
            cheap = bool(above) and max(g for _, _, g in below) < STEP_RATIO * above[len(above) // 2]
        if cheap:
            return t, max(g for _, _, g in below)
    return 0, 0.0


def fit_cost(obs: Sequence[tuple[int, int, float]], decay: float = COST_DECAY,
             tail_quantile: float = COST_TAIL_QUANTILE) -> CostFit | None:
    """Weighted least squares of ``CostFit``'s model over ``(n, p, gap_s)`` observations,
    oldest first (weight ``decay ** age``). A model whose gap would not grow with ``n`` is
    refitted without its offending term. None when no fit explains the data as a step
    would: too few slices, all of one size at one prefix, or a negative fixed part.

    The engine's cost is not one line: a step within its largest CUDA graph (vLLM: 512
    tokens) replays the graph and one just over it does not (on the H200, ~16 ms for 496
    new tokens beside 12 streams, ~40 ms for 512). One line through both clusters has a
    negative fixed part, or puts the difference on the context term with errors that become
    a margin as large as the step itself, and then calls every slice too dear (seen on the
    H200: a proxy's first prompt sliced at the smallest size, 3.6 s for 28.6k tokens against
    1.6 s once the model held). So the slices below a step (``find_step``) are kept out of the
    line and summed up by ``step_at`` and ``step_gap``."""
    line = _fit_line(obs, decay, tail_quantile)
    step_at, step_gap = find_step(obs, line)
    if not step_at:
        return line
    fit = _fit_line([o for o in obs if o[0] > step_at], decay, tail_quantile)
    if fit is None:
        return None
    return replace(fit, largest=max(n for n, _, _ in obs), step_at=step_at, step_gap=step_gap)


def _fit_line(obs: Sequence[tuple[int, int, float]], decay: float, tail_quantile: float) -> CostFit | None:
    if len(obs) < 2:
        return None
    rows = [(decay ** age, (1.0, n / 1e3, n * (p + n / 2) / 1e7), gap)  # features of similar magnitudes
            for age, (n, p, gap) in enumerate(reversed(obs))]
    best = None
    for terms in ((0, 1, 2), (0, 2), (0, 1)):
        coef = _weighted_lstsq(rows, terms)
        if coef is None:
            continue
        full = [0.0, 0.0, 0.0]
        for t, v in zip(terms, coef):
            full[t] = v
        if full[1] < 0 or full[2] < 0 or full[1] + full[2] <= 0 or full[0] < 0:
            continue  # the gap must grow with the slice, from a fixed part of at least 0
        sse = sum(w * (gap - sum(f * x for f, x in zip(full, xs))) ** 2 for w, xs, gap in rows)
        if best is None or sse < best[0] - 1e-12:
            best = (sse, full)
        if terms == (0, 1, 2):
            break  # the full model holds: the nested ones can only fit worse
    if best is None:
        return None
    fit = CostFit(best[1][0], best[1][1] / 1e3, best[1][2] / 1e7, 0.0, max(n for n, _, _ in obs))
    errors = sorted(gap - fit.gap(n, p) for n, p, gap in obs)
    margin = max(0.0, errors[int(tail_quantile * (len(errors) - 1))])  # of 64 slices: the third largest
    return replace(fit, margin=margin)


def _weighted_lstsq(rows, terms) -> list[float] | None:
    """Solve the normal equations of a weighted least squares restricted to ``terms``;
    None when singular."""
    k = len(terms)
    m = [[0.0] * (k + 1) for _ in range(k)]
    for w, xs, y in rows:
        sel = [xs[t] for t in terms]
        for i in range(k):
            wi = w * sel[i]
            for j in range(k):
                m[i][j] += wi * sel[j]
            m[i][k] += wi * y
    scale = max(m[i][i] for i in range(k))
    return solve_augmented(m, 1e-9 * scale) if scale > 0 else None


def _ceiling(breaks: Sequence[tuple[int, bool]]) -> int | None:
    """``SliceSizer.ceiling`` over ``(tokens, broke)`` records."""
    total, broke = len(breaks), sum(b for _, b in breaks)
    if broke < BREAK_EVIDENCE:
        return None
    per_size: dict[int, list[int]] = {}
    for n, b in breaks:
        counts = per_size.setdefault(n, [0, 0])
        counts[0] += 1
        counts[1] += b
    best, below_n, below_b = None, 0, 0
    for t in sorted(per_size):
        below_n += per_size[t][0]
        below_b += per_size[t][1]
        above_n, above_b = total - below_n, broke - below_b
        if above_b >= BREAK_EVIDENCE and above_b > BREAK_SHARE * above_n and below_b <= BREAK_SHARE * below_n:
            best = t
    if best is None:
        return None
    return min(best, int(BREAK_CUT * min(n for n, b in breaks if b)))


@dataclass
class SliceSizer:
    """Slice size per upstream, from what slices cost the protected streams there.

    Each slice a stream saw adds ``(tokens, prefix, largest gap)`` to a cost model
    (``fit_cost``); once it has ``COST_MIN_SLICES`` of them, a slice is the largest whose
    predicted gap at its own prefix stays within the aim: ``target_s``, and ``max_gap_s``
    less the model's recent errors' high quantile (the promise is about the worst gap, not
    the typical one). The model carries from one prompt to the next and knows that the
    same slice costs more deeper into a prompt, so early slices are large and late ones
    small from the start, with no overshoot while a size is found again. Where the engine's
    cost steps up past a size (its CUDA graphs), and no size above the step keeps the aim,
    a slice is the largest seen below the step, if those kept it. Where slices above some size
    stalled the streams grossly and repeatedly and those up to it did not (``ceiling``), slices
    stay at or below it, with the model fitted to those slices, until the breaks are forgotten.

    Until then (and whenever no fit grows with the slice), the size moves with each slice's
    gap, multiplicatively: at most 1.5x up or 2x down per slice, so a noisy gap cannot swing
    it. A slice no stream saw grows it 1.5x, unless ``hold_unwatched`` (slicing with nothing
    live, for arrivals' sake: a stream starting next must find slices still sized to the
    gap target)."""

    target_s: float
    min_tokens: int
    max_tokens: int
    tokens: int = 512
    hold_unwatched: bool = False
    max_gap_s: float | None = None
    history: list[tuple[int, int, float]] = field(default_factory=list)  # (tokens, prefix, gap_s)
    breaks: deque = field(default_factory=lambda: deque(maxlen=BREAK_MEMORY))  # (tokens, broke)
    _fit: CostFit | None = None
    _fit_ceiling: int | None = None  # the ceiling _fit was fitted under
    _ceiling: int | None = None
    _ceiling_stale: bool = False
    _stale: bool = False
    _unfit: int = 0  # slices since the last fit

    def model(self) -> CostFit | None:
        """The cost model, refitted after new slices (None until it has enough). When the
        recent slices admit no fit (``fit_cost``), the last fit stands, for at most
        ``COST_KEPT`` slices: data straddling the engine's graph step must not make the
        sizer forget what larger slices cost. Under a ``ceiling`` the model is fitted to the
        slices at or below it: the ones above broke the promise and would set the margin."""
        ceiling = self.ceiling()
        if ceiling != self._fit_ceiling:
            self._fit, self._fit_ceiling, self._unfit, self._stale = None, ceiling, 0, True
        if self._stale:
            obs = self.history if ceiling is None else [o for o in self.history if o[0] <= ceiling]
            fit = fit_cost(obs) if len(obs) >= COST_MIN_SLICES else None
            if fit is not None:
                self._fit, self._unfit = fit, 0
            else:
                self._unfit += 1
                if self._unfit > COST_KEPT:
                    self._fit = None
            self._stale = False
        return self._fit

    def ceiling(self) -> int | None:
        """The largest slice to send while recent slices above some size broke the promise
        grossly (``BREAK_FACTOR``), at least ``BREAK_EVIDENCE`` times and more often than
        ``BREAK_SHARE`` of them, and those up to it did not: that size, or ``BREAK_CUT`` of the
        smallest broken slice if lower (the breaks mark where the cost's tail starts only from
        above). None when the breaks show no such size: none, too few, or at every size alike,
        where smaller slices would not help."""
        if self._ceiling_stale:
            self._ceiling, self._ceiling_stale = _ceiling(self.breaks), False
        return self._ceiling

    def aim_s(self, fit: CostFit | None = None) -> float:
        if fit is None or self.max_gap_s is None:
            return self.target_s
        return min(self.target_s, self.max_gap_s - fit.margin)

    def size(self, block: int, prefix: int = 0) -> int:
        """The next slice, in whole blocks, at least ``min_tokens``; ``prefix``: the tokens
        already cached (where the slice starts)."""
        fit = self.model()
        if fit is not None:
            aim = self.aim_s(fit)
            want = min(fit.tokens_within(aim, prefix), COST_EXTRAPOLATE * fit.largest)
            if want <= fit.step_at and fit.step_gap <= aim:
                want = self._below_step(fit, block)  # no size above the step keeps the aim
            self.tokens = int(min(self.max_tokens, max(self.min_tokens, want)))
        ceiling = self.ceiling()
        if ceiling is not None:
            self.tokens = max(self.min_tokens, min(self.tokens, ceiling))
        lo = -(-self.min_tokens // block) * block
        return max(lo, min(self.tokens, self.max_tokens) // block * block)

    def _below_step(self, fit: CostFit, block: int) -> int:
        """The largest slice known to run below the engine's step, or, while the slices leave
        the step's place open (the smallest dearer slice is far above the largest cheap one),
        the middle of that bracket: a bisection, so the step is found to within a few blocks
        however low the sizer first fell (seen: slices of 512-624 tokens all just past vLLM's
        512-token graph, then the smallest size; the step found at 256 with nothing tried
        between 256 and 512, and 103 slices for 28.6k tokens). A probe that lands past the
        step costs about what the smallest dearer slice did, so one is sent only while that
        slice kept the promise (``max_gap_s``, else the target)."""
        above = min((n for n, _, _ in self.history if n > fit.step_at), default=0)
        if above - fit.step_at <= max(2 * block, fit.step_at // 8):
            return fit.step_at
        probe = (fit.step_at + above) // 2 // block * block
        promise = self.max_gap_s if self.max_gap_s is not None else self.target_s
        if probe <= fit.step_at or min(g for n, _, g in self.history if n == above) > promise:
            return fit.step_at
        return probe

    def after(self, max_gap_s: float | None, tokens: int | None = None, prefix: int = 0) -> None:
        """A slice of ``tokens`` after ``prefix`` cached ran; ``max_gap_s``: the largest
        protected gap meanwhile (None: no stream saw it)."""
        if max_gap_s is not None and tokens:
            self.history.append((tokens, prefix, max_gap_s))
            del self.history[:-COST_KEPT]
            promise = self.max_gap_s if self.max_gap_s is not None else self.target_s
            self.breaks.append((tokens, max_gap_s > BREAK_FACTOR * promise))
            self._ceiling_stale = True
            self._stale = True
        if max_gap_s is None:
            factor = 1.0 if self.hold_unwatched else 1.5
        else:
            factor = min(1.5, max(0.5, self.target_s / max(max_gap_s, 1e-4)))
        self.tokens = int(min(self.max_tokens, max(self.min_tokens, self.tokens * factor)))


@dataclass
class SliceRun:
    slices: int = 0
    tokens: int = 0  # the prefix length the slices covered
    seconds: float = 0.0
    stopped: str = ""  # why slicing ended before the last whole block ("" if it did not)
    settling_s: float = 0.0  # waited for other requests' prefills to end before slices
    gaps: list[float | None] = field(default_factory=list)  # each slice's largest protected gap (None: unseen)
    sizes: list[int] = field(default_factory=list)  # each slice's new tokens
    round_trips: list[float] = field(default_factory=list)  # each slice's time from sent to answered, seconds


SendSlice = Callable[[bytes], Awaitable[bool]]  # body -> whether the upstream answered 200


async def run_slices(ids: Sequence[int], block: int, sizer: SliceSizer, send: SendSlice, *,
                     model: str | None, cache_salt: str | None, deadline: float,
                     window: Callable[[], Any], window_end: Callable[[Any], Awaitable[float | None]],
                     settle: Callable[[], Awaitable[float]] | None = None, inflight: int = 1,
                     clock: Callable[[], float] = time.monotonic,
                     encode: Callable[[Sequence[int], int], Awaitable[IdPrefixes]] | None = None,
                     capped_inflight: int | None = None) -> SliceRun:
    """Send slices until the last whole block before the prompt's end is covered (the
    final request computes the rest, at least one token). ``settle()`` is awaited before
    each slice (other requests' prefills end first; it returns the seconds waited),
    ``window()`` opens a slice's gap window, ``window_end(w)`` closes it once the streams
    have shown the slice's gap and answers the largest one. Stops early at ``deadline`` or
    a failed slice.

    ``inflight`` > 1: up to that many slices at once, each sent at least a round trip /
    ``inflight`` after the previous (the last answered slice's round trip; the first slice
    goes alone), so that it reaches the engine once the previous one is scheduled.

    ``capped_inflight``: slices in flight (if more than ``inflight``) while the sizer keeps slices
    under a ceiling (``SliceSizer.ceiling``): such slices run small steps, and their round trips
    (the engine's intake of the whole prefix, the answer), not the steps, set the prompt's time.

    ``encode(ids, block)``: the prompt's ``IdPrefixes`` (a long prompt's ids take a while to
    encode: the proxy has a worker process do it, ``bodies.BodyReader.id_prefixes``)."""
    run = SliceRun()
    last = (len(ids) - 1) // block * block
    if last <= 0:
        return run
    prefixes = IdPrefixes(ids[:last], block) if encode is None else await encode(ids[:last], block)
    head = b'{"max_tokens":1,"temperature":0,"stream":false'
    if model is not None:
        head += b',"model":' + json.dumps(model).encode()
    if cache_salt is not None:
        head += b',"cache_salt":' + json.dumps(cache_salt).encode()
    pending: deque[tuple[asyncio.Future[bool], Any, int, float]] = deque()  # (answer, window, end, sent at)
    sent = 0  # the prefix the slices sent so far cover
    spacing = None  # seconds between two slices in flight (None: no slice answered yet)
    last_sent = -float("inf")
    start = clock()

    def limit() -> int:
        if capped_inflight is None or sizer.ceiling() is None:
            return inflight
        return max(inflight, capped_inflight)

    try:
        while True:
            if not run.stopped and sent < last and len(pending) < limit() and (spacing is not None or not pending):
                if clock() >= deadline:
                    run.stopped = "deadline"
                    continue
                if settle is not None:
                    run.settling_s += await settle()
                if pending:
                    await asyncio.sleep(max(0.0, last_sent + spacing - clock()))
                end = min(last, sent + sizer.size(block, sent))
                w = window()
                last_sent = clock()
                pending.append((asyncio.ensure_future(send(head + b',"prompt":' + prefixes.json(end) + b"}")),
                                w, end, last_sent))
                sent = end
                continue
            if not pending:
                break
            answer, w, end, sent_at = pending.popleft()
            ok = await answer
            round_trip = clock() - sent_at
            gap = await window_end(w)
            if not ok:
                run.stopped = "upstream_error"
                break  # the slices still in flight are cancelled: they follow a prefix not cached
            spacing = round_trip / limit()
            sizer.after(gap, end - run.tokens, run.tokens)
            run.gaps.append(gap)
            run.sizes.append(end - run.tokens)
            run.round_trips.append(round_trip)
            run.slices += 1
            run.tokens = end
    finally:
        for answer, _, _, _ in pending:
            answer.cancel()
        for answer, _, _, _ in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await answer
    run.seconds = clock() - start
    return run
