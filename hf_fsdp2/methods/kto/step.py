"""KTO (Kahneman-Tversky optimisation) on unpaired data: the step and the evaluation, as TRL 1.16's ``KTOTrainer``.

A micro-batch holds B examples as B rows of prompt + completion, then B rows of prompt + another example's completion
(the KL rows, :mod:`hf_fsdp2.data.unpaired`). With ``r = π − ref`` (summed completion log-probs, policy minus
reference) and ``z0`` the KL estimate:

* ``kto``: a desirable example's loss ``w_d·(1 − σ(β(r − z0)))``, an undesirable one's ``w_u·(1 − σ(β(z0 − r)))``
  (the KTO paper's eq. 7); ``z0`` is the mean of ``π − ref`` over the micro-batch's KL rows (no gradient), averaged
  over the ranks' micro-batches and clamped at 0, as TRL estimates it per micro-batch;
* ``apo_zero_unpaired``: ``w_d·(1 − σ(βr))`` and ``w_u·σ(βr)`` (APO-zero, unpaired; no KL rows).

The step's loss is the mean over every example of every micro-batch of every rank (TRL: the mean per micro-batch,
then over accumulation steps: the same with equal micro-batches). Rewards are ``β·r``. Every rank runs the same
forwards and collectives whatever its data: the reference (or table lookup), the policy on the KL rows without
gradient and one all-reduce of the KL sums (``kto``), then the policy on the examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods.kto.config import KTO_LOSS_TYPES
from hf_fsdp2.train.logps import Reference, completion_logps, evaluating, rank_batches, to_device
from hf_fsdp2.train.loss import LossPlan
from hf_fsdp2.train.nonfinite import NonFiniteGuard
from hf_fsdp2.train.step import Batch, LossTerm, MicroLoss, StepCounts, StepLoss

# Summed over the examples of each kind, divided by that kind's count when logged (TRL's names).
SUMS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")


@dataclass(frozen=True)
class KTOSettings:
    """The KTO objective's constants (from the method's config section; how the step runs, its loss plan included,
    is :class:`~hf_fsdp2.train.step.StepSettings`).

    Attributes:
        beta: KTO's beta.
        loss_type: one of :data:`KTO_LOSS_TYPES`.
        desirable_weight: weight of a desirable example's loss (TRL's ``desirable_weight``).
        undesirable_weight: weight of an undesirable example's loss.
    """

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def uses_kl(self) -> bool:
        """Whether the objective has KTO's KL reference point (and the batches their KL rows)."""
        return self.loss_type == "kto"


