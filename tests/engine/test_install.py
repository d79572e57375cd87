"""prefill-gate installed into vLLM's own environment breaks nothing there.

The engine patches live in vLLM's environment, so the wheel goes where transformers and
Hugging Face's ``kernels`` already are (transformers' hub-kernels integration imports it,
vLLM 0.26.0 imports transformers). A wheel that installed a top-level ``kernels`` (or
``proxy``) wrote its files over theirs and broke ``import vllm.config``. Here the wheel is
built from this checkout and installed by pip into a fresh environment over one that already
holds transformers 5.x and Hugging Face's kernels, as a user would (``pip install .`` after
``pip install vllm``); then what vLLM imports and our plugin's entry point are imported there.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if os.environ.get("PREFILL_GATE_REQUIRE_ENGINE") == "1":
    import kernels as hf_kernels  # noqa: F401  (requirements/engine-cpu.txt: vLLM's environment has it)
else:
    hf_kernels = pytest.importorskip("kernels", reason="Hugging Face's kernels package is not installed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from this checkout's files (tracked, and new ones not ignored)."""
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("prefill_gate-*.whl")
    return built


def test_the_wheel_installs_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/", 1)[0] for name in z.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"prefill_gate"}
    with zipfile.ZipFile(wheel) as z:
        entry_points = next(z.read(n).decode() for n in z.namelist() if n.endswith("entry_points.txt"))
    assert "prefill_gate = prefill_gate.engine_patches:register" in entry_points
    assert "prefill-gate = prefill_gate.proxy.cli:main" in entry_points


_CHECK = r"""
import importlib.metadata, sys
import kernels
assert hasattr(kernels, "CUDAProperties"), f"kernels is not Hugging Face's: {kernels.__file__}"
from transformers.integrations import hub_kernels  # imports Hugging Face's kernels
assert hub_kernels.is_kernels_available()
import vllm.config  # the chain that failed: vllm.config -> transformers -> hub_kernels -> kernels
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.utils.import_utils import resolve_obj_by_qualname
(plugin,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "prefill_gate"]
plugin.load()()  # register(), as vLLM's plugin loader calls it
paced = resolve_obj_by_qualname("prefill_gate.engine_patches.pacing.PacedAsyncScheduler")  # --scheduler-cls
assert issubclass(paced, Scheduler)
import prefill_gate.proxy.app, prefill_gate.kernels.tiles
print("ok", prefill_gate.proxy.app.__file__)
"""


def test_installed_beside_huggingface_kernels_vllm_still_imports(wheel, tmp_path):
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # vLLM's environment: this one's packages (vLLM, torch, transformers) ...
    (site / "_vllm_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # ... and Hugging Face's kernels installed in the same site-packages our wheel goes to.
    dist = importlib.metadata.distribution("kernels")
    shutil.copytree(Path(hf_kernels.__file__).parent, site / "kernels")
    shutil.copytree(Path(dist._path), site / Path(dist._path).name)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    run = subprocess.run([python, "-c", _CHECK], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"ok {site}/prefill_gate/proxy/app.py" in run.stdout
    cli = subprocess.run([env_dir / "bin" / "prefill-gate", "--help"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "serve" in cli.stdout
