"""Token estimation: calibrated bytes-per-token, exact counters only near the threshold."""

import pytest

from prefill_gate.proxy.estimate import (
    Calibrator,
    Estimator,
    TiktokenCounter,
    TokenizerJsonCounter,
    UpstreamTokenizeCounter,
    shape_of,
)


class CountingExact:
    def __init__(self, answer=1234, fail=False):
        self.calls, self.answer, self.fail = 0, answer, fail

    async def count(self, shape, model):
        self.calls += 1
        if self.fail:
            raise RuntimeError("tokenizer exploded")
        return self.answer


def chat(text, n=1):
    return {"messages": [{"role": "user", "content": text}] * n}


def test_shape_of_chat_with_parts_tools_and_tool_calls():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"}]},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "tools": [{"type": "function"}]}
    s = shape_of(body, "chat")
    assert s.n_messages == 2 and "abc" in s.text and '"id": "1"' in s.text and '"function"' in s.text


@pytest.mark.parametrize("prompt, ids", [([1, 2, 3], 3), ([[1, 2], [3]], 3), ("hello", None), (["a", "b"], None)])
def test_shape_of_completions(prompt, ids):
    assert shape_of({"prompt": prompt}, "completions").token_ids == ids


async def test_cheap_estimate_far_from_threshold_never_calls_the_exact_counter():
    exact = CountingExact()
    est = Estimator(2048, Calibrator(4.0), exact, band=0.5)
    big = await est.estimate(shape_of(chat("x" * 400_000), "chat"), "m")
    tiny = await est.estimate(shape_of(chat("hi"), "chat"), "m")
    assert exact.calls == 0
    assert big.method == tiny.method == "calibrated"
    assert big.tokens == 100_000 + 8 and tiny.tokens == 0 + 8


async def test_near_threshold_uses_the_exact_counter_and_falls_back_on_failure():
    est = Estimator(2048, Calibrator(4.0), CountingExact(answer=1999), band=0.5)
    e = await est.estimate(shape_of(chat("x" * 8000), "chat"), "m")
    assert (e.tokens, e.method) == (1999, "exact")
    failing = Estimator(2048, Calibrator(4.0), CountingExact(fail=True), band=0.5)
    e = await failing.estimate(shape_of(chat("x" * 8000), "chat"), "m")
    assert (e.tokens, e.method) == (2008, "calibrated")


async def test_token_id_prompts_are_exact():
    e = await Estimator(10).estimate(shape_of({"prompt": list(range(77))}, "completions"), "m")
    assert (e.tokens, e.method) == (77, "token_ids")


def test_calibrator_learns_per_model_and_ignores_tiny_prompts():
    c = Calibrator(4.0)
    for _ in range(Calibrator.MIN_SAMPLES - 1):
        c.observe("m", 10_000, 1, 10_008)  # 1 byte per token
    assert c.ratio("m") == 4.0  # not enough samples yet
    c.observe("m", 10_000, 1, 10_008)
    assert c.ratio("m") == pytest.approx(1.0)
    assert c.ratio("other") == 4.0
    for _ in range(5):
        c.observe("m", 10_000, 1, 5_008)  # 2 bytes per token: now the majority
    assert c.ratio("m") == pytest.approx(2.0)
    c.observe("m", 100, 1, 1000)  # too small to count
    assert c.ratio("m") == pytest.approx(2.0)


def test_a_minority_of_skewed_prompts_cannot_move_the_calibration():
    """Found by an attacker: a dozen emoji-heavy prompts moved a model's ratio from 1.46 to
    3.24 bytes per token, after which another client's 6,000-token prompt passed as
    interactive. The ratio is now a median over recent requests, each clamped."""
    c = Calibrator(4.0)
    for _ in range(20):
        c.observe("m", 14_600, 1, 10_008)  # 1.46 bytes per token
    for _ in range(12):
        c.observe("m", 100_000, 1, 10)  # absurd ratios, clamped to 8
    assert c.ratio("m") == pytest.approx(1.46)


def test_the_calibrator_forgets_models_beyond_its_bound():
    c = Calibrator(4.0)
    for i in range(Calibrator.MAX_MODELS + 50):
        c.observe(f"model-{i}", 10_000, 1, 10_008)
    assert len(c._samples) == Calibrator.MAX_MODELS and "model-0" not in c._samples


async def test_estimator_observe_returns_relative_error_and_recalibrates():
    est = Estimator(2048, Calibrator(4.0))
    e = await est.estimate(shape_of(chat("y" * 4000), "chat"), "m")
    assert e.tokens == 1008
    assert est.observe("m", e, 4008) == pytest.approx(3000 / 4008)
    for _ in range(Calibrator.MIN_SAMPLES - 1):
        est.observe("m", e, 4008)
    e2 = await est.estimate(shape_of(chat("y" * 4000), "chat"), "m")
    assert e2.tokens == 4008


def _tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "tool", "result"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


async def test_tokenizer_json_counter(tmp_path):
    counter = TokenizerJsonCounter(_tokenizer_json(tmp_path))
    n = await counter.count(shape_of(chat("hello world tool result zzz"), "chat"), "m")
    assert n == 5 + 8


async def test_tiktoken_counter_with_a_small_local_encoding():
    import tiktoken

    enc = tiktoken.Encoding(name="tiny", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={})
    counter = TiktokenCounter(enc)
    assert await counter.count(shape_of({"prompt": "abc de"}, "completions"), "m") == 6


async def test_upstream_tokenize_counter_sends_messages_and_checks_the_answer():
    seen = []

    async def post(payload):
        seen.append(payload)
        return {"count": 42}

    body = chat("hello")
    assert await UpstreamTokenizeCounter(post).count(shape_of(body, "chat"), "m") == 42
    assert seen == [{"model": "m", "messages": body["messages"]}]

    async def bad(payload):
        return {"tokens": []}

    with pytest.raises(ValueError, match="integer 'count'"):
        await UpstreamTokenizeCounter(bad).count(shape_of({"prompt": "x"}, "completions"), "m")