def kto_losses(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    settings: KTOSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, the weighted loss and the reward ``β·r`` (detached).

    Args:
        policy / reference: ``[B]`` summed completion log-probs (the reference without gradient).
        desirable: ``[B]`` bool labels.
        kl: the KL estimate ``z0`` (a 0-d tensor, no gradient; unused by ``apo_zero_unpaired``).
    """
    beta = settings.beta
    ratio = policy - reference.to(policy.dtype)
    if settings.loss_type == "kto":
        good = 1 - torch.sigmoid(beta * (ratio - kl))
        bad = 1 - torch.sigmoid(beta * (kl - ratio))
    elif settings.loss_type == "apo_zero_unpaired":
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"loss_type={settings.loss_type!r} is not one of {', '.join(KTO_LOSS_TYPES)}")
    losses = torch.where(desirable, settings.desirable_weight * good, settings.undesirable_weight * bad)
    return losses, (beta * ratio).detach()


def _rows(batch: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"][part], "attention_mask": batch["attention_mask"][part]}


def kl_estimate(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    reference_kl: torch.Tensor,
    plan: LossPlan,
    real: bool,
) -> torch.Tensor:
    """KTO's ``z0`` for a micro-batch: the mean of policy minus reference over the KL rows of every rank's micro-batch
    (a ``real=False`` batch adds nothing), clamped at 0; the policy runs without gradient. Collective: one all-reduce
    of two numbers, on the device (no host read)."""
    b = batch["label"].numel()
    with torch.no_grad():
        policy_kl, _ = completion_logps(model, _rows(batch, slice(b, None)), batch["labels"][b:], plan)
    # The count by a fill on the device: a tensor made from a host number would be a blocking copy, which waits for
    # the device's queue on a GPU.
    count = torch.full((), float(b), dtype=torch.float64, device=policy_kl.device)
    local = torch.stack([(policy_kl - reference_kl.to(policy_kl.dtype)).sum().double(), count])
    total = collectives.all_reduce_sum(local * float(real))
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).to(policy_kl.dtype)


def _sums(rewards: torch.Tensor, policy: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
    """:data:`SUMS` of a micro-batch (fp64)."""
    good = desirable.to(torch.float64)
    r, p = rewards.double(), policy.detach().double()
    return torch.stack([(r * good).sum(), (p * good).sum(), (r * (1 - good)).sum(), (p * (1 - good)).sum()])


def _metrics(sums: torch.Tensor, desirable: int, undesirable: int) -> dict[str, float]:
    """Means of :data:`SUMS` per kind (a kind with no example this step is not logged, as in TRL) and the margin."""
    out: dict[str, float] = {}
    for i, name in enumerate(SUMS):
        count = desirable if name.endswith("chosen") else undesirable
        if count:
            out[name] = float(sums[i]) / count
    if desirable and undesirable:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


class KTOLoss(StepLoss):
    """One KTO step's loss (:class:`~hf_fsdp2.train.step.StepLoss`): per micro-batch, the summed weighted example
    losses over the step's global examples; the KL estimate ``z0`` of each micro-batch from its KL rows (one
    all-reduce, :func:`kl_estimate`) before the policy's forward on the examples."""

    log_dtype = torch.float64

    def __init__(
        self, reference: Reference, settings: KTOSettings, plan: LossPlan, device: torch.device
    ) -> None:
        self.reference, self.settings, self.plan, self.device = reference, settings, plan, device
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
        self.kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.half: list[int] = []
        self.examples = self.desirable = 0

    def prepare(self, micro_batches: Sequence[Batch]) -> Sequence[Batch]:
        self.half = [int(b["label"].numel()) for b in micro_batches]
        return micro_batches

    def local_counts(self, micro_batches: Sequence[Batch]) -> list[int]:
        return [
            sum(self.half),
            sum(int(b["label"].sum()) for b in micro_batches),
            sum(
                int((b["labels"][:n, 1:] != IGNORE_INDEX).sum())
                for b, n in zip(micro_batches, self.half, strict=True)
            ),
            sum(b["input_ids"].numel() for b in micro_batches),
        ]

    def begin(self, counts: Sequence[int], guard: NonFiniteGuard | None) -> StepCounts:
        examples, desirable, tokens, processed = counts
        self.examples, self.desirable = examples, desirable
        return StepCounts(
            loss_count=examples, loss_units=examples, target_tokens=tokens, processed_tokens=processed
        )

    def micro(self, model: torch.nn.Module, batch: Batch, index: int) -> MicroLoss:
        s, b = self.settings, self.half[index]
        batch = to_device(batch, self.device)
        ref = self.reference.logps(batch)  # every row: the examples', then the KL rows'
        kl = torch.zeros((), device=self.device)
        if s.uses_kl:
            kl = kl_estimate(model, batch, ref[b:], self.plan, real=True)
            self.kl_sum += kl.double()
        policy, aux = completion_logps(model, _rows(batch, slice(0, b)), batch["labels"][:b], self.plan)
        desirable_mask = batch["label"]
        losses, rewards = kto_losses(policy, ref[:b], desirable_mask, kl, s)
        self.sums += _sums(rewards, policy, desirable_mask)
        return MicroLoss((LossTerm(losses.sum(), self.examples),), (losses.detach().double().sum(),), aux)

    def metrics(self, micro_batches: int) -> dict[str, float]:
        """KL, rewards and log-probs per kind and margins (collective: every rank calls it)."""
        total = collectives.all_reduce_sum(self.sums.double())
        out = _metrics(total, self.desirable, self.examples - self.desirable)
        if self.settings.uses_kl:
            out["kl"] = float(self.kl_sum) / micro_batches
        return out


def evaluate_kto(
    model: torch.nn.Module,
    reference: Reference,
    examples: Sequence[Any],
    *,
    collator: Any,
    batch_size: int,
    settings: KTOSettings,
    plan: LossPlan,
    device: torch.device,
) -> dict[str, float]:
    """The KTO loss and metrics over every eval example, each once (every rank calls it; the mode is restored).

    Returns:
        ``eval_loss`` (mean over the examples), ``eval_kl`` (mean over the eval batches), ``eval_rewards/chosen`` ...
        and ``eval_examples``.
    """
    sums = torch.zeros(len(SUMS) + 3, dtype=torch.float64, device=device)  # + loss, examples, desirable
    kl_sum = torch.zeros((), dtype=torch.float64, device=device)
    batches = 0  # the same on every rank (even batches)
    for on_device, real in rank_batches(examples, collator=collator, batch_size=batch_size, device=device):
        b = on_device["label"].numel()
        ref = reference.logps(on_device)
        with evaluating(model):
            kl = torch.zeros((), device=device)
            if settings.uses_kl:
                kl = kl_estimate(model, on_device, ref[b:], plan, real)
                kl_sum += kl.double()
            policy, _ = completion_logps(model, _rows(on_device, slice(0, b)), on_device["labels"][:b], plan)
        losses, rewards = kto_losses(policy, ref[:b], on_device["label"], kl, settings)
        batches += 1
        if real:
            sums[:4] += _sums(rewards, policy, on_device["label"])
            sums[4] += losses.double().sum()
            sums[5] += b
            sums[6] += on_device["label"].sum()
    total = collectives.all_reduce_sum(sums)
    n, good = int(total[5]), int(total[6])
    out = {"eval_loss": float(total[4]) / max(n, 1), "eval_examples": n}
    out.update({f"eval_{k}": v for k, v in _metrics(total[:4], good, n - good).items()})
    if settings.uses_kl:
        out["eval_kl"] = float(kl_sum) / max(batches, 1)
    return out
