"""Record how a real vLLM server answers requests it refuses (status and JSON body), so that
the simulator can be made to refuse the same requests the same way and tests of error
paths against it mean something (tests/fixtures/vllm_errors.json).

    python3 bench/gpu/vllm_errors.py --base-url http://127.0.0.1:8001 --model m --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import httpx

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from prefill_gate.proxy.bench.report import git_state  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def cases(model: str) -> list[tuple[str, str, dict]]:
    """(name, path, body): requests vLLM 0.26 refuses (and two it takes, as controls)."""
    hi = [{"role": "user", "content": "hi"}]
    return [
        ("ok_chat", CHAT, {"model": model, "messages": hi, "max_tokens": 1}),
        ("ok_completions", COMPLETIONS, {"model": model, "prompt": "hi", "max_tokens": 1}),
        ("unknown_model", CHAT, {"model": "gpt-9", "messages": hi, "max_tokens": 1}),
        ("empty_messages", CHAT, {"model": model, "messages": [], "max_tokens": 1}),
        ("message_without_role", CHAT, {"model": model, "messages": [{"content": "hi"}], "max_tokens": 1}),
        ("messages_missing", CHAT, {"model": model, "max_tokens": 1}),
        ("messages_not_a_list", CHAT, {"model": model, "messages": "hi", "max_tokens": 1}),
        ("temperature_a_string", CHAT, {"model": model, "messages": hi, "temperature": "hot"}),
        ("temperature_negative", CHAT, {"model": model, "messages": hi, "temperature": -1}),
        ("max_tokens_zero", CHAT, {"model": model, "messages": hi, "max_tokens": 0}),
        ("max_tokens_negative", CHAT, {"model": model, "messages": hi, "max_tokens": -5}),
        ("max_tokens_over_context", CHAT, {"model": model, "messages": hi, "max_tokens": 10_000_000}),
        ("n_zero", CHAT, {"model": model, "messages": hi, "n": 0, "max_tokens": 1}),
        ("stream_a_string", CHAT, {"model": model, "messages": hi, "stream": "yes", "max_tokens": 1}),
        ("prompt_missing", COMPLETIONS, {"model": model, "max_tokens": 1}),
        ("prompt_unknown_model", COMPLETIONS, {"model": "gpt-9", "prompt": "hi", "max_tokens": 1}),
        ("prompt_too_long", COMPLETIONS, {"model": model, "prompt": "hello " * 60_000, "max_tokens": 1}),
        ("top_p_zero", CHAT, {"model": model, "messages": hi, "top_p": 0, "max_tokens": 1}),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    out = {"command": " ".join(sys.argv), "machine": platform.node(), **git_state(), "cases": []}
    with httpx.Client(base_url=args.base_url, timeout=60) as c:
        out["server_version"] = c.get("/version").json().get("version")
        for name, path, body in cases(args.model):
            r = c.post(path, json=body)
            try:
                answer = r.json()
            except ValueError:
                answer = r.text[:2000]
            if r.status_code == 200:
                answer = {"object": answer.get("object")} if isinstance(answer, dict) else answer
            out["cases"].append({"name": name, "path": path, "body": body if name != "prompt_too_long" else
                                 {**body, "prompt": "hello * 60000"}, "status": r.status_code, "answer": answer})
            print(f"{name:28s} {r.status_code}  {json.dumps(answer)[:150]}")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
