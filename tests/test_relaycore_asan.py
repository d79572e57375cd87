"""The relay's compiled core under AddressSanitizer: its tests run again against a build of
``prefill_gate/proxy/_relaycore.c`` with ``-fsanitize=address``, Python allocating through
malloc so that ASan sees every object's memory. Any report (a use after free, an overflow)
fails the run. The core's read step once called its sink through a borrowed reference, and a
relay whose own callback dropped it was freed under its C code: caught here
(``test_fasthttp.py::test_a_relay_whose_own_callback_drops_it_mid_read_is_not_freed_under_it``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "prefill_gate" / "proxy" / "_relaycore.c"
SUITES = ["tests/test_relaycore.py", "tests/test_fasthttp.py", "tests/test_direct_relay.py",
          "tests/test_relaycore_asan.py::test_the_loaded_core_is_the_one_asked_for"]


def _libasan() -> str | None:
    cc = shutil.which("gcc")
    if cc is None:
        return None
    path = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_the_loaded_core_is_the_one_asked_for():
    """(Run inside the sanitized run: the core the tests import is the ASan build.)"""
    built = os.environ.get("PREFILL_GATE_RELAYCORE_SO")
    if not built:
        pytest.skip("runs inside the AddressSanitizer run only")
    from prefill_gate.proxy import _relaycore

    assert _relaycore.__file__ == built


@pytest.mark.slow
def test_the_compiled_core_under_addresssanitizer(tmp_path):
    libasan = _libasan()
    if libasan is None:
        if os.environ.get("PREFILL_GATE_REQUIRE_COMPILED") == "1":
            pytest.fail("gcc's libasan is missing: the compiled core cannot be checked under AddressSanitizer")
        pytest.skip("no gcc with libasan here")
    built = tmp_path / ("_relaycore" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
                    "-I" + sysconfig.get_paths()["include"], str(SOURCE), "-o", str(built)], check=True, timeout=120)
    logs = tmp_path / "asan"
    env = {**os.environ, "LD_PRELOAD": libasan, "PYTHONMALLOC": "malloc",
           "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:log_path={logs}",
           "PREFILL_GATE_RELAYCORE_SO": str(built), "PREFILL_GATE_REQUIRE_COMPILED": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    reports = sorted(tmp_path.glob("asan.*"))
    assert not reports, reports[0].read_text()[:4000]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "1 skipped" not in run.stdout.splitlines()[-1]
