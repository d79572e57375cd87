"""Reading a request body: what the gate needs of it, and off the event loop when it is big.

Everything ``prepare`` needs of a chat or completions body (its bounds checked, the prompt's
shape, the prefix hashes, the bytes to send upstream) is one pure function, ``read``. The
event loop relays every live stream, and each of them waits while it parses: a megabyte of
agent context held every stream about 20 ms on the H200 host, a body of 150,000 JSON
containers (under the 200,000 bound) half a second (``bench/big_bodies.py``, docs/results/proxy-cost.md
3f). A thread would not help: json.loads holds the GIL from start to end. So ``BodyReader``
reads a body of ``offload_body_bytes`` or more in a worker process, and the loop pays for a
copy of the bytes each way. What comes back is never the parsed body (unpickling it would
cost the loop about what parsing did) but the facts, and the JSON the rarer paths send
upstream, encoded in the worker: the slicer's ``/tokenize`` request and, with
``upstream_tokenize``, the exact count's. The same workers read a long prompt's
``/tokenize`` answer (its ids), encode them for its slices, and find the usage in a big
non-streaming answer.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, Sequence

from .assemble import convertible
from .errors import BadRequest
from .estimate import PromptShape, count_request, message_bytes, shape_of
from .prefix_memory import prefix_hashes
from .slicer import IdPrefixes, tokenize_payload

log = logging.getLogger("prefill_gate")

USAGE_MEMBER = b'"stream_options":{"include_usage":true}'
ID_BYTES = 6  # about what a token id costs in JSON, for offload_bytes


@dataclass(frozen=True)
class BodyOptions:
    """What reading a body depends on besides its bytes (from the settings)."""

    endpoint: str  # "chat" | "completions"
    max_messages: int = 4096
    max_containers: int = 200_000
    max_depth: int = 128
    protect_non_streaming: bool = False
    slicing: bool = False  # the slicer's /tokenize request is wanted (for a large prefill)
    upstream_tokenize: bool = False  # exact counts come from the upstream's /tokenize
    local_count: bool = False  # exact counts come from a local tokenizer (it reads the text)


@dataclass
class RequestBody:
    """What the gate needs of one request body."""

    content: bytes | None  # what goes upstream: the client's bytes, or them with include_usage asked for
    model: str
    salt: str | None  # cache_salt
    streaming: bool
    assemble: bool  # the client wants JSON; the proxy streams upstream to see the phase
    drop_usage: bool  # include_usage was asked on the client's behalf: its chunk is not relayed
    shape: PromptShape
    prefixes: list[bytes] | None  # chat: hashes of the message-list prefixes
    message_bytes: list[int] | None  # and each message's text bytes (their estimated tokens)
    priority: int
    max_tokens: int | None
    # The slicer's /tokenize request: a dict ({"ids": [...]} for a token-id prompt), or its
    # JSON where the body was read in a worker; None when the request cannot be sliced.
    tokenize: dict | bytes | None
    # From a worker, ``content`` is None where it is the client's bytes ("as sent") or them
    # with include_usage appended ("usage appended"): the reader has the bytes, and rebuilds it
    # rather than have a megabyte carried back.
    content_from_raw: str | None = None


def read(raw: bytes, opts: BodyOptions, *, encoded: bool = False) -> RequestBody:
    """The body's facts, or a BadRequest. Whatever it holds: text no encoder takes (a lone
    surrogate) or nesting past Python's recursion limit becomes a 400, not a 500. With
    ``encoded`` (the worker's answer), the parsed structures are left behind: the JSON the
    upstream will be sent of them is encoded here instead."""
    try:
        return _read(raw, opts, encoded)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except UnicodeError as exc:
        raise BadRequest(f"request body holds text that is not valid Unicode: {exc.reason}") from None


def _read(raw: bytes, opts: BodyOptions, encoded: bool) -> RequestBody:
    endpoint = opts.endpoint
    body = parse_body(raw, endpoint, opts.max_messages, opts.max_containers, opts.max_depth)
    model = body.get("model") or ""
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    prefixes = prefix_hashes(body["messages"], salt) if endpoint == "chat" else None
    shape = shape_of(body, endpoint)
    streaming = bool(body.get("stream"))
    assemble = not streaming and opts.protect_non_streaming and convertible(body)
    drop_usage = False
    content, from_raw = raw, "as sent"  # from_raw: how ``content`` follows from the client's bytes
    if assemble:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        content, from_raw = json.dumps(body).encode(), None
    elif streaming and not (body.get("stream_options") or {}).get("include_usage"):
        drop_usage = True
        slot = _member_slot(raw) if "stream_options" not in body else None
        if slot is not None:
            content, from_raw = None if encoded else _appended(raw, slot, USAGE_MEMBER), "usage appended"
        else:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            content, from_raw = json.dumps(body).encode(), None
    tokenize = tokenize_payload(body, endpoint) if opts.slicing else None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if encoded:  # for the trip back: what the reader needs, no more
        count = None
        if shape.messages is not None and opts.upstream_tokenize:
            count = json.dumps(count_request(shape, model)).encode()
        keep_text = opts.local_count or opts.upstream_tokenize
        shape = replace(shape, messages=None, tokenize_json=count, size=shape.n_bytes,
                        text=shape.text if keep_text else "", prompt=shape.prompt if opts.upstream_tokenize else None)
        if from_raw is not None:  # the reader rebuilds it from the bytes it sent
            content = None
        if tokenize is not None and "ids" in tokenize:
            try:  # 8 bytes an id across the pipe and back, not a pickled int each
                tokenize = {"ids": array.array("q", tokenize["ids"])}
            except OverflowError:
                pass
        elif tokenize is not None:
            tokenize = json.dumps(tokenize).encode()  # (ASCII: a lone surrogate is escaped, as inline)
    return RequestBody(content, model, salt, streaming, assemble, drop_usage, shape, prefixes,
                       message_bytes(body["messages"]) if prefixes else None,
                       int(body.get("priority") or 0), max_tokens if isinstance(max_tokens, int) else None,
                       tokenize, from_raw if encoded else None)


def _read_in_worker(raw: bytes, opts: BodyOptions) -> tuple:
    """``read`` in a worker process: ("ok", RequestBody) or ("bad", message, param) (an
    exception's keyword arguments do not survive pickling)."""
    try:
        return "ok", read(raw, opts, encoded=True)
    except BadRequest as exc:
        return "bad", exc.message, exc.param


def token_ids_of(answer: bytes) -> array.array:
    """The ids of a ``/tokenize`` answer as a compact array (8 bytes an id, not a Python int's
    28: they are held while the request waits); ValueError when it holds none, OverflowError
    when one does not fit 64 bits."""
    try:
        parsed = json.loads(answer)
    except ValueError as exc:  # (a JSONDecodeError would carry the whole answer back from a worker)
        raise ValueError(f"an answer that is not JSON: {exc}") from None
    ids = parsed.get("tokens") if isinstance(parsed, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(x) is int for x in ids):
        raise ValueError("no 'tokens' list of integers in the answer")
    return array.array("q", ids)


def usage_of(answer: bytes) -> dict | None:
    """The ``usage`` of a whole (non-streaming) answer, or None."""
    try:
        usage = json.loads(answer).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def is_json(data: bytes) -> bool:
    """Whether ``data`` parses as JSON (in any of the encodings json.loads detects)."""
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _unpacked(answer: tuple, raw: bytes) -> RequestBody:
    """A worker's answer to ``_read_in_worker(raw, ...)``, with its content rebuilt from the
    bytes sent (a BadRequest raised)."""
    if answer[0] == "bad":
        raise BadRequest(answer[1], param=answer[2])
    body = answer[1]
    if body.content_from_raw == "as sent":
        body.content = raw
    elif body.content_from_raw == "usage appended":
        body.content = with_member(raw, USAGE_MEMBER)
    body.content_from_raw = None
    return body


PARENT_WATCH_S = 1.0  # how often a worker looks whether the proxy that started it is still there


def _watch_parent(parent: int) -> None:
    """A worker's initializer: end the worker once the proxy that started it is gone. A proxy
    that dies without shutting its pool down (SIGKILL, the OOM killer, or SIGTERM re-raised
    before the pool's thread told the workers) leaves workers blocked on their queue for ever,
    since each holds the queue's write end itself."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _ready() -> bool:
    """A worker's first task (``BodyReader.start``): answering it, the worker has imported
    this module and takes bodies at once."""
    return True


class _CannotStart(Exception):
    """This process may not start body reader processes."""


class BodyReader:
    """Reads request bodies (and the other big JSON of a request, below): under
    ``offload_bytes`` inline, the rest in ``workers`` worker processes (started by ``start``,
    which ``prefill-gate serve`` runs at its start, else with the first such body; 0: every
    body inline). A worker that dies (killed, out of memory) costs the
    request in it nothing: its work is done inline, and the next big body starts a fresh
    pool. Pools that break ``BREAKS_TO_PAUSE`` times in a row (workers that cannot start: a
    ``__main__`` that runs the server again when a spawned process imports it) pause the
    offload for ``PAUSE_S``: every body inline meanwhile, not a process started per request.
    Where no pool can be made at all (no working ``sem_open``), every body is read inline."""

    BREAKS_TO_PAUSE = 3
    PAUSE_S = 60.0

    def __init__(self, options: dict[str, BodyOptions], offload_bytes: int, workers: int,
                 clock=time.monotonic):
        self.options = options
        self.offload_bytes = offload_bytes
        self.workers = workers
        self.clock = clock
        self._pool: ProcessPoolExecutor | None = None
        self._breaks = 0  # pools broken since a worker last answered
        self._paused_until = -float("inf")

    async def start(self) -> None:
        """Starts the worker processes now and waits until each has answered once, so that the
        first big body finds them ready instead of waiting for a spawn (a fresh interpreter and
        this module's imports: a new proxy's first 110 KB request waited 134-177 ms for it on a
        2-core VM, bench/results/first-prompt.json; a 28.6k-token prompt ~0.2-0.3 s on an H100
        host). Run in the background at the
        proxy's start: a body that comes first queues behind the warm-up, no worse than before.
        A pool that cannot start is handled as for a body (logged once, bodies read inline)."""
        if self.workers > 0:
            await asyncio.gather(*(self._in_worker(_ready) for _ in range(self.workers)))

    def offloads(self, size: int) -> bool:
        return self.workers > 0 and size >= self.offload_bytes and self.clock() >= self._paused_until

    async def read(self, raw: bytes, endpoint: str) -> RequestBody:
        opts = self.options[endpoint]
        if not self.offloads(len(raw)):
            return read(raw, opts)
        return _unpacked(await self._in_worker(_read_in_worker, raw, opts), raw)

    async def token_ids(self, answer: bytes) -> array.array:
        """``token_ids_of`` a /tokenize answer, in a worker when it is big (a long prompt's ids)."""
        return await self._run(len(answer), token_ids_of, answer)

    async def usage(self, answer: bytes) -> dict | None:
        """``usage_of`` a whole answer, in a worker when it is big (many choices, logprobs)."""
        return await self._run(len(answer), usage_of, answer)

    async def is_json(self, data: bytes) -> bool:
        """``is_json(data)``, in a worker when it is big (an upstream's error body)."""
        return await self._run(len(data), is_json, data)

    async def encode(self, obj: Any, size: int) -> bytes:
        """``obj`` as JSON bytes, in a worker when ``size`` (what it was read from) is big: an
        answer the proxy assembled from a long stream would hold the loop, and every stream on
        it, while it is encoded (16 MB of text: 110-146 ms of json.dumps on the 2-core VM;
        pickling it to the worker 16-53 ms)."""
        return await self._run(size, json_bytes, obj)

    async def id_prefixes(self, ids: Sequence[int], block: int) -> IdPrefixes:
        """A slice run's ``IdPrefixes``, in a worker for a long prompt (250,000 ids took
        0.2 s to encode on the 2-core VM)."""
        if self.offloads(ID_BYTES * len(ids)) and not isinstance(ids, array.array):
            ids = array.array("q", ids)  # (8 bytes an id across the pipe)
        return await self._run(ID_BYTES * len(ids), IdPrefixes, ids, block)

    async def _run(self, size: int, fn, *args):
        """``fn(*args)``: inline for ``size`` under the bound, else in a worker."""
        if not self.offloads(size):
            return fn(*args)
        return await self._in_worker(fn, *args)

    async def _in_worker(self, fn, *args):
        if self._pool is None:
            try:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_watch_parent, initargs=(os.getpid(),))
            except (OSError, ImportError, NotImplementedError) as exc:  # (no working sem_open, say)
                log.error("no body reader processes here (%s: %s); reading every body on the event loop",
                          type(exc).__name__, exc)
                self.workers = 0
                return fn(*args)
        pool = self._pool
        try:
            answer = await self._submit(pool, fn, *args)
        except BrokenProcessPool:  # from the submit (a pool already broken) or from the work
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
                self._breaks += 1
                if self._breaks >= self.BREAKS_TO_PAUSE:
                    self._breaks = 0
                    self._paused_until = self.clock() + self.PAUSE_S
                    log.error("body reader processes broke %d times in a row; reading every body on the event "
                              "loop for %g s", self.BREAKS_TO_PAUSE, self.PAUSE_S)
            log.warning("a body reader process died; doing its work (%s) on the event loop", fn.__name__)
            return fn(*args)
        except _CannotStart as exc:
            log.error("body reader processes cannot start here (%s); reading every body on the event loop", exc)
            self._pool, self.workers = None, 0
            pool.shutdown(wait=False, cancel_futures=True)
            return fn(*args)
        self._breaks = 0
        return answer

    @staticmethod
    def _submit(pool: ProcessPoolExecutor, fn, *args) -> asyncio.Future:
        """``fn(*args)`` in the pool. Its processes start on a submit, and where this process may
        not make any (a daemonic process: AssertionError; fork failing: OSError) that is
        ``_CannotStart``, not the request's error."""
        try:
            return asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except BrokenProcessPool:
            raise
        except (OSError, AssertionError, RuntimeError) as exc:
            raise _CannotStart(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stop the workers now (the proxy is going away): what they were reading is no one's
        any more, and a process that exits right after (uvicorn re-raises SIGTERM) must not leave
        them behind waiting for work."""
        if self._pool is not None:
            workers = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            for proc in workers:
                with contextlib.suppress(OSError, ValueError):  # (gone already; closed)
                    proc.terminate()


# ------------------------------------------------------------- parse and bounds
def _check(body: dict, name: str, types: tuple, required: bool = False) -> None:
    if name not in body:
        if required:
            raise BadRequest(f"'{name}' is a required property", param=name)
        return
    value = body[name]
    if value is None and not required:
        return
    if int in types and isinstance(value, float) and value.is_integer():
        return  # 5.0 is an integer to JSON Schema, and to vLLM's validation
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        want = " or ".join(t.__name__ for t in types)
        raise BadRequest(f"'{name}' must be {want}, not {type(value).__name__}", param=name)


def parse_body(raw: bytes, endpoint: str, max_messages: int = 4096, max_containers: int = 200_000,
               max_depth: int = 128) -> dict:
    """The body as JSON, after bounds that keep the cost of reading it bounded: the
    containers are counted before parsing (every '{' and '[', in strings too: an over-count
    that only errs on the safe side), the nesting after it (where the count allows any), the
    messages before anything walks them."""
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > max_containers:
        raise BadRequest(f"request body has {containers} JSON objects and arrays (or braces in its text); "
                         f"the limit is {max_containers} (max_json_containers)")
    try:
        body = json.loads(raw)  # (nesting past the recursion limit: read() answers 400)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if containers > max_depth and _deeper_than(body, max_depth):
        raise BadRequest(f"request body nests JSON objects and arrays more than {max_depth} deep (max_json_depth)")
    _check(body, "model", (str,))
    _check(body, "stream", (bool,))
    _check(body, "stream_options", (dict,))
    _check(body, "max_tokens", (int,))
    _check(body, "priority", (int,))
    if endpoint == "chat":
        _check(body, "messages", (list,), required=True)
        if len(body["messages"]) > max_messages:
            raise BadRequest(f"{len(body['messages'])} messages; the limit is {max_messages} (max_messages)",
                             param="messages")
        for i, m in enumerate(body["messages"]):
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}] must be an object", param="messages")
    else:
        _check(body, "prompt", (str, list), required=True)
    return body


_WS = b" \t\r\n"
_SLOT_SCAN = 4096  # whitespace looked through around a body's braces (more: it is re-encoded)


def _member_slot(raw: bytes) -> tuple[int, int] | None:
    """Where a member appended to the JSON object ``raw`` goes: (the offset of its ``{``, the
    offset after its last member), or None when ``raw`` is not plainly a UTF-8 object. Reads
    at most ``_SLOT_SCAN`` bytes at each end, whatever the body's size."""
    head, tail = raw[:_SLOT_SCAN], raw[-_SLOT_SCAN:]
    start, kept = len(head) - len(head.lstrip(_WS)), tail.rstrip(_WS)
    if start == len(head) or not kept:  # (nothing but whitespace in a window)
        return None
    end = len(raw) - (len(tail) - len(kept))  # after the closing brace
    if raw[start] != 0x7B or end < start + 2 or raw[end - 1] != 0x7D:
        return None
    before = raw[max(start + 1, end - 1 - _SLOT_SCAN):end - 1]  # what precedes the closing brace
    last = before.rstrip(_WS)
    if not last and end - 1 - len(before) > start + 1:
        return None
    return start, end - 1 - (len(before) - len(last))


def with_member(raw: bytes, member: bytes) -> bytes | None:
    """``raw``, a JSON object in UTF-8 known to lack ``member``'s key, with ``member``
    appended: the client's bytes otherwise as they came (no re-encoding of a long prompt;
    one copy). None when ``raw`` is not plainly that (another encoding: re-encode instead)."""
    slot = _member_slot(raw)
    return None if slot is None else _appended(raw, slot, member)


def _appended(raw: bytes, slot: tuple[int, int], member: bytes) -> bytes:
    start, end = slot
    return b"".join((memoryview(raw)[start:end], b"" if end == start + 1 else b",", member, b"}"))


def _deeper_than(value: dict | list, limit: int) -> bool:
    """Whether containers nest more than ``limit`` deep (level by level, no recursion)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below = []
        for v in level:
            below.extend(x for x in (v.values() if type(v) is dict else v) if type(x) is dict or type(x) is list)
        level = below
    return False


