"""Token-level cross entropy normalised by the global number of target tokens of an optimizer step.

The loss of a step is ``sum of per-token CE over every target token of every micro-batch on every
rank / number of those tokens``: a long example weighs as much per token as a short one, whatever
the micro-batch split, the accumulation or the number of ranks (not a mean of per-batch means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

IGNORE_INDEX = -100


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss in a batch of unshifted labels (the first position never does).

    Args:
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        The number of (shifted) target tokens.
    """
    return int((labels[:, 1:] != IGNORE_INDEX).sum().item())


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed and accumulated in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy over the target tokens, in fp32 (fp64 for fp64 logits).

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        A scalar fp32 tensor: the summed loss (0 when there is no target token).
    """
    # Shift the labels (pad one ignored position at the end), not the logits: slicing the logits would
    # copy the whole [tokens x vocab] tensor, and its gradient again in backward.
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].to(logits.device)
    return F.cross_entropy(
        logits.to(accumulation_dtype(logits.dtype)).reshape(-1, logits.size(-1)),
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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T`` over chunks of rows; gradients computed in forward, chunk by chunk.

    Only one ``[chunk x vocab]`` fp32 block exists at a time; backward scales the saved gradients
    (``[tokens x hidden]`` and ``[vocab x hidden]`` fp32) by the incoming gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        acc = accumulation_dtype(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.size(0), chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            valid = t != IGNORE_INDEX
            safe = t.clamp(min=0)
            logits = (h @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            # d(sum CE)/d logits = softmax - one-hot, on target rows only; computed in place.
            probs = logits.sub_(lse[:, None]).exp_()
            probs[torch.arange(probs.size(0), device=probs.device), safe] -= 1.0
            probs.mul_(valid[:, None])
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = (probs @ weight.to(acc)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(probs.t(), h.to(acc))
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight if grad_weight is not None else torch.empty(0),
        )
        ctx.has_grads = (grad_hidden is not None, grad_weight is not None)  # type: ignore[attr-defined]
        ctx.weight_dtype = weight.dtype  # type: ignore[attr-defined]
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        has_h, has_w = ctx.has_grads  # type: ignore[attr-defined]
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if has_h else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if has_w else None  # type: ignore[attr-defined]
        return gh, gw, None, None


def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Summed CE of ``hidden @ weight.T`` against ``targets`` without the full logits.

    Args:
        hidden: ``[tokens, hidden]`` final hidden states (already shifted: row i predicts targets[i]).
        weight: ``[vocab, hidden]`` output-head weight.
        targets: ``[tokens]`` next-token ids, ``-100`` where no loss.
        chunk_tokens: rows per chunk.

    Returns:
        A scalar fp32 tensor whose gradients match ``F.cross_entropy(hidden @ weight.T, reduction="sum")``.
    """
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens)


def causal_lm_loss_sum(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, *, chunk_tokens: int
) -> torch.Tensor:
    """Run the model and return the summed next-token cross entropy over the target tokens.

    With ``chunk_tokens > 0`` and more tokens than that in the batch, the full ``[tokens x vocab]``
    logits are never materialised: a forward pre-hook on the output head takes the final hidden
    states and the head's weight *inside* the head's own call (so FSDP2 has gathered the weight
    and attaches its gradient reduction as for any call), computes the loss and its gradients
    chunk by chunk (:func:`chunked_linear_cross_entropy_sum`), and lets the head itself run on one
    position only. Loss and gradients equal the plain path's (tests/unit/test_loss.py, fp32, 1e-5;
    tests/distributed/test_parity.py under FSDP2).

    Args:
        model: a causal LM with ``get_output_embeddings()`` returning a bias-free linear head.
        inputs: forward keyword arguments (input_ids and attention_mask or position_ids).
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.
        chunk_tokens: rows per chunk; 0 disables chunking.

    Returns:
        A scalar fp32 tensor: the summed loss.

    Raises:
        ValueError: the model has no bias-free linear output head to chunk over.
    """
    if chunk_tokens <= 0 or labels.numel() <= chunk_tokens:
        return cross_entropy_sum(model(**inputs, use_cache=False).logits, labels)
    head = model.get_output_embeddings()  # type: ignore[operator]
    if (
        not isinstance(head, torch.nn.Module)
        or getattr(head, "bias", None) is not None
        or getattr(head, "weight", None) is None
    ):
        raise ValueError(
            f"{type(model).__name__} has no bias-free linear output head to chunk the loss over; "
            "set ce_chunk_tokens=0"
        )
    result: list[torch.Tensor] = []
    targets = labels[:, 1:].reshape(-1)

    def loss_inside_head(module: torch.nn.Module, args: tuple) -> tuple:
        full = args[0]
        hidden = full[:, :-1].reshape(-1, full.size(-1))
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        result.append(chunked_linear_cross_entropy_sum(hidden, weight, targets.to(full.device), chunk_tokens))
        return (full[:, -1:], *args[1:])

    handle = head.register_forward_pre_hook(loss_inside_head)
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return result[0]
