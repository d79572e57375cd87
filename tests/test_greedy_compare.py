"""bench/gpu/greedy_compare.py: two servers' greedy answers side by side, or one server's saved
and compared with another's later (a card that holds one 27B server at a time)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "greedy_compare.py"


@pytest.fixture
def greedy(monkeypatch):
    spec = importlib.util.spec_from_file_location("greedy_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_says_where_answers_part(greedy):
    rows = greedy.compare(["a", "bb", "ccc"], [[1, 2, 3], [1, 2, 3], [1, 2]], [[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert [r["identical"] for r in rows] == [True, False, False]
    assert [r["first_difference"] for r in rows] == [None, 1, 2]  # the last: one answer ended early
    assert [r["prompt_chars"] for r in rows] == [1, 2, 3]


def test_save_then_against_another_server(greedy, monkeypatch, tmp_path, capsys):
    served = {"http://a": lambda p: [len(p), 1, 2], "http://b": lambda p: [len(p), 1, 2 if len(p) % 2 else 3]}

    async def answers(url, prompts, max_tokens):
        return [served[url](p)[:max_tokens] for p in prompts]

    monkeypatch.setattr(greedy, "answers", answers)
    saved, out = tmp_path / "a.json", tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["greedy_compare.py", "http://a", "--save", str(saved), "--prompts", "6"])
    assert greedy.main() == 0
    assert len(json.loads(saved.read_text())["answers"]) == 6
    monkeypatch.setattr(sys, "argv", ["greedy_compare.py", "http://b", "--against", str(saved), "--json", str(out),
                                      "--prompts", "6"])
    assert greedy.main() == 0
    result = json.loads(out.read_text())
    odd = sum(len(p) % 2 == 1 for p in json.loads(saved.read_text())["prompts"])
    assert result["identical"] == odd and "saved in" in result["a"] and result["b"] == "http://b"
    assert all(r["first_difference"] in (None, 2) for r in result["rows"])
    # other prompts than the saved ones: refused, not compared
    monkeypatch.setattr(sys, "argv", ["greedy_compare.py", "http://b", "--against", str(saved), "--json", str(out),
                                      "--prompts", "5"])
    with pytest.raises(SystemExit) as exit_:
        greedy.main()
    assert exit_.value.code == 2 and "other prompts" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["http://a"], ["http://a", "http://b"], ["http://a", "--save", "x", "--json", "y"],
                                  ["http://a", "http://b", "--against", "x", "--json", "y"]])
def test_it_refuses_a_muddled_command(greedy, monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["greedy_compare.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        greedy.main()
    assert exit_.value.code == 2
