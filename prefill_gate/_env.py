"""The engine patches' settings: on/off switches from the environment, settings files and
watching them for changes (each refuses what it cannot use)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def switch(name: str, default: str, error: type[ValueError], environ: Mapping[str, str] | None = None) -> bool:
    """Is setting ``name`` on? Unset or empty: ``default``; neither on nor off: ``error``."""
    env = os.environ if environ is None else environ
    raw = (env.get(name) or default).strip().lower()
    if raw not in ("on", "off"):
        raise error(f"{name}={env.get(name)!r}: expected on or off")
    return raw == "on"


def read_settings_file(path: str, accept, error: type[ValueError]) -> dict[str, str]:
    """A control file's KEY=VALUE lines (``#`` starts a comment); a key ``accept`` refuses, or a
    line that is no KEY=VALUE, raises ``error`` naming the file and line."""
    settings = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if not sep or not accept(key):
                raise error(f"{path}:{number}: expected a prefill-gate engine setting KEY=VALUE, got {line!r}")
            settings[key] = value.strip()
    return settings


class FileWatch:
    """Has a settings file changed since it was last read? Looked at (one ``stat``) no more often
    than every ``every`` seconds of the caller's clock; an absent file is no change."""

    def __init__(self, path: str, every: float):
        self.path, self.every = path, every
        self._next, self._seen = 0.0, None

    def changed(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.every
        try:
            seen = os.stat(self.path).st_mtime_ns
        except OSError:
            return False
        if seen == self._seen:
            return False
        self._seen = seen
        return True
