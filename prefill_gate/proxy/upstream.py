"""The HTTP client to the upstreams, and the one place httpx errors become ours.

Timeouts and connection limits come from the settings, never httpx's defaults
(100 connections and 5 s would act as a second, hidden admission limit).
Only configured upstream URLs are ever contacted: callers name an upstream by its
configured base URL and a path that the app's routes allow.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from .errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from .fasthttp import MAX_HEAD_BYTES, MAX_HEADERS, Answer, FastTransport, body_reader, origin_of

_CLOSED_STREAM = httpx.ByteStream(b"")
# What ``UpstreamClient.stream`` enters with: the fast transport's Answer for the gated POSTs,
# httpx's response for the rest (and for tests' in-memory transports).
Answered = httpx.Response | Answer
# Hop-by-hop headers (RFC 9110 7.6.1; and what a request's own ``Connection`` names), the ones
# httpx or the server recompute, and the ones the proxy's listener answers itself (``Expect``).
_DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "proxy-authorization",
                           "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "http2-settings",
                           "expect", "accept-encoding"})
_DROP_RESPONSE = {b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade",
                  b"proxy-authenticate", b"date", b"server"}


_HTTPX_DEFAULTS = ("accept", "connection", "user-agent")  # (accept-encoding: request_headers sets it)
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9/._~-]*\Z")  # needs no percent-encoding
_UNSAFE_HEADER = re.compile(rb"[\r\n\0]")


@dataclass(frozen=True)
class _Target:
    """An upstream base URL, parsed once: where to connect, its Host header, its path."""

    origin: tuple[str, str, int]
    host: bytes
    base: bytes

    @classmethod
    def of(cls, url: str) -> "_Target":
        u = httpx.URL(url)
        return cls(origin_of(u), u.netloc, u.raw_path.rstrip(b"/"))


def request_headers(headers: Mapping[str, str], api_key: str | None, drop_client_auth: bool = False) -> dict:
    """The headers to send upstream. Values go out as the bytes they arrived as (the ASGI
    server decoded them as latin-1), so a header byte over 0x7F passes through unchanged
    instead of failing an ASCII encoder."""
    drop = _DROP_REQUEST
    named = headers.get("connection")  # (the ASGI server's names are lower case)
    if named:  # e.g. "close, X-Secret": each name it lists is for this hop alone
        drop = drop | {t.strip().lower() for t in named.split(",")}
    out = {k: v if v.isascii() else v.encode("latin-1", "replace") for k, v in headers.items()
           if k.lower() not in drop and not k.lower().startswith("x-prefill-gate-")}
    out["accept-encoding"] = "identity"  # we parse the stream; vLLM does not compress anyway
    if api_key is not None or drop_client_auth:  # the client's key is for the proxy, never for upstream
        out = {k: v for k, v in out.items() if k.lower() != "authorization"}
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    return out


def response_headers(resp: Answered, upstream: str | None = None) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers for the client, as the bytes it sent (names in lower
    case); a redirect to the upstream's own address is made relative, so the internal
    address does not leak."""
    raw = resp.raw_headers if type(resp) is Answer else resp.headers.raw
    prefix = upstream.encode() if upstream is not None else None
    out = []
    for k, v in raw:
        name = k.lower()
        if name in _DROP_RESPONSE:
            continue
        if name == b"location" and prefix is not None and v.startswith(prefix):
            v = v[len(prefix):] or b"/"
        out.append((name, v))
    return out


class mapped_errors:
    """Translate httpx exceptions raised inside the block into UpstreamError (a class, not a
    generator: it is entered several times per request)."""

    __slots__ = ("upstream",)

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or not issubclass(exc_type, httpx.HTTPError):
            return
        upstream = self.upstream
        if issubclass(exc_type, httpx.ConnectTimeout):
            raise UpstreamUnavailable(f"upstream {upstream} did not accept a connection in time") from exc
        if issubclass(exc_type, httpx.ConnectError):
            raise UpstreamUnavailable(f"upstream {upstream} is unreachable: {exc}") from exc
        if issubclass(exc_type, httpx.TimeoutException):
            raise UpstreamTimeout(f"upstream {upstream} stayed silent past the read timeout") from exc
        if issubclass(exc_type, (httpx.RemoteProtocolError, httpx.ReadError, httpx.DecodingError, httpx.WriteError)):
            raise UpstreamProtocolError(f"upstream {upstream} broke the connection: {exc or exc_type.__name__}") \
                from exc
        raise UpstreamUnavailable(f"upstream {upstream} failed: {exc or exc_type.__name__}") from exc


async def read_limited(resp: Answered, upstream: str, limit: int) -> bytes:
    """A response body read whole, at most ``limit`` bytes (UpstreamProtocolError beyond)."""
    chunks, size = [], 0
    read = body_reader(resp)
    with mapped_errors(upstream):
        while (chunk := await read()) is not None:
            size += len(chunk)
            if size > limit:
                raise UpstreamProtocolError(f"upstream {upstream} answered over {limit} bytes "
                                            "(max_upstream_body_bytes)")
            chunks.append(chunk)
    return b"".join(chunks)


class _Streamed:
    """``UpstreamClient.stream``'s context (a class, not a generator: one per request)."""

    __slots__ = ("_client", "_args", "_resp")

    def __init__(self, client: "UpstreamClient", *args) -> None:
        self._client, self._args, self._resp = client, args, None

    async def __aenter__(self) -> Answered:
        self._resp = await self._client._open(*self._args)
        return self._resp

    async def __aexit__(self, exc_type, exc, tb) -> None:
        resp, self._resp = self._resp, None
        await resp.aclose()
        # httpx's response and its bound stream refer to each other: a cycle per request
        # for the cycle collector. Nothing reads the stream after aclose.
        resp.stream = _CLOSED_STREAM


