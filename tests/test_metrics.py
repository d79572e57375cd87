"""The proxy's own metrics (LoopHistogram, LoopCounter) export exactly what prometheus_client's would."""

import math
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from prefill_gate.proxy import metrics
from prefill_gate.proxy.labels import OutcomeKind
from prefill_gate.proxy.metrics import _LATENCY, LoopCounter, LoopHistogram, Metrics, _HistogramChild
from prefill_gate.proxy.relaycore import compiled_module

_core = compiled_module()
compiled = pytest.mark.skipif(isinstance(_core, ImportError), reason=f"the compiled core did not build: {_core}")
CHILDREN = [pytest.param(_HistogramChild, id="python"),
            pytest.param(getattr(_core, "Histogram", None), id="compiled", marks=compiled)]


@pytest.fixture(autouse=True, params=CHILDREN)
def child(request, monkeypatch):
    """Every test here runs with each histogram child: Python's, and the compiled twin the
    proxy takes where the relay's core was built."""
    monkeypatch.setattr(metrics, "histogram_child", request.param)
    return request.param


def test_loop_histogram_exposition_matches_prometheus_clients_histogram():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    args = ("prefill_gate_itl_seconds", "Gap between content chunks.", ["class", "large_prefill_in_flight"])
    reference = Histogram(*args, buckets=_LATENCY, registry=theirs)
    chunked = LoopHistogram(*args, buckets=_LATENCY, registry=ours)
    for cls in ("interactive", "large"):
        for flag in ("true", "false"):
            reference.labels(cls, flag)
            chunked.labels(cls, flag)
    rng = random.Random(7)
    values = [rng.expovariate(100.0) for _ in range(3000)] + list(_LATENCY) + [0.0, 99.0, 1e-9]
    for i, value in enumerate(values):  # bucket edges exactly, zero, and past the last bound
        labels = ("interactive", "true") if i % 3 else ("large", "false")
        reference.labels(*labels).observe(value)
        chunked.labels(*labels).observe(value)
    assert series(ours) == series(theirs)
    count = ours.get_sample_value("prefill_gate_itl_seconds_count", {"class": "large", "large_prefill_in_flight": "false"})
    assert count == len(range(0, len(values), 3))


def test_loop_metrics_want_every_label():
    h = LoopHistogram("x_seconds", "x", ["a", "b"], buckets=(1.0,), registry=CollectorRegistry())
    with pytest.raises(ValueError, match="2 label values"):
        h.labels("only-one")
    c = LoopCounter("x_total", "x", ["a"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="1 label values"):
        c.labels("one", "two")
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("one").inc(-1)


def series(registry):  # `prefill-gate serve` turns prometheus_client's _created off
    return [line for line in generate_latest(registry).splitlines() if b"_created" not in line]


def test_loop_counter_exposition_matches_prometheus_clients_counter():
    """Label values given as strings or as the enums the proxy passes (str() is the value)
    reach one child each, as in prometheus_client; a counter without labels counts itself."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    args = ("prefill_gate_requests_total", "Requests by class and outcome.", ["class", "outcome"])
    reference, loop = Counter(*args, registry=theirs), LoopCounter(*args, registry=ours)
    plain = (Counter("x_total", "x", registry=theirs), LoopCounter("x_total", "x", registry=ours))
    for metric in (reference, loop):
        metric.labels("large", "completed")  # pre-initialised: exported as 0
    rng = random.Random(5)
    for _ in range(2000):
        cls, kind = rng.choice(["interactive", "large"]), rng.choice(list(OutcomeKind))
        label = kind if rng.random() < 0.5 else kind.value
        amount = rng.choice([1, 1, 2.5, 0])
        reference.labels(cls, label).inc(amount)
        loop.labels(cls, label).inc(amount)
        for metric in plain:
            metric.inc(amount)
    assert series(ours) == series(theirs)
    assert len(loop._by_str) == len(reference._metrics)


def test_unlabelled_loop_histogram_matches():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_tokens", "x", buckets=(0, 16, 256), registry=theirs)
    loop = LoopHistogram("x_tokens", "x", buckets=(0, 16, 256), registry=ours)
    for value in [0, 0, 3, 16, 17, 255, 256, 9999]:
        reference.observe(value)
        loop.observe(value)
    assert series(ours) == series(theirs)


def test_a_run_of_chunks_counts_as_its_observations():
    """observe_run(v, n), one read's chunks, exports what observe(v) and n - 1 observe(0)
    would: the per-chunk count and sum the metric promises."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    args = ("x_seconds", "x", ["a"])
    one = LoopHistogram(*args, buckets=_LATENCY, registry=ours).labels("v")
    each = LoopHistogram(*args, buckets=_LATENCY, registry=theirs).labels("v")
    rng = random.Random(3)
    for _ in range(500):
        gap, n = rng.expovariate(50.0), rng.choice([1, 1, 2, 5, 40])
        one.observe_run(gap, n)
        each.observe(gap)
        for _ in range(n - 1):
            each.observe(0.0)
    assert generate_latest(ours) == generate_latest(theirs)


def test_collector_pauses_are_timed_by_generation():
    """watch_gc times each collection of the cycle collector into gc_pause_seconds, by
    generation, until the watcher is removed."""
    import gc

    from prefill_gate.proxy.metrics import Metrics

    registry = CollectorRegistry()
    stop = Metrics(registry, ["http://u"]).watch_gc()

    def count(generation: str) -> float:
        return registry.get_sample_value("prefill_gate_gc_pause_seconds_count", {"generation": generation})

    try:
        before = count("2")
        gc.collect()
        gc.collect(0)
        assert count("2") == before + 1 and count("0") >= 1  # gc.collect() is a full collection
        assert registry.get_sample_value("prefill_gate_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        stop()
    after = count("2")
    gc.collect()
    assert count("2") == after


def test_a_long_collection_is_logged_with_its_wall_clock_time(caplog):
    import gc
    import logging

    from prefill_gate.proxy.metrics import Metrics

    stop = Metrics(CollectorRegistry(), ["http://u"]).watch_gc(log_s=0.0)  # every collection is long
    try:
        with caplog.at_level(logging.WARNING, logger="prefill_gate"):
            gc.collect()
    finally:
        stop()
    assert "the cycle collector held the event loop" in caplog.text and "(generation 2), ending at" in caplog.text
    caplog.clear()
    stop = Metrics(CollectorRegistry(), ["http://u"]).watch_gc(log_s=0.0, busy=lambda: False)
    try:
        with caplog.at_level(logging.WARNING, logger="prefill_gate"):
            gc.collect()  # the proxy's own, while no request was in progress: no stream waited
    finally:
        stop()
    assert not caplog.records
    stop = Metrics(CollectorRegistry(), ["http://u"]).watch_gc()  # 20 ms: a collection here is far shorter
    try:
        with caplog.at_level(logging.WARNING, logger="prefill_gate"):
            gc.collect(0)
    finally:
        stop()
    assert not caplog.records


def test_the_proxys_exposition_has_each_series_once(child):
    """Every metric the proxy exports, after an observation in each: no series twice (a
    bucket bound given twice made two ``le`` series of one name, which Prometheus drops)."""
    registry = CollectorRegistry()
    m = Metrics(registry, ["http://u"])
    for h in vars(m).values():
        if isinstance(h, LoopHistogram):
            (h.labels(*("x",) * len(h._labelnames)) if h._labelnames else h).observe(0.02)
    lines = [line for line in generate_latest(registry).splitlines() if not line.startswith(b"#")]
    names = [line.rsplit(b" ", 1)[0] for line in lines]
    assert len(names) == len(set(names))
    with pytest.raises(ValueError, match="strictly ascending"):
        LoopHistogram("y_seconds", "y", buckets=(0.01, 0.01, 0.1), registry=CollectorRegistry())


_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2 ** 40), 2 ** 40),
                    st.sampled_from(list(_LATENCY) + [0.0, -0.0]))


