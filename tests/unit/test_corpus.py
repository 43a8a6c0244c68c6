"""Continued pre-training rows: every token of every document a target exactly once, full rows, a document cut
across rows trained as its pieces alone, and a streamed corpus resumed exactly."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F
from conftest import build_llama2_test_tokenizer
from support.numerics import assert_same_maths
from support.tiny import WORDS
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.data.corpus import (
    RowBuilder,
    StreamingRows,
    best_fit_rows,
    concat_rows,
    document_ids,
    split_document,
    target_positions,
)
from hf_fsdp2.data.packing import PackedCollator

IGNORE = -100


def _docs(n: int, seed: int = 0, longest: int = 90) -> list[list[int]]:
    """Documents of token ids 1000 * doc + position, so every token says where it came from."""
    rng = random.Random(seed)
    return [[1000 * d + i for i in range(rng.randint(1, longest))] for d in range(n)]


def _targets(rows: list[dict]) -> Counter:
    """How often each (document, position) token is a target over the rows (as the collator masks them)."""
    seen: Counter = Counter()
    for row in rows:
        for i in target_positions(row):
            seen[divmod(row["input_ids"][i], 1000)] += 1
    return seen


@pytest.mark.parametrize("max_length", [7, 32, 128])
def test_concat_rows_are_full_and_every_token_is_a_target_once(max_length: int) -> None:
    docs = _docs(60)
    rows = concat_rows(docs, max_length)
    # Full rows but the last; a row stops one short when only a document's first token would fit (it is no
    # target, and the document must start with it in the next row).
    assert all(len(r["input_ids"]) >= max_length - 1 for r in rows[:-1])
    assert sum(len(r["input_ids"]) for r in rows) <= sum(len(d) for d in docs) + 2 * len(rows)
    expected = Counter({(d, i): 1 for d, doc in enumerate(docs) for i in range(1, len(doc))})
    assert _targets(rows) == expected  # every token but each document's first, exactly once
    assert sum(r["seq_lengths"] == [len(r["input_ids"])] for r in rows) < len(rows)  # documents kept apart


@pytest.mark.parametrize("max_length", [7, 32])
def test_best_fit_rows_keep_every_target_once(max_length: int) -> None:
    docs = _docs(60, seed=1)
    rows = best_fit_rows(docs, max_length)
    assert all(len(r["input_ids"]) <= max_length for r in rows)
    assert _targets(rows) == Counter({(d, i): 1 for d, doc in enumerate(docs) for i in range(1, len(doc))})


def test_cross_document_attention_makes_one_sequence_per_row() -> None:
    docs = _docs(40, seed=2)
    rows = concat_rows(docs, 32, cross_document_attention=True)
    assert all(len(r["seq_lengths"]) == 1 for r in rows)
    seen = _targets(rows)
    # Each document's later tokens exactly once; a document's first token at most once (its predecessor's EOS
    # may predict it within a row).
    assert all(seen[(d, i)] == 1 for d, doc in enumerate(docs) for i in range(1, len(doc)))
    assert all(seen[(d, 0)] <= 1 for d in range(len(docs)))


def test_split_document_pieces_overlap_by_one_token() -> None:
    assert split_document(list(range(10)), 4, 4) == [(0, 4), (3, 7), (6, 10)]
    assert split_document(list(range(3)), 4, 4) == [(0, 3)]


def test_a_document_cut_across_rows_trains_as_its_pieces_alone() -> None:
    """Per-token losses of a document cut over two rows equal those of the same pieces run alone (float64)."""
    config = LlamaConfig(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double().eval()
    gen = random.Random(3)
    docs = [[gen.randrange(3, 200) for _ in range(n)] for n in (10, 45, 9)]  # the 45-token one is cut
    rows = concat_rows(docs, 24)
    batch = PackedCollator(pad_token_id=0)(rows)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
    losses = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=IGNORE, reduction="none"
    )
    for r, row in enumerate(rows):
        start = 0
        for n in row["seq_lengths"]:
            piece = torch.tensor([row["input_ids"][start : start + n]])
            with torch.no_grad():
                alone = model(input_ids=piece).logits
            alone_losses = F.cross_entropy(alone[0, :-1], piece[0, 1:], reduction="none")
            assert_same_maths(
                losses[r, start : start + n - 1], alone_losses, terms=200, rounding=torch.float32
            )
            start += n


def test_document_ids_end_with_eos() -> None:
    tokenizer = build_llama2_test_tokenizer()
    ids = document_ids(tokenizer, "alpha bravo")
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id and len(ids) > 3


def test_streamed_rows_resume_exactly_across_epochs(tmp_path: Path) -> None:
    from datasets.distributed import split_dataset_by_node

    rng = random.Random(0)
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(1, 80)))}) + "\n" for _ in range(25)
        )
    )
    tokenizer = build_llama2_test_tokenizer()

    def rows_for(rank: int) -> StreamingRows:
        docs = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
        return StreamingRows(split_dataset_by_node(docs, rank=rank, world_size=2), tokenizer, 24)

    uninterrupted = iter(rows_for(1))
    expected = [next(uninterrupted) for _ in range(40)]  # more than one epoch of this rank's slice
    first = rows_for(1)
    iterator = iter(first)
    head = [next(iterator) for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = rows_for(1)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert head + [next(iterator) for _ in range(31)] == expected
    assert resumed.epoch >= 1


def test_row_builder_carries_the_rest_of_a_cut_document() -> None:
    builder = RowBuilder(max_length=8)
    rows = list(builder.add(list(range(20))))
    assert [r["input_ids"] for r in rows] == [list(range(8)), list(range(7, 15))]
    assert builder.ids == list(range(14, 20)) and builder.carry == []
