"""The load generator's own collections during a phase (`bench mixed`'s `client_gc`)."""

from __future__ import annotations

import gc

from prefill_gate.proxy.bench.client_gc import LONG_S, ClientCollections


def test_a_phase_counts_its_collections_and_lists_the_long_ones_on_its_clock():
    now = [10.0]
    assert gc.get_freeze_count() == 0
    with ClientCollections(clock=lambda: now[0]) as c:
        assert gc.get_freeze_count() > 0  # what existed before the phase is out of the collector's sight
        c._on_collection("start", {"generation": 0})
        now[0] += LONG_S / 10
        c._on_collection("stop", {"generation": 0})
        c._on_collection("start", {"generation": 2})
        now[0] += 0.030
        c._on_collection("stop", {"generation": 2})
        gc.collect()  # a real one is counted too
    assert gc.get_freeze_count() == 0
    out = c.summary(t0=9.0)  # the records' zero, a second before the recorder's
    assert out["collections"] >= 3 and out["max_ms"] >= 30.0
    assert out["long"][0] == [1.0305, 30.0, 2]
    assert c.summary(t0=9.0, scale=2.0)["long"][0] == [0.5152, 15.0, 2]  # in the engine's time
    assert len(out["long"]) <= 2  # the short one is counted, not listed


def test_a_heap_frozen_by_someone_else_stays_frozen():
    """Frozen objects are out of gc.get_objects() until unfrozen. (Not the freeze count: a
    frozen object that dies, say a finished thread's, leaves the count one lower.)"""
    sentinel: list = []
    sentinel.append(sentinel)  # a cycle: tracked by the collector
    gc.freeze()
    try:
        assert not any(o is sentinel for o in gc.get_objects())
        with ClientCollections():
            gc.collect()
        assert gc.get_freeze_count() > 0 and not any(o is sentinel for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is sentinel for o in gc.get_objects())  # the check sees an unfrozen object
