"""A character-level tokenizer for the benchmark clients (vllm bench serve and others need
a local one): one printable ASCII character is one token, as the engine simulator counts
them (prefill_gate/proxy/sim/server.py), so a client's prompt of N tokens is N of the simulator's.

    python3 bench/clients/make_tokenizer.py OUT_DIR
"""

from __future__ import annotations

import json
import pathlib
import string
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

CHARS = string.ascii_letters + string.digits + string.punctuation + " "


def build(out: pathlib.Path) -> None:
    vocab = {"<unk>": 0, "<|endoftext|>": 1}
    vocab.update({c: i + 2 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|endoftext|>",
        "model_max_length": 131072, "clean_up_tokenization_spaces": False}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>", "eos_token": "<|endoftext|>"}))


if __name__ == "__main__":
    build(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "out/clients/tokenizer"))
