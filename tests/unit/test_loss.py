"""Unit tests for hf_fsdp2.loss: target counting, summed CE, global-token normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fsdp2.loss import IGNORE_INDEX, backward_scale, count_target_tokens, cross_entropy_sum

X = IGNORE_INDEX


def test_count_target_tokens_skips_first_position() -> None:
    labels = torch.tensor(
        [
            [5, 6, X, 7],  # shifted targets 6, 7 -> 2 (the 5 at position 0 never counts)
            [X, X, 8, X],  # shifted target 8 -> 1
        ]
    )
    assert count_target_tokens(labels) == 3
    assert isinstance(count_target_tokens(labels), int)


def test_count_target_tokens_first_position_only_is_zero() -> None:
    assert count_target_tokens(torch.tensor([[9, X, X]])) == 0
    assert count_target_tokens(torch.full((2, 5), X)) == 0
    assert count_target_tokens(torch.tensor([[1, 2, 3], [4, 5, 6]])) == 4


def log_softmax_by_hand(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(v) for v in row))


def test_cross_entropy_sum_matches_hand_computation() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [100.0, -7.0, 5.0]]
    logits = torch.tensor([rows])
    labels = torch.tensor([[X, 2, 0]])
    # position 0 predicts labels[1] = 2, position 1 predicts labels[2] = 0; position 2 predicts nothing.
    expected = -log_softmax_by_hand(rows[0], 2) - log_softmax_by_hand(rows[1], 0)
    assert expected == pytest.approx(math.log(math.e + math.e**2 + math.e**3) - 3 + math.log(3))
    loss = cross_entropy_sum(logits, labels)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_sum_ignores_masked_positions_and_last_logits() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 1.0, -2.0]]
    labels = torch.tensor([[7, X, 0]])  # only position 1 -> label 0 counts
    loss = cross_entropy_sum(torch.tensor([rows]), labels)
    assert loss.item() == pytest.approx(math.log(3), rel=1e-6)
    # The logits of a position whose target is -100, and of the last position, do not matter.
    changed = [[50.0, -50.0, 9.0], [0.0, 0.0, 0.0], [-30.0, 30.0, 0.0]]
    assert cross_entropy_sum(torch.tensor([changed]), labels).item() == pytest.approx(math.log(3), rel=1e-6)


def test_cross_entropy_sum_over_a_batch_adds_rows() -> None:
    rows_a = [[1.0, 2.0, 3.0], [0.5, 0.0, -0.5]]
    rows_b = [[0.0, 1.0, 0.0], [2.0, 2.0, 2.0]]
    logits = torch.tensor([rows_a, rows_b])
    labels = torch.tensor([[X, 1], [X, 1]])
    expected = -log_softmax_by_hand(rows_a[0], 1) - log_softmax_by_hand(rows_b[0], 1)
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_sum_without_targets_is_zero() -> None:
    loss = cross_entropy_sum(torch.randn(2, 4, 5), torch.full((2, 4), X))
    assert loss.item() == 0.0


def test_cross_entropy_sum_is_fp32_for_bf16_logits() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    loss = cross_entropy_sum(torch.tensor([rows], dtype=torch.bfloat16), torch.tensor([[X, 2]]))
    assert loss.dtype == torch.float32
    # 1, 2, 3 and 0 are exact in bf16, so the value is the fp32 one.
    assert loss.item() == pytest.approx(-log_softmax_by_hand(rows[0], 2), rel=1e-6)


def test_backward_scale() -> None:
    assert backward_scale(0, 4) == 0.0
    assert backward_scale(-3, 2) == 0.0
    assert backward_scale(10, 2) == pytest.approx(0.2)
    assert backward_scale(7, 1) == pytest.approx(1 / 7)


# ---------------------------------------------------------------------------------------------------
# The normalisation property: 2 simulated ranks x 2 micro-batches with unequal target counts
# ---------------------------------------------------------------------------------------------------

VOCAB = 5
WORLD = 2


def make_step() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[rank][micro_batch] -> (inputs [b, s, 3], labels [b, s])`` with very unequal target counts."""
    gen = torch.Generator().manual_seed(0)

    def labels(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows)

    label_sets = [
        [labels([[1, 2, 3, 4, 0, 1]]), labels([[X, X, X, X, X, 2]])],  # rank 0: 5 then 1 targets
        [labels([[X, 3, X, X, X, X], [X, X, 4, X, X, X]]), labels([[0, 1, 2, 3, 4, 0]])],  # rank 1: 2 then 5
    ]
    return [
        [(torch.randn(lab.shape[0], lab.shape[1], 3, generator=gen), lab) for lab in rank]
        for rank in label_sets
    ]


