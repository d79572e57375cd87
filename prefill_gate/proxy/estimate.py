"""How many prompt tokens will the upstream have to prefill? Cheapest answer first.

1. ``Calibrator``: prompt bytes / bytes-per-token, the ratio learned per model from
   the ``usage.prompt_tokens`` of finished requests (a median over recent ones, robust
   to clients that skew it), plus a per-message template overhead. Costs one pass over the text's length.
2. An exact counter, used only when the cheap estimate lands near the threshold
   (within ``band`` of it), so a 100k-character prompt far above the threshold is
   never tokenized on the hot path: ``TokenizerJsonCounter`` (HF ``tokenizers``),
   ``TiktokenCounter``, or the upstream's ``/tokenize`` through an injected callable.
3. Token-id prompts (``/v1/completions`` with ``prompt: [ids]``) are counted exactly.

Nothing here does network I/O itself: the upstream counter is a function the app passes in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

log = logging.getLogger("prefill_gate.estimate")

MESSAGE_OVERHEAD_TOKENS = 8  # role markers and separators a chat template adds per message
MIN_CALIBRATION_BYTES = 256  # tiny prompts are mostly template: they would skew the ratio


@dataclass(frozen=True)
class PromptShape:
    """What the estimator reads off a request body."""

    text: str  # all prompt text (message contents, tool schemas) joined
    n_messages: int  # chat messages (0 for completions)
    token_ids: int | None = None  # exact count when the prompt is token ids
    messages: list | None = None  # for the upstream's /tokenize
    prompt: Any = None
    # Where the body was read in a worker (bodies.py) and the structures stayed there:
    # count_request's JSON, and the text's size where no counter reads the text itself.
    tokenize_json: bytes | None = None
    size: int | None = None

    @property
    def n_bytes(self) -> int:
        return self.size if self.size is not None else len(self.text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Estimate:
    tokens: int  # estimated prompt tokens the upstream must prefill (the uncached tail)
    method: str  # "calibrated" | "exact" | "token_ids"
    n_bytes: int
    n_messages: int
    cached: int = 0  # tokens credited to the upstream's prefix cache

    @property
    def total(self) -> int:
        return self.tokens + self.cached


def _content_text(content: Any, parts: list[str]) -> None:
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for item in content:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                parts.append(item["text"])
            elif isinstance(item, str):
                parts.append(item)


def shape_of(body: dict, endpoint: str) -> PromptShape:
    """Read the prompt out of a validated chat or completions body."""
    parts: list[str] = []
    if endpoint == "chat":
        messages = body.get("messages") or []
        for m in messages:
            if isinstance(m, dict):
                _content_text(m.get("content"), parts)
                if m.get("tool_calls"):
                    parts.append(json.dumps(m["tool_calls"]))
        if body.get("tools"):
            parts.append(json.dumps(body["tools"]))
        return PromptShape("\n".join(parts), len(messages), messages=messages)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return PromptShape("", 0, token_ids=len(prompt), prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
        return PromptShape("", 0, token_ids=sum(len(x) for x in prompt), prompt=prompt)
    _content_text(prompt, parts)
    return PromptShape("\n".join(parts), 0, prompt=prompt)


def message_bytes(messages: list) -> list[int]:
    """Each chat message's text, in UTF-8 bytes (what the estimate of its tokens reads)."""
    out = []
    for m in messages:
        parts: list[str] = []
        if isinstance(m, dict):
            _content_text(m.get("content"), parts)
        out.append(sum(len(p.encode("utf-8", "surrogatepass")) for p in parts))
    return out


class Calibrator:
    """Bytes-per-token ratio per model, learned from reported usage.

    Reported usage comes from whatever clients send, so it is learned robustly: each
    request's ratio is clamped to what text can have (``RATIO_BOUNDS``), and the ratio used
    is the median of a model's last ``WINDOW`` samples (``initial`` until ``MIN_SAMPLES``):
    a few prompts written to skew it (all emoji, say) cannot move it while they are a
    minority. Models are remembered up to ``MAX_MODELS`` (the least recently seen go): the
    model name is the client's to choose."""

    WINDOW = 32
    MIN_SAMPLES = 4
    RATIO_BOUNDS = (0.5, 8.0)
    MAX_MODELS = 256

    def __init__(self, initial: float = 4.0, overhead: int = MESSAGE_OVERHEAD_TOKENS):
        self.initial = initial
        self.overhead = overhead
        self._samples: OrderedDict[str, deque[float]] = OrderedDict()
        self._ratio: dict[str, float] = {}

    def ratio(self, model: str) -> float:
        return self._ratio.get(model, self.initial)

    def estimate(self, model: str, n_bytes: int, n_messages: int) -> int:
        return int(n_bytes / self.ratio(model)) + self.overhead * n_messages

    def observe(self, model: str, n_bytes: int, n_messages: int, prompt_tokens: int) -> None:
        if n_bytes < MIN_CALIBRATION_BYTES:
            return
        text_tokens = prompt_tokens - self.overhead * n_messages
        if text_tokens <= 0:
            return
        lo, hi = self.RATIO_BOUNDS
        sample = min(hi, max(lo, n_bytes / text_tokens))
        samples = self._samples.get(model)
        if samples is None:
            samples = self._samples[model] = deque(maxlen=self.WINDOW)
            while len(self._samples) > self.MAX_MODELS:
                old, _ = self._samples.popitem(last=False)
                self._ratio.pop(old, None)
        self._samples.move_to_end(model)
        samples.append(sample)
        if len(samples) >= self.MIN_SAMPLES:
            self._ratio[model] = statistics.median(samples)


