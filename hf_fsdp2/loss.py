"""Token-level cross entropy normalised by the global number of target tokens of an optimizer step.

The loss of a step is ``sum of per-token CE over every target token of every micro-batch on every
rank / number of those tokens``: a long example weighs as much per token as a short one, whatever
the micro-batch split, the accumulation or the number of ranks (not a mean of per-batch means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss in a batch of unshifted labels (the first position never does).

    Args:
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        The number of (shifted) target tokens.
    """
    return int((labels[:, 1:] != IGNORE_INDEX).sum().item())


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy over the target tokens, in fp32.

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        A scalar fp32 tensor: the summed loss (0 when there is no target token).
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def backward_scale(global_target_tokens: int, world_size: int) -> float:
    """Factor applied to a micro-batch's summed loss before backward.

    FSDP2 averages gradients over the ``world_size`` ranks in its reduce-scatter; multiplying by
    ``world_size / global_target_tokens`` makes the accumulated gradient that of the step's loss:
    the sum over all target tokens of all micro-batches and ranks divided by their count.

    Args:
        global_target_tokens: target tokens in the whole step, summed over ranks and micro-batches.
        world_size: ranks that average gradients.

    Returns:
        The scale; 0.0 for a step without any target token (its gradient is then zero).
    """
    if global_target_tokens <= 0:
        return 0.0
    return world_size / global_target_tokens
