"""What the simulator refuses, and how: as vLLM 0.26.0 does.

Each rule mirrors an answer recorded from a real vLLM server on the H200
(``bench/gpu/vllm_errors.py``; ``tests/fixtures/vllm_errors.json`` holds them, and a test
replays every one against the simulator): the status, the error's ``type``, ``param`` and
``code``. Messages follow vLLM's wording where it is short. The order is vLLM's: the
request's shape first (its pydantic validation: 400 "Bad Request", ``param`` the body
location), then the model (404), then the sampling parameters and lengths (400
"BadRequestError").
"""

from __future__ import annotations

from typing import Any

NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INTEGERS = ("max_tokens", "max_completion_tokens", "n")


class Refusal(Exception):
    def __init__(self, status: int, type_: str, message: str, param: str | None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


def _shape(message: str, loc: str) -> Refusal:
    return Refusal(400, "Bad Request", f"1 validation error: {message}", loc)


def check_shape(body: dict, chat: bool) -> None:
    """vLLM's request models: field types and required fields."""
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise _shape("messages: Field required", "body.messages")
        if not isinstance(messages, list):
            raise _shape("messages: Input should be a valid list", "body.messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                # (the first member of vLLM's message union names the location)
                raise _shape(f"messages.{i}.role: Field required",
                             f"body.messages.{i}.ChatCompletionDeveloperMessageParam.role")
    else:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise Refusal(400, "Bad Request", "1 validation error: Either prompt or prompt_embeds must be "
                          "provided and non-empty.", "prompt")
    for name in NUMBERS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _shape(f"{name}: Input should be a valid number", f"body.{name}")
    for name in INTEGERS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _shape(f"{name}: Input should be a valid integer", f"body.{name}")


def check_model(body: dict, served: str) -> None:
    name = body.get("model")
    if name is not None and name != served:
        raise Refusal(404, "NotFoundError", f"The model `{name}` does not exist.", "model")


def check_sampling(body: dict, chat: bool, max_model_len: int) -> None:
    if chat and not body["messages"]:
        raise Refusal(400, "BadRequestError", "Cannot apply chat template to an empty conversation. "
                      "Provide at least one message.", None)
    temperature = body.get("temperature")
    if temperature is not None and temperature < 0:
        raise Refusal(400, "BadRequestError", f"temperature must be non-negative, got {float(temperature)}.",
                      "temperature")
    top_p = body.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise Refusal(400, "BadRequestError", f"top_p must be in (0, 1], got {float(top_p)}.", "top_p")
    n = body.get("n")
    if n is not None and n < 1:
        raise Refusal(400, "BadRequestError", f"n must be at least 1, got {n}.", None)
    max_tokens = max_tokens_of(body)
    if max_tokens is not None and max_tokens < 1:
        raise Refusal(400, "BadRequestError", f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if max_tokens is not None and max_tokens > max_model_len:
        raise Refusal(400, "BadRequestError", f"max_tokens={max_tokens} cannot be greater than "
                      f"max_model_len={max_model_len}. Please request fewer output tokens.", "max_tokens")


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_tokens >= max_model_len:
        raise Refusal(400, "BadRequestError", f"This model's maximum context length is {max_model_len} tokens. "
                      f"However, your prompt contains at least {prompt_tokens} input tokens.", "input_tokens")
    if prompt_tokens + max_tokens > max_model_len:
        raise Refusal(400, "BadRequestError", f"This model's maximum context length is {max_model_len} tokens. "
                      f"However, you requested {max_tokens} output tokens and your prompt contains "
                      f"{prompt_tokens} input tokens.", "max_tokens")


def max_tokens_of(body: dict) -> Any:
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value
