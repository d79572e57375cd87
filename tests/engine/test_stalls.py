"""The plugin's watch on Python's cycle collector (`prefill_gate.engine_patches.stalls`)."""

from __future__ import annotations

import gc
import logging

import pytest

from prefill_gate import engine_patches
from prefill_gate.engine_patches import stalls
from prefill_gate.engine_patches.stalls import ENV, GcWatch, StallWatchError, threshold_from_env

LOG = logging.getLogger("vllm.prefill_gate")


@pytest.fixture(autouse=True)
def no_watch_left():
    stalls.uninstall()
    yield
    stalls.uninstall()


def test_the_threshold_is_20_ms_where_pacing_is_on_unless_set_and_a_bad_value_names_the_variable():
    assert threshold_from_env({"PREFILL_GATE_PACING": "adaptive"}) == pytest.approx(0.020)
    assert threshold_from_env({}) == 0.0  # other vLLMs in the environment: nothing new
    assert threshold_from_env({"PREFILL_GATE_PACING": "off"}) == 0.0
    assert threshold_from_env({ENV: "20"}) == pytest.approx(0.020)
    assert threshold_from_env({ENV: "0"}) == 0.0
    assert threshold_from_env({ENV: " 7.5 "}) == pytest.approx(0.0075)
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(StallWatchError, match=ENV):
            threshold_from_env({ENV: bad})


def test_a_collection_past_the_threshold_is_logged_with_its_wall_clock_time(caplog):
    now = [100.0]
    watch = GcWatch(0.020, LOG, clock=lambda: now[0], wall=lambda: 1_700_000_000.1234)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        watch("start", {"generation": 2})
        now[0] += 0.019
        watch("stop", {"generation": 2, "collected": 5})
        assert not caplog.records  # under the threshold
        watch("start", {"generation": 2})
        now[0] += 0.0341
        watch("stop", {"generation": 2, "collected": 1234})
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "34.1 ms, generation 2, 1234 objects collected, ending at 1700000000.123 (unix s)" in line
    assert "1 such collection(s) in this process, the longest 34.1 ms" in line


def test_install_watches_real_collections_once_per_process(caplog):
    watch = stalls.install(1e-9, LOG)  # every collection passes
    assert stalls.install(1e-9, LOG) is watch
    assert sum(isinstance(c, GcWatch) for c in gc.callbacks) == 1
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        gc.collect()
    assert "Python's cycle collector held" in caplog.text and "generation 2" in caplog.text
    assert stalls.install(0.0, LOG) is None  # off: the watch stays, logging nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        gc.collect()
    assert not caplog.records
    stalls.uninstall()
    assert not any(isinstance(c, GcWatch) for c in gc.callbacks)


def test_register_installs_the_watch_and_refuses_a_bad_threshold(monkeypatch, caplog):
    monkeypatch.setenv(ENV, "15")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        engine_patches.register()
        engine_patches.register()
    assert f"{ENV}=15" in caplog.text
    assert [c.threshold_s for c in gc.callbacks if isinstance(c, GcWatch)] == [pytest.approx(0.015)]
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(StallWatchError, match=f"{ENV}='soon'"):
        engine_patches.register()