class ExactCounter(Protocol):
    async def count(self, shape: PromptShape, model: str) -> int: ...


class _LocalCounter:
    """Counts the text with a local tokenizer, in a worker thread (never on the event loop)."""

    def _encode_len(self, text: str) -> int:
        raise NotImplementedError

    async def count(self, shape: PromptShape, model: str) -> int:
        n = await asyncio.to_thread(self._encode_len, shape.text)
        return n + MESSAGE_OVERHEAD_TOKENS * shape.n_messages


class TokenizerJsonCounter(_LocalCounter):
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)

    def _encode_len(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


class TiktokenCounter(_LocalCounter):
    def __init__(self, encoding: "str | Any"):
        import tiktoken

        self._enc = tiktoken.get_encoding(encoding) if isinstance(encoding, str) else encoding

    def _encode_len(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))


def count_request(shape: PromptShape, model: str) -> dict:
    """The upstream ``/tokenize`` request that counts this prompt, chat template included."""
    req: dict[str, Any] = {"model": model}
    if shape.messages is not None:
        req["messages"] = shape.messages
    else:
        req["prompt"] = shape.prompt if isinstance(shape.prompt, str) else shape.text
    return req


class UpstreamTokenizeCounter:
    """Asks the upstream's ``/tokenize`` (vLLM): exact, chat template included."""

    def __init__(self, post_tokenize: Callable[[dict | bytes], Awaitable[dict]]):
        self._post = post_tokenize

    async def count(self, shape: PromptShape, model: str) -> int:
        # (Read in a worker, the body's request came back encoded: count_request's JSON.)
        data = await self._post(shape.tokenize_json if shape.tokenize_json is not None else count_request(shape, model))
        count = data.get("count")
        if not isinstance(count, int):
            raise ValueError("upstream /tokenize answered without an integer 'count'")
        return count


class Estimator:
    def __init__(
        self,
        threshold: int,
        calibrator: Calibrator | None = None,
        exact: ExactCounter | None = None,
        band: float = 0.5,
    ):
        self.threshold = threshold
        self.calibrator = calibrator or Calibrator()
        self.exact = exact
        self.band = band

    def near_threshold(self, tokens: int) -> bool:
        return abs(tokens - self.threshold) <= self.band * self.threshold

    async def estimate(self, shape: PromptShape, model: str, cached: int = 0) -> Estimate:
        """``cached``: tokens of this prompt the upstream probably holds already; the
        estimate (and the threshold test for an exact count) is about the rest."""
        if shape.token_ids is not None:
            return Estimate(shape.token_ids, "token_ids", 0, 0)
        n_bytes = shape.n_bytes
        cheap = self.calibrator.estimate(model, n_bytes, shape.n_messages)
        cached = min(cached, cheap)
        if self.exact is not None and self.near_threshold(cheap - cached):
            try:
                exact = await self.exact.count(shape, model)
                cached = min(cached, exact)
                return Estimate(exact - cached, "exact", n_bytes, shape.n_messages, cached)
            except Exception as exc:  # an exact count refines the estimate; it must not fail the request
                log.warning("exact token count failed (%s: %s); using the calibrated estimate", type(exc).__name__, exc)
        return Estimate(cheap - cached, "calibrated", n_bytes, shape.n_messages, cached)

    def prefix_tokens(self, message_bytes: list[int], model: str) -> list[int]:
        """Cumulative estimated tokens of each message-list prefix (for the prefix memory),
        from each message's text bytes (``message_bytes``)."""
        out, total = [], 0
        for n in message_bytes:
            total += self.calibrator.estimate(model, n, 1)
            out.append(total)
        return out

    def observe(self, model: str, est: Estimate, prompt_tokens: int) -> float | None:
        """Learn from a finished request's usage; returns the relative error of the estimate."""
        if prompt_tokens <= 0:
            return None
        if est.method != "token_ids":
            self.calibrator.observe(model, est.n_bytes, est.n_messages, prompt_tokens)
        return abs(est.total - prompt_tokens) / prompt_tokens