def per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Per-target-token CE, by log-softmax and indexing (independent of cross_entropy_sum)."""
    out = []
    logp = torch.log_softmax(logits.float(), dim=-1)
    for b in range(labels.shape[0]):
        for s in range(1, labels.shape[1]):
            target = int(labels[b, s])
            if target != X:
                out.append(-logp[b, s - 1, target])
    return out


def test_step_data_has_unequal_counts() -> None:
    counts = [[count_target_tokens(lab) for _, lab in rank] for rank in make_step()]
    assert counts == [[5, 1], [2, 5]]


def test_scaled_micro_batch_losses_give_the_global_token_mean() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(3, VOCAB)
    step = make_step()
    global_tokens = sum(count_target_tokens(lab) for rank in step for _, lab in rank)
    assert global_tokens == 13

    with torch.no_grad():
        all_tokens = [ce for rank in step for x, lab in rank for ce in per_token_ce(head(x), lab)]
        global_mean = torch.stack(all_tokens).mean().item()
        # What each rank accumulates, then FSDP's average over ranks.
        per_rank = [
            sum(cross_entropy_sum(head(x), lab) * backward_scale(global_tokens, WORLD) for x, lab in rank)
            for rank in step
        ]
        reported = (sum(per_rank) / WORLD).item()
        mean_of_means = (
            sum(
                (cross_entropy_sum(head(x), lab) / count_target_tokens(lab)).item()
                for rank in step
                for x, lab in rank
            )
            / 4
        )

    assert len(all_tokens) == 13
    assert reported == pytest.approx(global_mean, rel=1e-6)
    # The property is not vacuous: the mean of per-batch means is a different number for this data.
    assert abs(mean_of_means - global_mean) > 1e-3


def test_accumulated_gradient_equals_gradient_of_global_token_mean() -> None:
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, VOCAB)
    step = make_step()
    global_tokens = sum(count_target_tokens(lab) for rank in step for _, lab in rank)

    # Reference: one backward of the mean over every target token of the step.
    reference.zero_grad()
    all_tokens = [ce for rank in step for x, lab in rank for ce in per_token_ce(reference(x), lab)]
    torch.stack(all_tokens).mean().backward()
    expected = [p.grad.clone() for p in reference.parameters()]

    # Each simulated rank holds a replica, accumulates scaled micro-batch losses, then grads are averaged.
    rank_grads = []
    for rank in step:
        replica = torch.nn.Linear(3, VOCAB)
        replica.load_state_dict(reference.state_dict())
        for x, lab in rank:
            (cross_entropy_sum(replica(x), lab) * backward_scale(global_tokens, WORLD)).backward()
        rank_grads.append([p.grad.clone() for p in replica.parameters()])
    averaged = [(g0 + g1) / WORLD for g0, g1 in zip(*rank_grads, strict=True)]

    for got, want in zip(averaged, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in expected)

    # And it differs from the gradient of the mean of per-batch means.
    reference.zero_grad()
    mean_of_means = (
        sum(
            cross_entropy_sum(reference(x), lab) / count_target_tokens(lab)
            for rank in step
            for x, lab in rank
        )
        / 4
    )
    mean_of_means.backward()
    assert not torch.allclose(reference.weight.grad, expected[0], rtol=1e-3, atol=1e-5)


def test_step_without_targets_has_zero_gradient() -> None:
    head = torch.nn.Linear(3, VOCAB)
    labels = torch.full((1, 4), X)
    loss = cross_entropy_sum(head(torch.randn(1, 4, 3)), labels) * backward_scale(
        count_target_tokens(labels), WORLD
    )
    loss.backward()
    assert loss.item() == 0.0
    assert head.weight.grad is not None and head.weight.grad.abs().sum().item() == 0.0
