"""The preference objectives' formulas, per pair, from the completions' summed log-probs (TRL's definitions).

A micro-batch holds B pairs as 2B rows, chosen rows then rejected rows; ``π`` is a row's summed completion
log-prob, ``n`` its completion tokens. With a reference (``ref``) and ``Δ = (π_c − ref_c) − (π_r − ref_r)``:

* ``sigmoid`` (DPO): ``−(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)`` (ε = ``label_smoothing``: conservative DPO);
* ``ipo``: ``(Δ_c/n_c − Δ_r/n_r − 1/(2β))²`` with the log-ratios per completion token;
* ``robust``: ``[−(1−ε)·logσ(βΔ) + ε·logσ(−βΔ)] / (1−2ε)``;
* ``hinge``: ``relu(1 − βΔ)``.

Reference-free, on the per-token means ``a = π/n`` (no reference model, no reference pass):

* ``simpo`` (SimPO; TRL's ``CPOTrainer(loss_type="simpo")``): ``z = β(a_c − a_r) − γ``,
  ``−(1−ε)·logσ(z) − ε·logσ(−z)``, plus ``cpo_alpha`` x the NLL of the chosen completions (0: SimPO as published;
  TRL's ``CPOConfig`` defaults it to 1, CPO-SimPO);
* ``orpo`` (ORPO; TRL's ``ORPOTrainer``): the NLL of the chosen sequences (prompt and completion, as TRL and the
  ORPO authors' code compute it) plus ``−β·logσ(log_odds)`` with ``log_odds = (a_c − a_r) − (log(1 − e^{a_c}) −
  log(1 − e^{a_r}))`` on the completions (β is the paper's λ).

The NLL is the mean over the step's tokens it covers (every rank's, every micro-batch's), the pair losses the mean
over the step's pairs. Rewards are ``β(π − ref)`` with a reference, ``β·a`` without (as TRL logs them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_fsdp2.methods.dpo.config import DPO_LOSS_TYPES as LOSS_TYPES
from hf_fsdp2.methods.dpo.config import REFERENCE_FREE_LOSS_TYPES as REFERENCE_FREE

# Per-pair quantities summed over pairs (then divided by the global pair count), as TRL logs them.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# What an objective logs besides: summed per pair (log-odds) or per chosen token (nll_loss), as TRL names them.
EXTRA_METRICS = {"simpo": ("nll_loss",), "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


@dataclass(frozen=True, kw_only=True)
class DPOSettings:
    """The preference objective's constants (from the method's config section; how the step runs, its loss plan
    included, is :class:`~hf_fsdp2.train.step.StepSettings`).

    Attributes:
        beta: DPO's beta (IPO's tau, SimPO's beta, ORPO's lambda).
        loss_type: one of :data:`LOSS_TYPES`.
        label_smoothing: ε of cDPO (sigmoid), robust DPO and SimPO.
        simpo_gamma: SimPO's target reward margin γ.
        cpo_alpha: weight of the chosen completions' NLL under SimPO.
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    @property
    def reference_free(self) -> bool:
        return self.loss_type in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen rows' mean NLL in the step's loss (ORPO: 1; SimPO: ``cpo_alpha``)."""
        return 1.0 if self.loss_type == "orpo" else self.cpo_alpha if self.loss_type == "simpo" else 0.0

    @property
    def extra_metrics(self) -> tuple[str, ...]:
        return EXTRA_METRICS.get(self.loss_type, ())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − e^x)`` for ``x < 0``, without cancellation: branched at ``−ln 2`` (Mächler's note)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(
    policy: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor, settings: DPOSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair, the preference loss, the chosen / rejected rewards, and the objective's extra per-pair values.

    Args:
        policy: ``[2B]`` the policy's summed completion log-probs, chosen rows then rejected rows.
        reference: ``[2B]`` the reference's, same layout (no gradient); unused (may be None) when reference-free.
        lengths: ``[2B]`` completion tokens per row (IPO's, SimPO's and ORPO's normalisation; at least 1).
        settings: the objective and its constants.

    Returns:
        ``(losses [B], chosen rewards [B], rejected rewards [B], extras)``; rewards and extras are detached; extras
        are ORPO's ``log_odds_ratio`` (``logσ(log_odds)``) and ``log_odds_chosen`` (``log_odds``) per pair.
    """
    b = policy.size(0) // 2
    beta, eps = settings.beta, settings.label_smoothing
    n = lengths.to(policy.dtype).clamp(min=1)
    if settings.reference_free:
        mean = policy / n
        chosen, rejected = mean[:b], mean[b:]
        if settings.loss_type == "simpo":
            z = beta * (chosen - rejected) - settings.simpo_gamma
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
            return losses, (beta * chosen).detach(), (beta * rejected).detach(), {}
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        extras = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        return -beta * ratio, (beta * chosen).detach(), (beta * rejected).detach(), extras
    if reference is None:
        raise ValueError(f"loss_type={settings.loss_type!r} needs reference log-probs")
    ratios = policy - reference.to(policy.dtype)
    chosen, rejected = ratios[:b], ratios[b:]
    delta = chosen - rejected
    if settings.loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif settings.loss_type == "ipo":
        losses = (chosen / n[:b] - rejected / n[b:] - 1 / (2 * beta)) ** 2
    elif settings.loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    elif settings.loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:
        raise ValueError(f"loss_type={settings.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    return losses, (beta * chosen).detach(), (beta * rejected).detach(), {}


def metric_sums(
    policy: torch.Tensor,
    lengths: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    extras: dict[str, torch.Tensor],
    settings: DPOSettings,
    nll: torch.Tensor | None = None,
) -> torch.Tensor:
    """The :data:`METRICS` and the objective's extra metrics of a micro-batch, summed (fp64).

    ``logps/*`` are the summed completion log-probs, or their per-token means when reference-free (as TRL's CPO
    and ORPO trainers log them); ``nll_loss`` is summed over the chosen completion tokens (divided by their step
    count when logged; ``nll``: the chosen rows' summed NLL, default their completions'), the log-odds over pairs.
    """
    b = policy.size(0) // 2
    p = policy.detach().double()
    if settings.reference_free:
        p = p / lengths.double().clamp(min=1)
    c, r = chosen_rewards.double(), rejected_rewards.double()
    values = [c.sum(), r.sum(), (c > r).double().sum(), (c - r).sum(), p[:b].sum(), p[b:].sum()]
    for name in settings.extra_metrics:
        if name == "nll_loss":
            values.append((nll if nll is not None else -policy[:b].sum()).detach().double())
        else:
            values.append(extras[name].double().sum())
    return torch.stack(values)
