"""Packing: best-fit decreasing, packed rows, collators, padding efficiency, and the proof that packed
and padding-free batches give each example exactly the per-token losses it has when run alone."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.launch import SFT, torchrun
from support.numerics import assert_same_maths
from support.tiny import WORDS, make_tiny_llama_dir, write_chat_jsonl
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from hf_fsdp2.config.sources import DataSource
from hf_fsdp2.data.loader import PaddingCollator, ShardedSampler, build_dataloader
from hf_fsdp2.data.mixture import build_sft_datasets
from hf_fsdp2.data.packing import (
    PackedCollator,
    best_fit_decreasing,
    expected_padding_efficiency,
    pack_examples,
)
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.observe.logs import read_metrics
from hf_fsdp2.train.loss import count_target_tokens, cross_entropy_sum

# ---------------------------------------------------------------------------------------------------
# best-fit decreasing
# ---------------------------------------------------------------------------------------------------


def test_best_fit_decreasing_hand_checked() -> None:
    # Longest first: 8 opens bin 0 (2 left), 7 bin 1 (3 left), 5 bin 2 (5 left); 3 fits best in bin 1
    # (exactly), 2 in bin 0 (exactly), 1 in the only bin with room, bin 2.
    assert best_fit_decreasing([5, 3, 7, 2, 8, 1], 10) == [[4, 3], [2, 1], [0, 5]]
    assert best_fit_decreasing([4, 4, 4], 4) == [[0], [1], [2]]
    assert best_fit_decreasing([], 8) == []


def test_best_fit_decreasing_is_a_valid_deterministic_partition() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 512) for _ in range(5000)]
    bins = best_fit_decreasing(lengths, 512)
    assert bins == best_fit_decreasing(list(lengths), 512)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    # Near-optimal: within 1% of the lower bound on the number of rows.
    assert len(bins) <= 1.01 * -(-sum(lengths) // 512)


def test_best_fit_decreasing_rejects_items_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"Item 1 has length 9, outside \[1, 8\]"):
        best_fit_decreasing([3, 9], 8)


# ---------------------------------------------------------------------------------------------------
# packed rows and collators
# ---------------------------------------------------------------------------------------------------


def toy_examples(lengths: list[int]) -> datasets.Dataset:
    """Examples whose ids are 100*example + position; the first two tokens of each are prompt."""
    records = []
    for e, n in enumerate(lengths):
        ids = [100 * (e + 1) + i for i in range(n)]
        labels = [IGNORE_INDEX if i < 2 else t for i, t in enumerate(ids)]
        records.append(
            {
                "input_ids": ids,
                "labels": labels,
                "length": n,
                "num_targets": sum(x != -100 for x in labels[1:]),
            }
        )
    return datasets.Dataset.from_list(records)


def test_pack_examples_rows_and_collated_tensors() -> None:
    packed = pack_examples(toy_examples([3, 5, 2, 4]), max_length=8)
    assert packed.rows == [[1, 0], [3, 2]]
    assert packed.row_lengths.tolist() == [8, 6]
    assert packed.row_targets.tolist() == [3 + 1, 2 + 0]
    assert packed[1] == {
        "input_ids": [400, 401, 402, 403, 300, 301],
        "labels": [-100, -100, 402, 403, -100, -100],
        "seq_lengths": [4, 2],
    }

    batch = PackedCollator(pad_token_id=0)([packed[0], packed[1]])
    assert set(batch) == {
        "input_ids",
        "labels",
        "position_ids",
    }  # no attention_mask: packing is signalled by positions
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 1]]
    assert batch["input_ids"].tolist() == [
        [200, 201, 202, 203, 204, 100, 101, 102],
        [400, 401, 402, 403, 300, 301, 0, 0],
    ]
    # The first label of every example is -100: nothing is trained across a boundary.
    assert batch["labels"].tolist() == [
        [-100, -100, 202, 203, 204, -100, -100, 102],
        [-100, -100, 402, 403, -100, -100, -100, -100],
    ]
    assert count_target_tokens(batch["labels"]) == int(packed.row_targets.sum())

    flat = PackedCollator(pad_token_id=0, padding_free=True)([packed[0], packed[1]])
    assert flat["input_ids"].shape == (1, 14)
    assert flat["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert count_target_tokens(flat["labels"]) == int(packed.row_targets.sum())

    rounded = PackedCollator(pad_token_id=0, padding_free=True, pad_to_multiple_of=8)([packed[0], packed[1]])
    assert rounded["position_ids"].tolist()[0][14:] == [0, 1]
    assert rounded["labels"].tolist()[0][14:] == [-100, -100]


def test_padding_free_without_packing_flattens_plain_examples() -> None:
    examples = toy_examples([3, 2])
    batch = PackedCollator(pad_token_id=0, padding_free=True)([examples[0], examples[1]])
    assert batch["input_ids"].tolist() == [[100, 101, 102, 200, 201]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, -100, 102, -100, -100]]


def test_packed_collator_rejects_inconsistent_rows() -> None:
    with pytest.raises(ValueError, match="sequence lengths"):
        PackedCollator(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "seq_lengths": [2]}])
    with pytest.raises(ValueError, match="empty batch"):
        PackedCollator(pad_token_id=0)([])


# ---------------------------------------------------------------------------------------------------
# padding efficiency
# ---------------------------------------------------------------------------------------------------


def test_expected_padding_efficiency_matches_the_loader(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(1)
    records = [
        {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 20))),
            "completion": " ".join(rng.choices(WORDS, k=rng.randint(1, 30))),
        }
        for _ in range(60)
    ]
    examples, _ = tokenize_dataset(datasets.Dataset.from_list(records), llama2_tokenizer, max_length=64)
    packed = pack_examples(examples, 64)

    def measured(dataset: Any, collator: Any, batch_size: int) -> float:
        trained = processed = 0
        for rank in range(2):
            sampler = ShardedSampler(len(dataset), rank=rank, world_size=2, seed=3)
            for batch in build_dataloader(dataset, batch_size=batch_size, collator=collator, sampler=sampler):
                trained += count_target_tokens(batch["labels"])
                processed += batch["input_ids"].numel()
        return trained / processed

    lengths, targets = examples["length"][:], examples["num_targets"][:]
    padded = expected_padding_efficiency(lengths, targets, batch_size=4, world_size=2, seed=3)
    assert padded == pytest.approx(measured(examples, PaddingCollator(pad_token_id=0), 4))
    flat = expected_padding_efficiency(
        lengths, targets, batch_size=4, world_size=2, seed=3, padding_free=True
    )
    assert flat == pytest.approx(measured(examples, PackedCollator(pad_token_id=0, padding_free=True), 4))
    rows = expected_padding_efficiency(
        packed.row_lengths, packed.row_targets, batch_size=2, world_size=2, seed=3
    )
    assert rows == pytest.approx(measured(packed, PackedCollator(pad_token_id=0), 2))
    assert padded < rows <= flat <= 1


# ---------------------------------------------------------------------------------------------------
# the proof: packed losses == per-example losses
# ---------------------------------------------------------------------------------------------------


def tiny_llama(vocab_size: int, attn_implementation: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    # float64: packed, padded and alone runs reduce over different shapes (other kernel orders); only the
    # float64 rounding bound (support/numerics.py) is the same on every CPU.
    return model.double().eval()


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token CE at every position (0 where there is no target), shape (batch, seq - 1)."""
    return F.cross_entropy(
        logits[:, :-1].double().transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )


