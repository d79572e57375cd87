"""Build a non-streaming OpenAI response from the chunks of a streamed one.

With ``protect_non_streaming`` the proxy streams a non-streaming request upstream,
so that it sees the request's decode phase (and can protect it), then answers the
client with the JSON it asked for. Requests that ask for logprobs are not
converted: their chunked form is not worth rebuilding here.
"""

from __future__ import annotations

from typing import Any


def convertible(body: dict) -> bool:
    return not body.get("stream") and not body.get("logprobs") and body.get("echo") is not True


class Assembler:
    def __init__(self, endpoint: str):
        self.chat = endpoint == "chat"
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict] = {}
        self.usage: dict | None = None

    def add(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            return
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            if not isinstance(c, dict):
                continue
            i = c.get("index", 0)
            acc = self.choices.setdefault(i, {"index": i, "finish_reason": None, "text": [], "reasoning": [],
                                              "tool_calls": {}, "role": "assistant"})
            if c.get("finish_reason") is not None:
                acc["finish_reason"] = c["finish_reason"]
            if not self.chat:
                acc["text"].append(c.get("text") or "")
                continue
            delta = c.get("delta") or {}
            acc["role"] = delta.get("role") or acc["role"]
            acc["text"].append(delta.get("content") or "")
            acc["reasoning"].append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            for tc in delta.get("tool_calls") or ():
                slot = acc["tool_calls"].setdefault(tc.get("index", 0), {"type": "function",
                                                                          "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""

    def response(self) -> dict:
        choices = []
        for i in sorted(self.choices):
            acc = self.choices[i]
            if self.chat:
                message: dict[str, Any] = {"role": acc["role"], "content": "".join(acc["text"])}
                if any(acc["reasoning"]):
                    message["reasoning_content"] = "".join(acc["reasoning"])
                if acc["tool_calls"]:
                    message["tool_calls"] = [acc["tool_calls"][k] for k in sorted(acc["tool_calls"])]
                choices.append({"index": i, "message": message, "logprobs": None,
                                "finish_reason": acc["finish_reason"]})
            else:
                choices.append({"index": i, "text": "".join(acc["text"]), "logprobs": None,
                                "finish_reason": acc["finish_reason"]})
        out = {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        return out
