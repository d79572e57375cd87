"""Full collections of the cycle collector: never started by the interpreter while the
proxy serves, run by the proxy when idle (or every FULL_EVERY_S regardless)."""

from __future__ import annotations

import gc
import sys
import time

import pytest

from prefill_gate.proxy.collector import FULL_EVERY_S, IDLE_GAP_S, YOUNG_THRESHOLD, FullCollections, defer_full_collections


def _full_collections_made_by(work) -> int:
    before = gc.get_stats()[2]["collections"]
    work()
    return gc.get_stats()[2]["collections"] - before


def _survivors(n: int = 600_000) -> list:
    """Objects that survive the younger collections: what hundreds of live requests hold."""
    keep = []
    for i in range(n):
        keep.append([i])
    return keep


@pytest.mark.skipif(not gc.isenabled() or sys.version_info >= (3, 14),
                    reason="the cycle collector is off, or not the generational one this defers")
def test_deferred_the_interpreter_starts_no_full_collection():
    gc.collect()
    assert _full_collections_made_by(_survivors) >= 1  # by default it does (the test can fail)
    gc.collect()
    saved = gc.get_threshold()
    young = gc.get_stats()[0]["collections"]
    restore = defer_full_collections()
    try:
        assert _full_collections_made_by(_survivors) == 0
        assert gc.get_stats()[0]["collections"] > young  # the young generation still collects
    finally:
        restore()
    assert gc.get_threshold() == saved


@pytest.mark.skipif(not gc.isenabled() or sys.version_info >= (3, 14),
                    reason="the cycle collector is off, or not the generational one this tunes")
def test_the_middle_generation_is_collected_in_small_steps():
    """Survivors wait in the middle generation for one young collection at most, not ten: a
    middle collection scans at most two young generations' worth of objects. (CPython's
    get_count()[1] counts the young collections since the middle one's last.)"""
    def most_young_between_middles() -> int:
        gc.collect()
        most, keep = 0, []
        for i in range(200_000):
            keep.append([i])
            most = max(most, gc.get_count()[1])
        return most

    assert most_young_between_middles() >= 5  # CPython's own thresholds (the test can fail)
    restore = defer_full_collections()
    try:
        assert most_young_between_middles() <= 1
    finally:
        restore()


@pytest.mark.skipif(not gc.isenabled() or sys.version_info >= (3, 14),
                    reason="the cycle collector is off, or not the generational one this tunes")
def test_young_collections_scan_a_hundred_new_objects_not_seven_hundred():
    """A young collection starts once YOUNG_THRESHOLD objects more were made than freed since
    the last one: its pause scans that many, where CPython's own threshold lets 700 pile up."""
    def largest_young_generation() -> int:
        gc.collect()
        sizes: list[int] = []

        def on_collection(phase: str, info: dict) -> None:
            if phase == "start" and info["generation"] == 0:
                sizes.append(gc.get_count()[0] - 1)  # (less ``info``, made for this callback)

        gc.callbacks.append(on_collection)
        try:
            _survivors(100_000)
        finally:
            gc.callbacks.remove(on_collection)
        assert len(sizes) > 10
        return max(sizes)

    assert largest_young_generation() > 500  # CPython's own threshold (the test can fail)
    restore = defer_full_collections()
    try:
        assert largest_young_generation() <= YOUNG_THRESHOLD + 1 <= 101
    finally:
        restore()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_full_collections_run_when_idle_or_after_every_seconds_when_busy():
    clock, runs = Clock(), []
    busy, promoted = [True], [True]
    full = FullCollections(lambda: busy[0], every=300.0, gap=10.0, clock=clock,
                           collect=lambda: runs.append(clock.now), promoted=lambda: promoted[0])
    clock.now = 299.0
    assert not full.tick() and runs == []  # busy, and not yet every seconds
    busy[0] = False
    assert full.tick() and runs == [299.0]  # idle: now
    clock.now = 305.0
    assert not full.tick()  # idle again, but within gap of the last
    clock.now = 309.5
    promoted[0] = False
    assert not full.tick()  # nothing promoted since: nothing to scan for
    promoted[0], busy[0] = True, True
    clock.now = 598.0
    assert not full.tick()
    clock.now = 599.0
    assert full.tick() and runs == [299.0, 599.0]  # busy, but 300 s since the last
    assert FULL_EVERY_S >= 60  # a busy proxy is not paused often


@pytest.mark.slow
def test_the_serving_proxy_collects_in_full_once_idle():
    """`prefill-gate serve` makes a full collection once no request is in progress: after a
    burst of streams, with nothing allocating, its gc_pause_seconds{generation="2"} grows
    (the interpreter's own full collections follow allocations, and are off)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from prefill_gate.proxy.bench.overhead import measure
    from prefill_gate.proxy.bench.services import Service

    def full_collections(url: str) -> float:
        text = httpx.get(url + "/metrics", timeout=5).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "prefill_gate_gc_pause_seconds")
        return sum(s.value for s in family.samples if s.name.endswith("_count") and s.labels["generation"] == "2")

    with Service("bench-upstream", name="stamp") as up, \
            Service("serve", "--upstream", up.url, "--log-level", "warning", name="proxy") as gate:
        measure(gate.url, 64, 60, 0.005)  # objects promoted while the streams live
        after_load = full_collections(gate.url)
        deadline = time.monotonic() + IDLE_GAP_S + 10  # the gap counts from the proxy's start
        while full_collections(gate.url) == after_load and time.monotonic() < deadline:
            time.sleep(0.2)
        assert full_collections(gate.url) > after_load