@pytest.fixture(scope="module")
def chat_examples(chatml_tokenizer: PreTrainedTokenizerBase) -> datasets.Dataset:
    rng = random.Random(7)
    records = []
    for _ in range(10):
        turns: list[dict[str, str]] = [{"role": "system", "content": "Echo."}]
        for _ in range(rng.randint(1, 2)):
            turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
        records.append({"messages": turns})
    examples, _ = tokenize_dataset(datasets.Dataset.from_list(records), chatml_tokenizer, max_length=128)
    return examples


@pytest.fixture(scope="module")
def alone_losses(
    chat_examples: datasets.Dataset, chatml_tokenizer: PreTrainedTokenizerBase
) -> dict[int, torch.Tensor]:
    """Reference: the per-token losses of every example run alone (no padding, no packing), plain sdpa.

    One reference for every attention implementation: the models share their weights (same seed), and
    flex_attention compiles a kernel per shape, so running it on ten lengths would take minutes on CPU.
    """
    reference = tiny_llama(len(chatml_tokenizer), "sdpa")
    alone: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(len(chat_examples)):
            ids = torch.tensor([chat_examples[i]["input_ids"]])
            labels = torch.tensor([chat_examples[i]["labels"]])
            alone[i] = per_token_losses(reference(input_ids=ids).logits, labels)[0]
    return alone


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "flex_attention"])
@pytest.mark.usefixtures("fresh_compile_state")
def test_packed_and_padding_free_losses_equal_each_example_alone(
    chat_examples: datasets.Dataset,
    chatml_tokenizer: PreTrainedTokenizerBase,
    alone_losses: dict[int, torch.Tensor],
    attn_implementation: str,
) -> None:
    model = tiny_llama(len(chatml_tokenizer), attn_implementation)
    if attn_implementation == "flex_attention":
        model = model.float()  # flex attention has no float64 kernel on CPU
    packed = pack_examples(chat_examples, max_length=200)
    assert len(packed) < len(chat_examples) and max(len(row) for row in packed.rows) >= 3
    alone = alone_losses
    reference = tiny_llama(len(chatml_tokenizer), "sdpa")  # the weights the reference ran with
    assert all(
        torch.equal(a.double(), b) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )

    vocab = len(chatml_tokenizer)
    # sdpa runs in the inputs' float64; eager takes the attention softmax in float32 whatever the inputs,
    # over rows of at most max_length=200 keys; flex runs in float32 throughout, where the longest reduction
    # is that same attention row (hidden 64, intermediate 128); the losses below are taken in float64.
    terms, rounding = (vocab, torch.float64) if attn_implementation == "sdpa" else (200, torch.float32)

    def check(batch: dict[str, torch.Tensor], row_examples: list[list[int]]) -> None:
        assert "attention_mask" not in batch
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
        losses = per_token_losses(logits, batch["labels"])
        expected_sum = torch.zeros((), dtype=torch.float64)
        for r, members in enumerate(row_examples):
            offset = 0
            for e in members:
                n = len(chat_examples[e]["input_ids"])
                # Position offset + k predicts token k + 1 of example e: the same target as alone[e][k].
                got = losses[r, offset : offset + n - 1]
                assert_same_maths(got, alone[e], terms=terms, rounding=rounding, name=f"example {e}")
                if offset > 0:  # the last token of the previous example predicts nothing
                    assert losses[r, offset - 1].item() == 0.0
                expected_sum += alone[e].double().sum()
                offset += n
        assert count_target_tokens(batch["labels"]) == sum(
            chat_examples[e]["num_targets"] for members in row_examples for e in members
        )
        total = cross_entropy_sum(logits.double(), batch["labels"])
        assert_same_maths(
            total, expected_sum, terms=terms * len(row_examples[0]), rounding=rounding, name="summed loss"
        )

    rows = [packed[i] for i in range(len(packed))]
    check(PackedCollator(pad_token_id=0)(rows), packed.rows)  # packed rows, right-padded
    if attn_implementation == "flex_attention":
        return  # each further shape is one more compilation; the mask is built the same way
    check(PackedCollator(pad_token_id=0, padding_free=True)(rows), [[e for row in packed.rows for e in row]])
    plain = [chat_examples[i] for i in range(len(chat_examples))]
    check(PackedCollator(pad_token_id=0, padding_free=True)(plain), [list(range(len(plain)))])

    # Control: the same packed ids without the restarting positions attend across examples and differ.
    batch = PackedCollator(pad_token_id=0)(rows)
    with torch.no_grad():
        crossed = per_token_losses(
            model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"]
        )
    first, second = packed.rows[0][:2]
    n0 = len(chat_examples[first]["input_ids"])
    with pytest.raises(AssertionError, match="not the same maths"):
        assert_same_maths(
            crossed[0, n0 : n0 + len(alone[second])], alone[second], terms=terms, rounding=rounding
        )


