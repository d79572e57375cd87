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

Slice sizes follow the protected streams: after each slice the largest gap a protected
stream on that upstream saw while it ran moves the size toward ``slice_gap_ms``, within
``[min_slice_tokens, max_slice_tokens]``, in whole KV blocks (``SliceSizer``). A slice
waits (at most ``slice_settle_ms``) until no other request on its upstream is prefilling:
an interactive prompt's prefill in the same engine step would add its cost to the slice's
in the streams' gap, and the slice would delay that request's first token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

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


@dataclass
class SliceSizer:
    """Slice size per upstream, moved by the protected streams' gaps (multiplicative, at
    most 1.5x up or 2x down per slice, so a noisy gap cannot swing it). A slice no stream
    saw grows it 1.5x, unless ``hold_unwatched`` (slicing with nothing live, for arrivals'
    sake: a stream starting next must find slices still sized to the gap target)."""

    target_s: float
    min_tokens: int
    max_tokens: int
    tokens: int = 512
    hold_unwatched: bool = False

    def size(self, block: int) -> int:
        lo = -(-self.min_tokens // block) * block
        return max(lo, min(self.tokens, self.max_tokens) // block * block)

    def after(self, max_gap_s: float | None) -> None:
        """A slice ran; ``max_gap_s``: the largest protected gap meanwhile (None: no stream)."""
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


SendSlice = Callable[[bytes], Awaitable[bool]]  # body -> whether the upstream answered 200


async def run_slices(ids: Sequence[int], block: int, sizer: SliceSizer, send: SendSlice, *,
                     model: str | None, cache_salt: str | None, deadline: float,
                     window: Callable[[], None], window_end: Callable[[], Awaitable[float | None]],
                     settle: Callable[[], Awaitable[float]] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> SliceRun:
    """Send slices until the last whole block before the prompt's end is covered (the
    final request computes the rest, at least one token). ``settle()`` is awaited before
    each slice (other requests' prefills end first; it returns the seconds waited),
    ``window()`` starts a slice's gap window, ``window_end()`` closes it once the streams
    have shown the slice's gap and answers the largest one. Stops early at ``deadline`` or
    a failed slice."""
    run = SliceRun()
    last = (len(ids) - 1) // block * block
    if last <= 0:
        return run
    prefixes = IdPrefixes(ids[:last], block)
    head = b'{"max_tokens":1,"temperature":0,"stream":false'
    if model is not None:
        head += b',"model":' + json.dumps(model).encode()
    if cache_salt is not None:
        head += b',"cache_salt":' + json.dumps(cache_salt).encode()
    start = clock()
    while run.tokens < last:
        if clock() >= deadline:
            run.stopped = "deadline"
            break
        if settle is not None:
            run.settling_s += await settle()
        end = min(last, run.tokens + sizer.size(block))
        window()
        ok = await send(head + b',"prompt":' + prefixes.json(end) + b"}")
        if not ok:
            run.stopped = "upstream_error"
            break
        sizer.after(await window_end())
        run.slices += 1
        run.tokens = end
    run.seconds = clock() - start
    return run
