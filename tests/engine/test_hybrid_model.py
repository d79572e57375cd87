"""The hybrid model folder the H200 runs serve (bench/gpu/hybrid_model.py): vLLM's own state
arithmetic gives it the report's align-mode block, and the folder is what vLLM reads."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("vllm")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("hybrid_model", ROOT / "bench/gpu/hybrid_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reports_block_of_1568_under_its_setting_and_on_one_gpu_with_fp8():
    hm = load()
    assert hm.align_block(tp=2, kv_cache_dtype="fp8") == 1568  # the report: 2 GPUs, 8-bit cache
    assert hm.align_block(tp=1, kv_cache_dtype="fp8") == 1568  # what the H200 runs use
    assert hm.align_block(tp=1, kv_cache_dtype="auto") == 784


def test_folder_has_the_text_shape_and_the_tokenizer(tmp_path):
    hm = load()
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in hm.TOKENIZER_FILES:
        (tok / name).write_text("{}")
    hm.write(tok, tmp_path / "model")
    config = json.loads((tmp_path / "model/config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["layer_types"].count("full_attention") == 16 and len(text["layer_types"]) == 64
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(("config.json",) + hm.TOKENIZER_FILES)