def test_padded_batch_equals_examples_alone(
    chat_examples: datasets.Dataset, chatml_tokenizer: PreTrainedTokenizerBase
) -> None:
    model = tiny_llama(len(chatml_tokenizer), "sdpa")
    batch = PaddingCollator(pad_token_id=0)([chat_examples[i] for i in range(4)])
    with torch.no_grad():
        losses = per_token_losses(
            model(**{k: v for k, v in batch.items() if k != "labels"}).logits, batch["labels"]
        )
        for i in range(4):
            ids = torch.tensor([chat_examples[i]["input_ids"]])
            alone = per_token_losses(model(input_ids=ids).logits, torch.tensor([chat_examples[i]["labels"]]))[
                0
            ]
            assert_same_maths(
                losses[i, : len(alone)], alone, terms=len(chatml_tokenizer), name=f"example {i}"
            )


def test_packed_dataloader_order_is_seeded_and_worker_independent(chat_examples: datasets.Dataset) -> None:
    packed = pack_examples(chat_examples, max_length=128)
    assert np.array_equal(pack_examples(chat_examples, max_length=128).row_lengths, packed.row_lengths)

    def batches(num_workers: int) -> list[list[list[int]]]:
        sampler = ShardedSampler(len(packed), rank=0, world_size=1, seed=5)
        loader = build_dataloader(
            packed,
            batch_size=1,
            collator=PackedCollator(pad_token_id=0),
            sampler=sampler,
            num_workers=num_workers,
        )
        return [b["input_ids"].tolist() for b in loader]

    assert batches(0) == batches(2)


