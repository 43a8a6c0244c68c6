"""Per-sequence log-probs of completions and the reference models of the preference objectives (DPO, KTO, GRPO's KL):
a frozen sharded copy, precomputed log-probs, or the LoRA base with its adapter disabled; and the even per-rank
batches every rank runs in step (evaluation, the precompute pass).

A row's log-prob is the SUM of the log-probs of its completion tokens (TRL's definition).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.train.chunked_ce import accumulation_dtype, head_input_replaced
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.router import router_loss


def completion_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    *,
    sequence_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`row_logps` of the whole rows, under context parallel too: there each rank scores its part of every row
    (:func:`~hf_fsdp2.parallel.all_to_all.shard_sequence`) and the per-row sums are added over the cp group by an
    autograd all-reduce, so every rank of the group holds the whole rows' sums (and backward sends each part's
    gradient back). The counts and the loss over them are then the same on every rank of the group: the callers
    count pairs once per group (:func:`counts_here`)."""
    cp = collectives.cp_size()
    if cp <= 1:
        return row_logps(model, inputs, labels, plan, sequence_labels=sequence_labels)
    from torch.distributed.nn.functional import all_reduce

    from hf_fsdp2.parallel.all_to_all import shard_sequence

    index = collectives.cp_rank()
    # The preference collators pad on the right: no read of the device mask to check it.
    part = shard_sequence({**inputs, "labels": labels}, cp, index, check_padding=False)
    whole = None
    if sequence_labels is not None:
        whole = shard_sequence({**inputs, "labels": sequence_labels}, cp, index, check_padding=False)[
            "labels"
        ]
    part_inputs = {k: v for k, v in part.items() if k != "labels"}
    sums, aux = row_logps(model, part_inputs, part["labels"], plan, sequence_labels=whole)
    return all_reduce(sums, group=collectives.cp_group()), aux


def counts_here() -> bool:
    """Whether this rank adds its batches' pairs, tokens and metrics to the step's sums: every rank, but under context
    parallel one rank per cp group (the group's ranks hold the same pairs and, after :func:`completion_logps`, the
    same sums; summing all of them would count each pair cp_size times)."""
    return collectives.cp_rank() == 0


