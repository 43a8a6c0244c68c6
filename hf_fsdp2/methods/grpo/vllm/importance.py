"""The importance sampling correction of vLLM rollouts (``vllm_importance_sampling_correction``, TRL 1.16's formula
and defaults): vLLM samples from its own kernels' distribution, slightly off the trainer's; each completion token's
loss is weighted by the ratio of the trainer's probability to vLLM's, truncated or masked.

With ``d_t = (old_t - sampling_t) * mask_t`` (old: the trainer's log-probs of the batch before the update, without
gradient; sampling: vLLM's, after temperature; NaN differences count as 0):

- ``token_*``: ``rho_t = exp(d_t)``; ``sequence_*``: one ``rho = exp(sum_t d_t)`` per completion;
- ``*_truncate``: ``rho`` clamped to ``[clip_min, clip_max]``; ``*_mask``: ``rho`` set to 0 outside that range
  (TRL's default ``sequence_mask`` with ``clip_max`` 3: a completion vLLM found 3x less likely than the trainer
  drops out of the loss);

and the per-token surrogate (not the KL term) is multiplied by ``rho`` (TRL's ``per_token_loss *
importance_sampling_ratio``). Logged as TRL: ``sampling/sampling_logp_difference/{mean,max}`` and
``sampling/importance_sampling_ratio/{min,mean,max}`` (over every rank's completion tokens, or completions for the
sequence modes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.methods.grpo.config import IS_MODES


def importance_ratio(
    old: torch.Tensor,
    sampling: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's ``vllm_importance_sampling_ratio``: [B, T] for the token modes, [B, 1] for the sequence modes."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {', '.join(IS_MODES)}")
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclass
class ImportanceSampling:
    """The correction's settings and the step's statistics (reset by :meth:`ratios` each step)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    _local: list[float] = field(default_factory=list)

    def ratios(
        self, old: Sequence[torch.Tensor], rows: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """One ratio tensor per micro-batch row of the step (``rows[i]["sampling_logps"]``: vLLM's log-probs)."""
        out = []
        delta_sum = delta_n = 0.0
        delta_max, r_min, r_max, r_sum, r_n = 0.0, math.inf, -math.inf, 0.0, 0.0
        for o, row in zip(old, rows, strict=True):
            mask = row["completion_mask"].to(o.device, o.dtype)
            sampling = row["sampling_logps"].to(o.device, o.dtype)
            ratio = importance_ratio(o, sampling, mask, self.mode, self.clip_min, self.clip_max)
            out.append(ratio)
            delta = (o - sampling).abs()[mask.bool()]
            delta = delta[~torch.isnan(delta)]
            delta_sum, delta_n = delta_sum + float(delta.sum()), delta_n + delta.numel()
            delta_max = max(delta_max, float(delta.max())) if delta.numel() else delta_max
            flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]
            if flat.numel():
                r_min, r_max = min(r_min, float(flat.min())), max(r_max, float(flat.max()))
                r_sum, r_n = r_sum + float(flat.sum()), r_n + flat.numel()
        self._local = [delta_sum, delta_n, r_sum, r_n, delta_max, -r_min, r_max]
        return out

    def metrics(self, device: torch.device) -> dict[str, float]:
        """TRL's sampling metrics over every rank (collective: every rank calls it, after :meth:`ratios`)."""
        if not self._local:
            return {}
        d_sum, d_n, r_sum, r_n, d_max, neg_r_min, r_max = self._local
        sums = collectives.all_reduce_sum(
            torch.tensor([d_sum, d_n, r_sum, r_n], dtype=torch.float64, device=device)
        )
        d_sum, d_n, r_sum, r_n = sums.cpu().tolist()
        d_max, neg_r_min, r_max = collectives.all_reduce_max([d_max, neg_r_min, r_max])
        return {
            "sampling/sampling_logp_difference/mean": d_sum / d_n if d_n else 0.0,
            "sampling/sampling_logp_difference/max": float(d_max),
            "sampling/importance_sampling_ratio/min": -float(neg_r_min) if r_n else 0.0,
            "sampling/importance_sampling_ratio/mean": r_sum / r_n if r_n else 0.0,
            "sampling/importance_sampling_ratio/max": float(r_max) if r_n else 0.0,
        }


def attach_sampling_logps(rows: Sequence[dict[str, torch.Tensor]], generator: object) -> None:
    """Each micro-batch row's vLLM sampling log-probs (``[B, T]`` like its completion mask), when ``generator``
    kept them (:class:`~.client.VllmGenerator`); nothing otherwise."""
    take = getattr(generator, "take_logps", None)
    if take is None:
        return
    logps = take()
    start = 0
    for row in rows:
        count, width = row["completion_mask"].shape
        row["sampling_logps"] = padded_logps(logps[start : start + count], width)
        start += count


def padded_logps(logps: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-completion sampling log-probs as one [N, width] tensor (zeros past each completion's end)."""
    out = torch.zeros((len(logps), width), dtype=torch.float32)
    for row, values in enumerate(logps):
        if values:
            out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def correction_from_keys(g: Any) -> ImportanceSampling | None:
    """The truncated importance-sampling correction the keys ask for (``g``: GrpoArgs), or None when it is off: one
    reading for the server and the colocated engines."""
    if not g.vllm_importance_sampling_correction:
        return None
    return ImportanceSampling(
        g.vllm_importance_sampling_mode, g.vllm_importance_sampling_clip_min, g.is_clip_max
    )


def engine_dtype_name(model: torch.nn.Module, mixed_precision: str) -> str:
    """The dtype vLLM samples in: the trainer's compute dtype (bf16 / fp16 mixed precision, else the weights')."""
    param = next(model.parameters())
    return {"bf16": "bfloat16", "fp16": "float16"}.get(
        mixed_precision, str(param.dtype).replace("torch.", "")
    )
