"""The estimator under hypothesis: properties any body must keep."""

from __future__ import annotations

import asyncio

import hypothesis.strategies as st
from hypothesis import given, settings

from prefill_gate.proxy.estimate import Calibrator, Estimator, shape_of

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=3000)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                           "content": texts}), min_size=1, max_size=6)


class CountingExact:
    """An exact counter that records whether it was asked (len of the text + 3 per message)."""

    def __init__(self):
        self.calls = 0

    async def count(self, shape, model):
        self.calls += 1
        return len(shape.text) + 3 * max(1, shape.n_messages)


def run(coro):
    return asyncio.run(coro)


@settings(max_examples=200, deadline=None)
@given(msgs=messages, threshold=st.integers(16, 4000), band=st.sampled_from([0.0, 0.25, 0.5]),
       cached=st.integers(0, 5000))
def test_estimates_are_sane_and_exact_counts_only_near_the_threshold(msgs, threshold, band, cached):
    exact = CountingExact()
    est = Estimator(threshold, Calibrator(4.0), exact, band=band)
    shape = shape_of({"messages": msgs}, "chat")
    result = run(est.estimate(shape, "m", cached=cached))
    cheap = Calibrator(4.0).estimate("m", shape.n_bytes, shape.n_messages)
    assert result.tokens >= 0 and result.cached >= 0
    assert result.cached <= cached
    near = abs((cheap - min(cached, cheap)) - threshold) <= band * threshold
    assert (exact.calls == 1) == near  # tokenizes only when the cheap estimate is near the threshold
    assert result.method == ("exact" if near else "calibrated")


@settings(max_examples=100, deadline=None)
@given(msgs=messages, extra=texts)
def test_more_text_never_estimates_fewer_tokens(msgs, extra):
    est = Estimator(10**9, Calibrator(3.7))
    base = run(est.estimate(shape_of({"messages": msgs}, "chat"), "m"))
    longer = [*msgs[:-1], {**msgs[-1], "content": msgs[-1]["content"] + extra}]
    more = run(est.estimate(shape_of({"messages": longer}, "chat"), "m"))
    assert more.tokens >= base.tokens


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.tuples(st.integers(256, 200_000), st.integers(1, 8), st.integers(1, 100_000)),
                        min_size=1, max_size=30))
def test_calibration_stays_finite_and_positive(samples):
    cal = Calibrator(4.0)
    for n_bytes, n_messages, prompt_tokens in samples:
        cal.observe("m", n_bytes, n_messages, prompt_tokens)
        ratio = cal.ratio("m")
        assert 0 < ratio < float("inf")
        assert cal.estimate("m", n_bytes, n_messages) >= 0


def test_a_failing_exact_counter_falls_back_to_the_estimate():
    class Broken:
        async def count(self, shape, model):
            raise RuntimeError("tokenizer exploded")

    est = Estimator(100, Calibrator(4.0), Broken(), band=10.0)
    result = run(est.estimate(shape_of({"messages": [{"role": "user", "content": "x" * 400}]}, "chat"), "m"))
    assert result.method == "calibrated" and result.tokens > 0
