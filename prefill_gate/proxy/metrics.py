"""Every metric the proxy exports, in one place.

Names follow Prometheus conventions: the ``prefill_gate_`` prefix, base units in the
name, ``_total`` on counters, and only bounded label values (request class, outcome,
configured upstream names, error kind), all pre-initialised so that dashboards see
zeros rather than gaps. The registry is passed in: tests build a fresh one.
"""

from __future__ import annotations

import bisect
import gc
import logging
import math
import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .labels import AdmissionLabel, ErrorKind, OutcomeKind, UpstreamMode

log = logging.getLogger("prefill_gate")

CLASSES = ("interactive", "large")
OUTCOMES = tuple(k.value for k in OutcomeKind)
ADMISSIONS = tuple(d.value for d in AdmissionLabel)
ERROR_KINDS = tuple(k.value for k in ErrorKind if k is not ErrorKind.OTHER)
MODES = tuple(m.value for m in UpstreamMode)

_LATENCY = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
_SLICE_GAP = (0.01, 0.02, 0.03, 0.035, 0.04, 0.045, 0.05, 0.055, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
_WAIT = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_ERROR = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2)
GC_LOG_S = 0.020  # a collection at least this long is logged, too
_GC_PAUSE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self, registry: CollectorRegistry, upstreams: Iterable[str]):
        self.registry = registry
        upstreams = list(upstreams)
        p = "prefill_gate_"
        r = registry
        self.requests = LoopCounter(p + "requests_total", "Requests through the gate by class and outcome.",
                                    ["class", "outcome"], registry=r)
        self.admissions = LoopCounter(p + "admissions_total", "Admission decisions by class and how they ended.",
                                      ["class", "decision"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Large prefills waiting in the queue.", registry=r)
        self.queue_wait = LoopHistogram(p + "queue_wait_seconds", "Time large prefills spent queued.",
                                        ["decision"], buckets=_WAIT, registry=r)
        self.live_decodes = Gauge(p + "live_decodes", "Protected requests in their decode phase.",
                                  ["upstream"], registry=r)
        self.large_in_flight = Gauge(p + "large_prefills_in_flight", "Large prefills still prefilling.",
                                     ["upstream"], registry=r)
        self.prefill_tokens = Gauge(p + "inflight_prefill_tokens", "Estimated prompt tokens still prefilling.",
                                    ["upstream"], registry=r)
        self.budget_tokens = Gauge(p + "closed_loop_budget_tokens",
                                   "Closed loop: in-flight prefill tokens allowed next to live decodes.",
                                   ["upstream"], registry=r)
        self.unauthorized = Counter(p + "unauthorized_total", "Requests refused for a missing or unknown API key.",
                                    registry=r)
        self.retries = Counter(p + "retries_total",
                               "Requests moved to another upstream after theirs failed before answering.",
                               ["upstream"], registry=r)
        self.upstream_up = Gauge(p + "upstream_up", "1 when the upstream's last health check passed.",
                                 ["upstream"], registry=r)
        self.estimated_tokens = LoopHistogram(p + "estimated_prompt_tokens", "Estimated uncached prompt tokens.",
                                              ["class"], buckets=_TOKENS, registry=r)
        self.cached_tokens = LoopHistogram(p + "estimated_cached_prompt_tokens",
                                           "Prompt tokens credited to the upstream's prefix cache.",
                                           buckets=(0,) + _TOKENS, registry=r)
        self.cache_credit_misses = Counter(
            p + "cache_credit_misses_total",
            "Requests credited with a cached prefix that the upstream reported as not cached "
            "(usage.prompt_tokens_details.cached_tokens): evicted, so their class may be wrong.",
            registry=r)
        self.ttft = LoopHistogram(p + "ttft_seconds", "Time to first content chunk, measured by the proxy.",
                                  ["class"], buckets=_LATENCY[4:], registry=r)
        self.itl = LoopHistogram(p + "itl_seconds", "Gap between content chunks of one stream, measured by the proxy.",
                                 ["class", "large_prefill_in_flight"], buckets=_LATENCY, registry=r)
        self.upstream_errors = Counter(p + "upstream_errors_total", "Upstream failures by kind.",
                                       ["upstream", "kind"], registry=r)
        self.estimate_error = LoopHistogram(p + "estimate_relative_error",
                                            "|estimated - reported| / reported prompt tokens (0-1 is 0-100%).",
                                            buckets=_ERROR, registry=r)
        self.bytes_per_token = Gauge(p + "bytes_per_token", "Calibrated prompt bytes per token.", registry=r)
        self.can_slice = Gauge(p + "upstream_can_slice",
                               "1 when the upstream caches prefixes and answers /tokenize (slicing possible).",
                               ["upstream"], registry=r)
        self.upstream_mode = Gauge(
            p + "upstream_mode",
            "1 for what the gate does with a large prefill while protected streams decode on the upstream "
            "(paced: its engine bounds every step, the prompt goes at once; sliced: slicing; held: "
            "holding), 0 for the others.",
            ["upstream", "mode"], registry=r)
        self.slices = Counter(p + "slices_total", "Slices sent to warm an upstream's prefix cache.",
                              ["upstream"], registry=r)
        self.slice_tokens = Counter(p + "slice_tokens_total", "Prompt tokens covered by slicing, per prompt.",
                                    ["upstream"], registry=r)
        self.slice_gap = Histogram(
            p + "slice_gap_seconds",
            "Per slice: the largest gap a protected stream on the upstream saw while it ran (what the "
            "slice sizer aims at slice_gap_ms and keeps within max_gap_ms).",
            ["upstream"], buckets=_SLICE_GAP, registry=r)
        self.slice_ceiling = Gauge(
            p + "slice_ceiling_tokens",
            "The largest slice the sizer sends on the upstream while larger slices have been stalling "
            "protected streams past 1.5x max_gap_ms (vLLM's eager steps on a busy host); 0: no such limit.",
            ["upstream"], registry=r)
        self.slicing_seconds = Histogram(p + "slicing_seconds", "Time a prompt spent being sliced.",
                                         buckets=_WAIT, registry=r)
        self.slice_settle_seconds = Counter(
            p + "slice_settle_seconds_total",
            "Time slicers waited for other requests' prefills on the upstream to end before a slice.",
            ["upstream"], registry=r)
        self.gc_pause = Histogram(
            p + "gc_pause_seconds",
            "Time the interpreter's cycle collector held the event loop, per collection, by generation "
            "(2: full collections). Observed by `prefill-gate serve`.",
            ["generation"], buckets=_GC_PAUSE, registry=r)
        self.slice_misses = Counter(
            p + "slice_cache_miss_tokens_total",
            "Sliced prompt tokens the upstream did not serve from its cache to the final request "
            "(usage.prompt_tokens_details.cached_tokens; vLLM --enable-prompt-tokens-details).",
            ["upstream"], registry=r)

        for c in CLASSES:
            for o in OUTCOMES:
                self.requests.labels(c, o)
            for d in ADMISSIONS:
                self.admissions.labels(c, d)
            self.estimated_tokens.labels(c)
            self.ttft.labels(c)
            for flag in ("true", "false"):
                self.itl.labels(c, flag)
        for d in ADMISSIONS:
            self.queue_wait.labels(d)
        for u in upstreams:
            for g in (self.live_decodes, self.large_in_flight, self.prefill_tokens, self.upstream_up,
                      self.budget_tokens, self.can_slice, self.slices, self.slice_tokens, self.slice_misses,
                      self.slice_gap, self.slice_ceiling):
                g.labels(u)
            self.retries.labels(u)
            for m in MODES:
                self.upstream_mode.labels(u, m)
            for k in ERROR_KINDS:
                self.upstream_errors.labels(u, k)
        for generation in ("0", "1", "2"):
            self.gc_pause.labels(generation)

    def watch_gc(self, log_s: float = GC_LOG_S, busy: Callable[[], bool] = lambda: True) -> Callable[[], None]:
        """Time every collection of the cycle collector into ``gc_pause`` (its callbacks are
        the process's: one watcher per process), and log those of at least ``log_s`` that
        ran while ``busy()`` (requests in progress: each of their streams waited for it),
        with the wall-clock time they ended. Returns what stops watching."""
        started = [0.0]
        children = {g: self.gc_pause.labels(str(g)) for g in (0, 1, 2)}

        def on_collection(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
                return
            took = time.perf_counter() - started[0]
            children[info["generation"]].observe(took)
            if took >= log_s and busy():
                log.warning("the cycle collector held the event loop %.1f ms (generation %d), ending at "
                            "%.3f (unix s)", took * 1e3, info["generation"], time.time())

        gc.callbacks.append(on_collection)
        return lambda: gc.callbacks.remove(on_collection)


class _LoopMetric:
    """A metric for the request and per-chunk paths, exported as prometheus_client's would be
    (the same name, labels and samples; tests/test_metrics.py holds the two equal). Observed
    and collected on the event loop's thread only, so without prometheus_client's lock; and
    ``labels(...)`` is one dict lookup once a label set was seen (prometheus_client converts
    and checks every value and takes a lock each call: with its Histogram.observe, ~10% of a
    short request's CPU in the proxy's own code). A metric without labels is observed through
    itself."""

    _family: Any = None  # the *MetricFamily class

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (), *,
                 registry: CollectorRegistry):
        self._name, self._doc, self._labelnames = name, documentation, list(labelnames)
        self._children: dict[tuple, Any] = {}  # by the label values as given, and as strings
        self._by_str: dict[tuple[str, ...], Any] = {}  # each child once, in creation order
        if not self._labelnames:
            self._only = self.labels()
        registry.register(self)

    def _child(self) -> Any:
        raise NotImplementedError

    def labels(self, *values) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: {len(self._labelnames)} label values, got {len(values)}")
            key = tuple(str(v) for v in values)
            child = self._by_str.get(key)
            if child is None:
                child = self._by_str[key] = self._child()
            self._children[values] = child
        return child

    def describe(self) -> list:
        return [self._family(self._name, self._doc, labels=self._labelnames)]


class LoopHistogram(_LoopMetric):
    """A histogram: an observation is a bisect and two additions (prometheus_client's
    takes a lock and walks the buckets: 3.7% of the relay's CPU at 32 streams when the
    inter-token gaps were observed per token)."""

    _family = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (), *, buckets: Iterable[float],
                 registry: CollectorRegistry):
        self._bounds = tuple(float(b) for b in buckets)
        if any(not a < b for a, b in zip(self._bounds, self._bounds[1:])):
            # (a bound twice is one bucket series twice in a scrape: Prometheus drops the sample)
            raise ValueError(f"{name}: bucket bounds must be strictly ascending, got {self._bounds}")
        super().__init__(name, documentation, labelnames, registry=registry)

    def _child(self) -> "_HistogramChild":
        return histogram_child(self._bounds)

    def observe(self, value: float) -> None:
        self._only.observe(value)

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in self._by_str.items():
            total, buckets = 0, []
            for bound, count in zip(self._bounds + (math.inf,), child.counts):
                total += count
                buckets.append((floatToGoString(bound), total))
            family.add_metric(list(key), buckets, child.sum)
        return [family]


class LoopCounter(_LoopMetric):
    """A counter (its name ends in ``_total``, as prometheus_client's exposition has it)."""

    _family = CounterMetricFamily

    def _child(self) -> "_CounterChild":
        return _CounterChild()

    def inc(self, amount: float = 1) -> None:
        self._only.inc(amount)

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in self._by_str.items():
            family.add_metric(list(key), child.value)
        return [family]


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters only go up: inc() takes a non-negative amount")
        self.value += amount


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value

    def observe_run(self, value: float, n: int) -> None:
        """``n`` observations: ``value``, then ``n - 1`` zeros (one read's chunks: the first
        after a gap, the rest right behind it)."""
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        if n > 1:
            self.counts[bisect.bisect_left(self._bounds, 0.0)] += n - 1
        self.sum += value


def _compiled_child() -> type | None:
    try:
        from ._relaycore import Histogram
    except ImportError:
        return None
    return Histogram


# Each LoopHistogram's children: the compiled twin of _HistogramChild where the relay's core
# was built (the same counts and sum from the same observations, tests/test_metrics.py; the
# per-read gap observations then take no Python frame, prefill_gate/proxy/relaycore.py gap_tally_type).
histogram_child: type = _compiled_child() or _HistogramChild
