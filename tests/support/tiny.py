"""Tiny random-init Llama models with a real tokenizer, and small datasets, for fast tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "red",
    "green",
    "blue",
    "one",
    "two",
    "three",
]


def make_tiny_llama_dir(
    path: Path, *, tie_word_embeddings: bool = False, seed: int = 0, layers: int = 2
) -> Path:
    """Save a 2-layer, 64-wide Llama with the cut Llama-2 tokenizer (2,097 ids with ChatML's markers; conftest.py's
    :func:`small_llama2_tokenizer_json`) and the ChatML template to ``path``."""
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return path


def save_tokenizer(tokenizer, path: Path) -> None:  # type: ignore[no-untyped-def]
    """``tokenizer.save_pretrained(path)``, with the added tokens listed in tokenizer_config.json as
    ``added_tokens_decoder``, as hub tokenizers saved by transformers 4 have them. Without that list transformers 5
    parses the whole tokenizer.json (3.6 MB for the whole Llama-2 vocabulary) in Python to find them: ~0.2 s more of every load, paid by each
    rank of each launched run and each export's reload. The tokenizer loaded is the same (tests/unit/test_data.py
    checks it)."""
    tokenizer.save_pretrained(path)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def write_pairs_jsonl(path: Path, n: int, *, seed: int = 0) -> Path:
    """``n`` string preference pairs (``prompt``, ``chosen``, ``rejected``) of random lengths."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            a, b = (" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(2))
            fh.write(json.dumps({"prompt": q, "chosen": " " + a, "rejected": " " + b}) + "\n")
    return path


def write_unpaired_jsonl(path: Path, n: int, *, seed: int = 0, desirable: float = 0.6) -> Path:
    """``n`` string KTO records (``prompt``, ``completion``, ``label``) of random lengths, about ``desirable`` of
    them labelled true, in random order (so micro-batches hold different mixes)."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            a = " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))
            fh.write(
                json.dumps({"prompt": q, "completion": " " + a, "label": rng.random() < desirable}) + "\n"
            )
    return path


def write_chat_jsonl(path: Path, n: int, *, seed: int = 0, max_words: int = 12) -> Path:
    """``n`` chat records of random lengths (so micro-batches hold unequal numbers of target tokens)."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            question = " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))
            answer = " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))
            record = {
                "messages": [
                    {"role": "system", "content": "Echo."},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
            fh.write(json.dumps(record) + "\n")
    return path