def row_logps(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    *,
    sequence_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, the summed log-prob of its completion tokens (``labels != -100``), and the router loss.

    With ``plan.chunk_tokens > 0`` (the plan's probe showed the logits are the head's output after elementwise
    post-processing) a pre-hook on the output head hands it the completion positions only, so logits exist for
    completion tokens only; otherwise the full logits are computed and the completion positions picked.

    The completion positions are found where ``labels`` are: pass the host labels (the steps do) and no device
    tensor is read back, the positions go to the device as integer indices.

    ``sequence_labels`` (host, a superset of ``labels``' positions; ORPO's NLL over the chosen prompt + completion):
    the head also runs on those positions, and the sums come back as ``[2, rows]``: over ``labels``' positions,
    then over ``sequence_labels``'.

    Returns:
        ``[rows]`` (or ``[2, rows]``) log-probs (fp32, fp64 for fp64 models) and the router auxiliary loss (or None).
    """
    extra = {"output_router_logits": True} if plan.router_aux_coef else {}
    targets = (labels if sequence_labels is None else sequence_labels)[:, 1:]
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # row-major: the order of a boolean mask
    picked_targets = targets[rows, cols]
    if plan.chunk_tokens > 0:
        head = model.get_output_embeddings()  # type: ignore[operator]

        def completions_only(module: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
            return full[rows.to(full.device), cols.to(full.device)][None]  # position t predicts token t + 1

        # Through the loss's one head hook (held outside the module): a new hook closure per call would be guarded
        # on this batch's completion count and recompile a compiled model every step.
        with head_input_replaced(head, completions_only):
            out = model(**inputs, **extra, use_cache=False)
        logits = out.logits[0]
    else:
        out = model(**inputs, **extra, use_cache=False)
        logits = out.logits[rows.to(out.logits.device), cols.to(out.logits.device)]
    logits = logits.to(accumulation_dtype(logits.dtype))
    picked = logits.gather(-1, picked_targets.to(logits.device)[:, None]).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    aux = (
        router_loss(out, model, inputs) if extra else None
    )  # the micro-batch's global router loss (collective)
    sums = torch.zeros(labels.size(0), dtype=per_token.dtype, device=per_token.device)
    device_rows = rows.to(per_token.device)
    if sequence_labels is None:
        return sums.index_add(0, device_rows, per_token), aux
    completion = (labels[:, 1:][rows, cols] != IGNORE_INDEX).to(per_token.device)  # a host mask, sent once
    in_completion = sums.index_add(0, device_rows, per_token * completion)
    return torch.stack([in_completion, sums.index_add(0, device_rows, per_token)]), aux


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch on ``device``, but for its labels: they stay on the host, where
    :func:`completion_logps` finds the completion positions without reading the device."""
    return {k: v if k == "labels" else v.to(device, non_blocking=True) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------


class Reference(Protocol):
    """Where a micro-batch's reference log-probs come from; every rank calls it on every micro-batch."""

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[2B]`` reference completion log-probs of a micro-batch (:func:`to_device`), without gradient."""
        ...


def row_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no gradient inside; the mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def eval_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], plan: LossPlan) -> torch.Tensor:
    """Completion log-probs in eval mode (no dropout), without gradient; the mode is restored."""
    with evaluating(model):
        logps, _ = completion_logps(model, row_inputs(batch), batch["labels"], plan)
    return logps


@dataclass
class FrozenModel:
    """A second, frozen model (FSDP2-sharded like the policy, no optimizer state) run without gradient."""

    model: torch.nn.Module
    plan: LossPlan

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return eval_logps(self.model, batch, self.plan)


@dataclass
class AdapterDisabled:
    """The LoRA policy with its adapter disabled: the base model it was loaded as, with no second copy."""

    model: torch.nn.Module
    plan: LossPlan

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.model.disable_adapter():  # type: ignore[operator]
            return eval_logps(self.model, batch, self.plan)


@dataclass
class Precomputed:
    """Reference log-probs looked up by pair index in a table computed before training (``[pairs, 2]``)."""

    table: torch.Tensor

    def logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        index = batch["pair_index"].to(self.table.device)
        rows = self.table[index]
        device = batch["input_ids"].device
        return torch.cat([rows[:, 0], rows[:, 1]]).to(device)


def even_batches(
    pairs: Sequence[Any], *, rank: int, world_size: int, batch_size: int, collator: Any
) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
    """This rank's batches of pairs ``rank, rank + world_size, ...``, the same number on every rank.

    Yields:
        ``(collated batch, real)``: after this rank's share, copies of its last batch with ``real=False``
        (run so that every rank takes part in every forward, their results unused).
    """
    n = len(pairs)
    if n == 0 or batch_size < 1:
        raise ValueError(f"needs pairs and batch_size >= 1 (got {n} pairs, batch_size={batch_size})")
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size)
    last = None
    for b in range(per_rank):
        indices = mine[b * batch_size : (b + 1) * batch_size]
        if indices:
            last = collator([pairs[i] for i in indices])
            yield last, True
        else:
            yield (last if last is not None else collator([pairs[0]])), False


def rank_batches(
    pairs: Sequence[Any], *, collator: Any, batch_size: int, device: torch.device
) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
    """This rank's :func:`even_batches` of ``pairs`` (the run's rank and world size), each :func:`to_device`."""
    for batch, real in even_batches(
        pairs,
        rank=collectives.data_rank(),  # a context-parallel group reads the same pairs
        world_size=collectives.data_world(),
        batch_size=batch_size,
        collator=collator,
    ):
        yield to_device(batch, device), real


def precompute_reference(
    reference: Reference, pairs: Sequence[Any], *, collator: Any, batch_size: int, device: torch.device
) -> Precomputed:
    """Every pair's reference log-probs in one pass, the pairs split over the ranks (every rank calls it).

    Returns:
        The table of every pair (``[pairs, 2]``: chosen, rejected; fp64), the same on every rank.
    """
    table = torch.zeros((len(pairs), 2), dtype=torch.float64, device=device)
    for on_device, real in rank_batches(pairs, collator=collator, batch_size=batch_size, device=device):
        logps = reference.logps(on_device).double()
        if real and counts_here():  # written once per cp group: the all-reduce below adds the groups' rows
            b = on_device["pair_index"].numel()
            table[on_device["pair_index"], 0] = logps[:b]
            table[on_device["pair_index"], 1] = logps[b:]
    return Precomputed(collectives.all_reduce_sum(table))
