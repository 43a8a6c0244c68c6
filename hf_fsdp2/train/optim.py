"""Parameter groups, AdamW and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decay for matrices (ndim >= 2), none for biases and norm weights (ndim < 2).

    Args:
        model: the model whose trainable parameters are grouped (before or after sharding: DTensor
            parameters keep their global ndim).
        weight_decay: decay of the first group.

    Returns:
        Parameter groups for ``torch.optim.AdamW``; empty groups are left out.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_adamw(
    groups: Iterable[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    device_type: str,
) -> torch.optim.AdamW:
    """AdamW, fused on CUDA and CPU (torch's fused kernels: one pass over all parameters), foreach elsewhere.

    Args:
        groups: parameter groups from :func:`param_groups`.
        lr: peak learning rate.
        betas: Adam betas.
        eps: Adam epsilon.
        device_type: ``"cuda"`` or ``"cpu"`` enables the fused kernel (on this project's 2-core CPU
            machines its step is several times faster than foreach).

    Returns:
        The optimizer.
    """
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(
        list(groups), lr=lr, betas=betas, eps=eps, fused=fused, foreach=None if fused else True
    )


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at each optimizer step.

    Linear warmup from ``1/(warmup+1)`` to 1 over ``warmup_steps``, then cosine to 0, linear to 0, or
    constant until ``total_steps``.

    Raises:
        ValueError: an unknown kind, or warmup not shorter than training.
    """
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"lr_scheduler_type={kind!r} is not one of cosine, linear, constant")
    if warmup_steps >= total_steps and total_steps > 1:
        raise ValueError(
            f"warmup of {warmup_steps} steps is not shorter than training ({total_steps} steps); "
            "lower warmup_steps / warmup_ratio"
        )

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(progress, 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def build_scheduler(
    optimizer: torch.optim.Optimizer, kind: str, warmup_steps: int, total_steps: int
) -> LambdaLR:
    """A LambdaLR over :func:`lr_lambda`; call ``step()`` once per optimizer step."""
    return LambdaLR(optimizer, lr_lambda(kind, warmup_steps, total_steps))


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    """Warmup length: ``warmup_steps`` when set, else ``ceil(warmup_ratio * total_steps)``."""
    # round() first: 0.07 * 100 is 7.000000000000001 in floating point, which ceil would make 8.
    return warmup_steps if warmup_steps > 0 else math.ceil(round(warmup_ratio * total_steps, 9))


def restore_scheduler(scheduler: LambdaLR, state: dict, peak_lr: float, muon_lr: float | None = None) -> None:
    """Load a saved schedule position and apply the current run's schedule from it.

    The step count comes from the checkpoint; the peak LR and the schedule's shape (total steps,
    warmup, kind) are this run's, so a resumed run that changed ``learning_rate`` or ``max_steps``
    follows its new schedule from the resumed step instead of silently keeping the old one.
    ``muon_lr``: the peak of an ``optim=muon`` run's Muon group (unset: ``peak_lr``).
    """
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [
        muon_lr if muon_lr is not None and group.get("algorithm") == "muon" else peak_lr
        for group in scheduler.optimizer.param_groups
    ]
    step = scheduler.last_epoch
    for group, fn, peak in zip(
        scheduler.optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
    ):
        group["lr"] = peak * fn(step)
    # get_last_lr() answers from this private field (LRScheduler sets it in step()); guarded, as it is written
    # (docs/compatibility.md): a scheduler without it would silently log the old rate.
    if not isinstance(getattr(scheduler, "_last_lr", None), list):
        raise RuntimeError(
            f"torch {torch.__version__}'s LambdaLR has no _last_lr list after load_state_dict: the resumed "
            "schedule's current rate cannot be set for get_last_lr(); use the torch docs/compatibility.md lists"
        )
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