# ---------------------------------------------------------------------------------------------------
# end to end: the 2-rank recipe with packing logs the loss of the examples run alone
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a 2-rank recipe run (~15 s); padding-free batches take the same path (tested above)
def test_packed_recipe_step_loss_equals_examples_alone(tmp_path: Path) -> None:
    model_dir = make_tiny_llama_dir(tmp_path / "model", seed=2)
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 24, seed=4)
    out = tmp_path / "run"
    proc = torchrun(
        SFT,
        [
            "--model_name_or_path",
            str(model_dir),
            "--dataset_name",
            str(data_file),
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--max_length",
            "96",
            "--seed",
            "11",
            "--packing",
            "true",
            "--mixed_precision",
            "no",
            "--export_dtype",
            "float32",
        ],
        nproc=2,
    )
    log = proc.stdout + proc.stderr
    assert "data source" in log and "examples packed (best-fit decreasing) into" in log
    record = read_metrics(out / "metrics.jsonl")[0]

    # Reference, without the recipe: the rows rank 0 and rank 1 took at step 1, every example run alone.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = build_sft_datasets([DataSource(name=str(data_file))], tokenizer, max_length=96, seed=11)
    packed = pack_examples(data.train, 96)
    order = ShardedSampler(len(packed), rank=0, world_size=2, seed=11).global_order(0)
    rows = [row for rank in range(2) for row in order[rank::2][:2]]
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    loss_sum, tokens, processed = 0.0, 0, 0
    with torch.no_grad():
        for row in rows:
            for e in packed.rows[row]:
                ids, labels = (
                    torch.tensor([data.train[e]["input_ids"]]),
                    torch.tensor([data.train[e]["labels"]]),
                )
                loss_sum += cross_entropy_sum(model(input_ids=ids).logits, labels).item()
                tokens += count_target_tokens(labels)
        widths = [int(packed.row_lengths[row]) for row in rows]
        processed = 2 * (max(widths[:2]) + max(widths[2:]))  # each rank pads its 2 rows to the longer
    assert record["target_tokens"] == tokens
    assert record["loss"] == pytest.approx(loss_sum / tokens, rel=1e-5)
    assert record["padding_efficiency"] == pytest.approx(tokens / processed)
