"""Context parallel's host side: how a batch is cut into parts, the mask the attention builds from whole-row
positions, the loss of a part whose labels carry its last target, and the recipes that refuse cp_size > 1."""

from __future__ import annotations

import pytest
import torch

from hf_fsdp2.config import ConfigError, parse_config
from hf_fsdp2.config.plans import MeshPlan
from hf_fsdp2.methods import get_method
from hf_fsdp2.parallel.all_to_all import (
    POSITIONS_KEY,
    ContextParallelError,
    allowed_pairs,
    shard_sequence,
)
from hf_fsdp2.run.registry import check_capabilities
from hf_fsdp2.train.loss import count_target_tokens, cross_entropy_sum, shifted_target_rows


def _batch(width: int = 7) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 2 * width + 1).reshape(2, width)
    labels = ids.clone()
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def test_parts_pad_to_a_multiple_and_carry_the_next_parts_first_label() -> None:
    batch = _batch(7)  # 7 tokens over 2 ranks: padded to 8, parts of 4
    first, second = (shard_sequence(batch, 2, i) for i in range(2))
    assert first["input_ids"].tolist() == [[1, 2, 3, 4], [8, 9, 10, 11]]
    assert second["input_ids"].tolist() == [[5, 6, 7, 0], [12, 13, 14, 0]]
    # Labels one column wider: the label after each part's last position (token 5 follows token 4).
    assert first["labels"].tolist() == [[-100, 2, 3, 4, 5], [-100, 9, 10, 11, 12]]
    assert second["labels"].tolist() == [[5, 6, 7, -100, -100], [12, 13, 14, -100, -100]]
    # transformers numbers a padded row 0..n-1; the parts keep those positions; no whole-row positions needed.
    assert (
        first["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
        and second["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    )
    assert POSITIONS_KEY not in first and "attention_mask" not in first
    # Every target once: the parts' counts add up to the batch's.
    assert sum(count_target_tokens(p["labels"]) for p in (first, second)) == count_target_tokens(
        batch["labels"]
    )
    assert shifted_target_rows(first["labels"]).numel() == count_target_tokens(first["labels"])


def test_packed_rows_keep_their_documents_and_the_padding_is_a_document_of_its_own() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    batch = {"input_ids": torch.arange(5)[None], "labels": torch.arange(5)[None], "position_ids": positions}
    part = shard_sequence(batch, 2, 1)
    assert part["position_ids"].tolist() == [[0, 1, 0]]
    assert part[POSITIONS_KEY].tolist() == [[0, 1, 2, 0, 1, 0]]  # the pad position starts a new document
    allowed = allowed_pairs(part[POSITIONS_KEY], 6, None, torch.device("cpu"))[0, 0].int()
    assert allowed.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    window = allowed_pairs(None, 4, 2, torch.device("cpu"))[0, 0].int()  # sliding window 2: q - k < 2
    assert window.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_left_padding_is_refused_naming_the_fix() -> None:
    batch = _batch(4)
    batch["attention_mask"] = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ContextParallelError, match="right-padded.*padding_side to 'right'"):
        shard_sequence(batch, 2, 0)


def test_the_loss_of_the_parts_is_the_loss_of_the_whole() -> None:
    torch.manual_seed(0)
    batch = _batch(7)
    batch["labels"][1, 5:] = -100
    batch["labels"] = torch.where(batch["labels"] < 0, -100, batch["labels"] % 20)  # a vocabulary of 20
    logits = torch.randn(2, 7, 20, dtype=torch.float64)
    whole = cross_entropy_sum(logits, batch["labels"])
    padded = torch.cat(
        [logits, torch.zeros(2, 1, 20, dtype=torch.float64)], dim=1
    )  # the pad position's logits
    parts = [
        cross_entropy_sum(padded[:, 4 * i : 4 * i + 4], shard_sequence(batch, 2, i)["labels"])
        for i in range(2)
    ]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-12)


def test_recipes_that_score_whole_sequences_refuse_cp() -> None:
    cfg, cp2 = (
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]),
        MeshPlan(cp=2),
    )
    for name in ("kto", "rm", "grpo"):
        with pytest.raises(
            ConfigError, match=f"cp_size=2 is not supported by the {name} recipe.*sft, cpt and dpo"
        ):
            check_capabilities(get_method(name), cfg, cp2)
    for name in ("sft", "cpt", "dpo"):
        check_capabilities(get_method(name), cfg, cp2)
