"""Reading the plugin's on/off settings from the environment, refusing anything else."""

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
