"""Optional client API keys, stored as hashes.

With ``api_keys_file`` set, every request except ``GET /health`` and ``/ready`` needs
``Authorization: Bearer <key>`` with a key whose hash is in the file; otherwise 401.
``/metrics`` needs a key too (its counters move with each request: the cached-prefix
credit would tell a stranger whether a guessed prompt was sent before); a scraper without
one reads them from ``metrics_port``, a listener of its own on a private address.
The file holds one ``sha256:<hex>`` line per key (``prefill-gate hash-key`` prints one),
so a leaked file does not leak keys. The client's key is never sent upstream (the
proxy sends ``upstream_api_key`` there, or no Authorization at all). Every stored hash is
compared, each in constant time, so timing tells nothing about which one nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

PREFIX = "sha256:"
_LINE = re.compile(r"^sha256:[0-9a-f]{64}$")
OPEN_PATHS = frozenset({"/health", "/ready"})


def hash_key(key: str) -> str:
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


class KeysFileError(ValueError):
    """The API keys file cannot be used (the message names the file and line)."""


class KeyCheck:
    def __init__(self, hashes: list[str]):
        if not hashes:
            raise KeysFileError("no API key hashes given: every request would be refused")
        self._digests = [h[len(PREFIX):].encode() for h in hashes]

    @classmethod
    def from_file(cls, path: str) -> KeyCheck:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise KeysFileError(f"api_keys_file {path}: {exc.strerror}") from exc
        hashes = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not _LINE.match(line):
                raise KeysFileError(f"api_keys_file {path}:{number}: expected sha256:<64 hex digits> "
                                    "(prefill-gate hash-key prints one)")
            hashes.append(line)
        if not hashes:
            raise KeysFileError(f"api_keys_file {path} holds no key hashes")
        return cls(hashes)

    def allows(self, authorization: str | None) -> bool:
        if not authorization or authorization[:7].lower() != "bearer ":
            return False
        digest = hashlib.sha256(authorization[7:].strip().encode()).hexdigest().encode()
        ok = False
        for stored in self._digests:
            ok |= hmac.compare_digest(digest, stored)
        return ok