class UpstreamClient:
    """Requests to the upstreams over one httpx client on ``FastTransport`` (asyncio and
    httptools; see ``prefill_gate.proxy.fasthttp`` for why not httpx's own transport). Tests pass an
    in-memory ``transport`` instead. Proxies from the environment are ignored: only the
    configured upstreams are ever contacted, directly. No cookie jar: the clients' own
    Cookie headers pass through, an upstream's Set-Cookie goes back to its client only."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        max_connections: int = 4096,
        api_key: str | None = None,
        drop_client_auth: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_headers: int = MAX_HEADERS,
        framed: bool = False,
    ):
        self.urls = list(urls)
        self.api_key = api_key
        self.drop_client_auth = drop_client_auth
        timeout = httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout)
        self._timeouts = timeout.as_dict()
        # With our own transport, POSTs to plain paths (the gated endpoints, slices, token
        # ids) skip httpx's client and go to the transport from their parts (see _post_fast).
        self._fast = None if transport is not None else FastTransport(
            max_connections=max_connections, max_head_bytes=max_head_bytes, max_headers=max_headers, framed=framed)
        self._targets = {u: _Target.of(u) for u in self.urls}
        self._client = httpx.AsyncClient(
            timeout=timeout,
            transport=transport or self._fast,
            trust_env=False,
            # One client serves every proxied request: it must not keep an upstream's
            # Set-Cookie and send it along with other clients' requests.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
        )
        # Upstream gets the client's headers, not httpx's defaults (its User-Agent, Accept,
        # Connection): the same head either way a request goes.
        for name in _HTTPX_DEFAULTS:
            del self._client.headers[name]

    async def aclose(self) -> None:
        await self._client.aclose()

    def stream(self, upstream: str, method: str, path: str, headers: Mapping[str, str], content: bytes,
               query: str = "") -> "_Streamed":
        """``async with client.stream(...) as resp``: send a request, enter once its answer's
        headers arrived; the body is read by the caller inside the block. Leaving the block
        closes the connection, which is how vLLM learns that the client went away."""
        return _Streamed(self, upstream, method, path, headers, content, query)

    async def _open(self, upstream: str, method: str, path: str, headers: Mapping[str, str], content: bytes,
                    query: str) -> Answered:
        if upstream not in self.urls:
            raise UpstreamUnavailable(f"{upstream} is not a configured upstream")
        out = request_headers(headers, self.api_key, self.drop_client_auth)
        with mapped_errors(upstream):
            if self._fast is not None and method == "POST" and not query and _PLAIN_PATH.match(path):
                resp = await self._post_fast(self._targets[upstream], path, out, content)
                if resp is not None:
                    return resp
            client = self._client
            req = client.build_request(method, upstream + path + (f"?{query}" if query else ""), headers=out,
                                       content=content)
            return await client.send(req, stream=True)

    async def _post_fast(self, target: "_Target", path: str, headers: dict, content: bytes) -> Answer | None:
        """A POST straight to the transport (None: a header value that only httpx's own
        checks should see, e.g. a line break in a configured key)."""
        raw = [(b"host", target.host)]
        for name, value in headers.items():
            value = value if isinstance(value, bytes) else value.encode("latin-1", "replace")
            name = name.encode("latin-1", "replace")
            if _UNSAFE_HEADER.search(value) or _UNSAFE_HEADER.search(name):
                return None
            raw.append((name, value))
        raw.append((b"content-length", b"%d" % len(content)))
        return await self._fast.open(b"POST", target.origin, target.base + path.encode("ascii"), raw, content,
                                     self._timeouts)

    async def request_bytes(self, upstream: str, method: str, path: str, content: bytes = b"", *,
                            limit: int, timeout: float) -> tuple[int, bytes]:
        """One small request of the proxy's own (probes, token ids, slices), its answer read
        whole: (status, body). A body over ``limit`` bytes or an answer slower than
        ``timeout`` seconds is an UpstreamProtocolError / UpstreamTimeout."""
        headers = {"content-type": "application/json"} if content else {}

        async def exchange() -> tuple[int, bytes]:
            async with self.stream(upstream, method, path, headers, content) as resp:
                return resp.status_code, await read_limited(resp, upstream, limit)

        try:
            return await asyncio.wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"upstream {upstream}{path} did not answer within {timeout:g} s") from None

    async def post_json(self, upstream: str, path: str, payload: dict | bytes, timeout: float | None = None) -> dict:
        """POST ``payload`` (a dict, or its JSON already encoded) and read a JSON answer."""
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        with mapped_errors(upstream):
            resp = await self._client.post(upstream + path, content=content, timeout=timeout,
                                           headers=request_headers({"content-type": "application/json"}, self.api_key))
        if resp.status_code != 200:
            raise UpstreamProtocolError(f"upstream {upstream}{path} answered {resp.status_code}")
        try:
            return resp.json()
        except ValueError as exc:
            raise UpstreamProtocolError(f"upstream {upstream}{path} answered non-JSON") from exc

    async def healthy(self, upstream: str, timeout: float = 2.0) -> bool:
        try:
            with mapped_errors(upstream):
                resp = await self._client.get(upstream + "/health", timeout=timeout)
            return resp.status_code == 200
        except UpstreamError:
            return False