@compiled
@given(st.lists(st.tuples(_values, st.integers(-3, 70)), max_size=60))
def test_the_compiled_child_counts_as_pythons(observations):
    """The same observations (bucket edges, zeros, negatives, infinities, NaN, ints; runs of
    any length) give the same counts and sum."""
    ours, theirs = _core.Histogram(_LATENCY), _HistogramChild(tuple(float(b) for b in _LATENCY))
    for i, (value, n) in enumerate(observations):
        if i % 2:
            ours.observe(value)
            theirs.observe(value)
        else:
            ours.observe_run(value, n)
            theirs.observe_run(value, n)
    assert ours.counts == theirs.counts
    assert ours.sum == theirs.sum or (math.isnan(ours.sum) and math.isnan(theirs.sum))


@compiled
def test_the_compiled_child_refuses_what_python_refuses():
    with pytest.raises(TypeError):
        _core.Histogram((0.1,)).observe("0.5")
    with pytest.raises(TypeError):
        _core.Histogram((0.1,)).observe_run(0.5)
    with pytest.raises(ValueError, match="ascending"):
        _core.Histogram((0.1, 0.05))
    with pytest.raises(TypeError, match="not called"):
        _core.Histogram.__new__(_core.Histogram).observe(1.0)


@compiled
def test_the_compiled_gap_tally_is_the_exchanges_tokens():
    """GapTally(quiet, busy, upstream, more)(gap, n): observed in ``busy`` while the upstream
    has a large prefill in flight, else in ``quiet``, then ``more(gap, n)`` (GatedExchange._tokens)."""
    quiet, busy = _core.Histogram(_LATENCY), _core.Histogram(_LATENCY)
    upstream, fed = SimpleNamespace(large_in_flight=0), []
    tally = _core.GapTally(quiet, busy, upstream, lambda gap, n: fed.append((gap, n)))
    reference = {False: _HistogramChild(quiet_bounds := tuple(float(b) for b in _LATENCY)),
                 True: _HistogramChild(quiet_bounds)}
    rng = random.Random(11)
    for _ in range(300):
        upstream.large_in_flight = rng.choice([0, 0, 1, 2])
        gap, n = rng.expovariate(80.0), rng.choice([1, 1, 3])
        assert tally(gap, n) is None
        reference[upstream.large_in_flight > 0].observe_run(gap, n)
        assert fed[-1] == (gap, n)
    assert (quiet.counts, busy.counts) == (reference[False].counts, reference[True].counts)
    assert (quiet.sum, busy.sum) == (reference[False].sum, reference[True].sum)
    assert len(fed) == 300
    alone = _core.GapTally(quiet, busy, upstream, None)
    alone(0.5, 1)
    assert len(fed) == 300

    def fails(gap, n):
        raise RuntimeError("the closed loop failed")
    with pytest.raises(RuntimeError, match="closed loop"):
        _core.GapTally(quiet, busy, upstream, fails)(0.1, 1)
    with pytest.raises(TypeError):
        tally(0.1)
    with pytest.raises(TypeError):
        _core.GapTally(quiet, _HistogramChild((0.1,)), upstream, None)  # compiled children only
    with pytest.raises(AttributeError):
        _core.GapTally(quiet, busy, object(), None)(0.1, 1)
