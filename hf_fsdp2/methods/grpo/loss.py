"""GRPO's arithmetic: group-normalised advantages and the clipped surrogate loss (``grpo``, ``dr_grpo``, ``dapo``,
``bnpo``), with an optional KL penalty to a reference, as TRL 1.16's ``GRPOTrainer`` defines them; and the scoring
of completions (per-token log-probs and entropies), chunked through the output head's hook.

For each prompt the rollout samples ``num_generations`` completions; a completion's reward is the weighted sum of the
reward functions' values, its advantage that reward minus its group's mean reward, divided by the group's standard
deviation (``scale_rewards: group``), the whole batch's (``batch``), or not at all (``none``), plus 1e-4.

Per completion token t, with ratio ``r = exp(logp - old_logp)`` (old: the policy that sampled; equal to the current
one on the first iteration over a generation batch):

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta * r * (exp(ref - logp) - (ref - logp) - 1)

(the factor r on the KL term: ``use_bias_correction_kl``, TRL's default, the unbiased reverse-KL gradient of
DeepSeek-V3.2; without it the k3 estimator alone). With ``importance_sampling_level: sequence`` (GSPO) r is one
ratio per completion, ``exp`` of the mean of ``logp - old_logp`` over its tokens; with TRL's entropy mask
(``top_entropy_quantile``) the surrogate term keeps only the high-entropy tokens (:func:`high_entropy_mask`).

and the loss of a batch, over its completion tokens (mask):

- ``grpo``: each completion's mean over its tokens, then the mean over completions;
- ``dr_grpo``: the sum over every token divided by (completions x ``max_completion_length``);
- ``dapo``: the sum over every token divided by the number of tokens;
- ``bnpo``: each micro-batch's sum divided by its own tokens (TRL's "local batch"), averaged over micro-batches.

:func:`grpo_loss_sums` returns the numerator and the count (completions, 1 for ``bnpo``, tokens for ``dapo``) of one
micro-batch; the step (:mod:`.step`) divides each numerator by TRL's normaliser over every micro-batch of every
rank (for ``dapo`` the generation batch's tokens, scaled to one update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_fsdp2.methods.grpo.config import GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS
from hf_fsdp2.train.chunked_ce import (
    LogitTransform,
    _addmm_into_fp32,
    accumulation_dtype,
    fp32_accumulating_addmm,
    head_input_replaced,
)
from hf_fsdp2.train.loss import LossPlan

SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # added to the standard deviation, as TRL


@dataclass(frozen=True, kw_only=True)
class GrpoSettings:
    """The loss's settings (TRL's ``GRPOConfig`` names)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    beta: float = 0.0
    max_completion_length: int = 256
    num_generations: int = 8
    scale_rewards: str = "group"
    use_bias_correction_kl: bool = True  # the KL term times the ratio (TRL's default, DeepSeek-V3.2)
    importance_sampling_level: str = "token"  # sequence: GSPO's one ratio per completion

    def __post_init__(self) -> None:
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {GRPO_LOSS_TYPES}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards={self.scale_rewards!r} is not one of {SCALE_REWARDS}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}"
            )
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations} must be >= 2: a group of one has no baseline"
            )

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN values (NaN for fewer than 2), as TRL's ``nanstd``."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(
        count > 1, count / (count - 1).clamp(min=1), torch.full_like(variance, math.nan)
    )
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, settings: GrpoSettings, batch_std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of ``rewards`` (completions of one prompt consecutive, ``num_generations`` each) and, per
    completion, whether its scaling standard deviation is zero (no learning signal; TRL logs their fraction).

    A NaN reward (no reward function scored the completion) stays out of its group's mean and deviation and gets
    advantage 0, as does every completion of a group with no scored one (TRL's rule). ``batch_std``: the standard
    deviation over the whole generation batch (every rank's), for ``scale_rewards: batch``; the local one if None.
    """
    n = settings.num_generations
    grouped = rewards.view(-1, n)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(n)
    if settings.scale_rewards == "batch":
        std = (nanstd(rewards) if batch_std is None else batch_std).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(n)
    advantages = rewards - mean
    if settings.scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(kw_only=True)
class LossSums:
    """One micro-batch's loss numerator and count, and the sums of its logged statistics (over completion tokens)."""

    loss: torch.Tensor  # differentiable
    count: (
        torch.Tensor
    )  # completions (grpo, dr_grpo), 1 (bnpo: its own token mean) or completion tokens (dapo)
    tokens: torch.Tensor
    kl: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clip_count: (
        torch.Tensor
    )  # what the clip ratios are over: tokens, or completions with sequence-level ratios
    entropy: torch.Tensor  # summed over the completion tokens (0 without entropies)


def policy_terms(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped surrogate loss, the KL term (zeros without a reference) and the importance weight, as TRL's
    ``_compute_loss``: per token ``[B, T]``, or with ``importance_sampling_level: sequence`` (GSPO) the weight and
    the surrogate ``[B, 1]``, from the mean log-ratio over each completion's tokens (``mask``)."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if settings.importance_sampling_level == "sequence":
        m = mask.to(log_ratio.dtype)
        log_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    ratio = torch.exp(log_weights)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.high)
    adv = advantages.unsqueeze(1)
    policy = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference's log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        # The unbiased reverse-KL gradient (TRL's use_bias_correction_kl); differentiable through the ratio.
        if settings.use_bias_correction_kl:
            kl = kl * ratio
    return policy, kl, ratio


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    settings: GrpoSettings,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of every completion token [B, T] (surrogate + beta x KL), its KL term and the importance weight."""
    m = torch.ones_like(logps) if mask is None else mask
    policy, kl, ratio = policy_terms(logps, old_logps, ref_logps, advantages, m, settings)
    return policy + settings.beta * kl if settings.beta != 0.0 else policy.expand_as(logps), kl, ratio


def grpo_loss_sums(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
    *,
    entropy_mask: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    is_ratio: torch.Tensor | None = None,
) -> LossSums:
    """The micro-batch's loss numerator and count for ``settings.loss_type`` (module docstring); the step's loss is
    the sum of the numerators over the step divided by the sum of the counts. ``entropy_mask``: the tokens the
    surrogate keeps (:func:`high_entropy_mask`, TRL's ``top_entropy_quantile``; the KL term keeps every token);
    ``entropies``: per-token entropies, summed over the mask for the ``entropy`` metric."""
    policy, kl, ratio = policy_terms(logps, old_logps, ref_logps, advantages, mask, settings)
    loss = policy if entropy_mask is None else policy * entropy_mask.to(policy.dtype)
    if (
        is_ratio is not None
    ):  # vLLM's importance sampling correction (vllm/importance.py): the surrogate, not the KL
        loss = loss * is_ratio.to(loss.dtype)
    if settings.beta != 0.0:
        loss = loss + settings.beta * kl
    mask = mask.to(logps.dtype)
    masked = loss * mask  # [B, T] also when the sequence-level surrogate is [B, 1]
    lengths = mask.sum(-1)
    completions = torch.tensor(float(mask.shape[0]), dtype=logps.dtype, device=logps.device)
    if settings.loss_type == "grpo":
        numerator, count = (masked.sum(-1) / lengths.clamp(min=1.0)).sum(), completions
    elif (
        settings.loss_type == "bnpo"
    ):  # normalised by this micro-batch's own tokens, as TRL (its doc: "local")
        numerator, count = masked.sum() / lengths.sum().clamp(min=1.0), torch.ones_like(completions)
    elif settings.loss_type == "dr_grpo":
        numerator, count = masked.sum() / settings.max_completion_length, completions
    else:  # dapo
        numerator, count = masked.sum(), lengths.sum()
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - settings.epsilon) & (adv < 0)).to(logps.dtype)
    high = ((ratio > 1 + settings.high) & (adv > 0)).to(logps.dtype)
    if ratio.shape[1] == 1:  # sequence-level: TRL's ratios are over completions (each one value)
        clipped_low, clipped_high, clip_count = low.sum(), high.sum(), completions
    else:
        clipped_low, clipped_high, clip_count = (low * mask).sum(), (high * mask).sum(), lengths.sum()
    entropy = (entropies * mask).sum() if entropies is not None else torch.zeros_like(completions)
    return LossSums(
        loss=numerator,
        count=count.detach(),
        tokens=lengths.sum().detach(),
        kl=(kl * mask).sum().detach(),
        clipped_low=clipped_low.detach(),
        clipped_high=clipped_high.detach(),
        clip_count=clip_count.detach(),
        entropy=entropy.detach(),
    )


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GrpoSettings,
    *,
    entropy_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of one whole batch (one micro-batch, one process): numerator over count."""
    sums = grpo_loss_sums(logps, old_logps, ref_logps, advantages, mask, settings, entropy_mask=entropy_mask)
    return sums.loss / sums.count.clamp(min=1.0)


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, threshold: float, pooled: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's ``get_high_entropy_mask``: the completion tokens whose entropy is at least the ``threshold`` quantile
    (``1 - top_entropy_quantile``) of ``pooled`` (every rank's completion-token entropies of the micro-batch; this
    rank's when None)."""
    values = entropies[mask.bool()].float() if pooled is None else pooled.float()
    if values.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    cut = torch.quantile(values, threshold)
    return ((entropies * mask.float()) >= cut) & mask.bool()


def completion_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, T] of the last ``completion_length`` tokens of each row under ``model``, from logits divided by
    the sampling ``temperature`` (the distribution the completions were sampled from, as TRL scores them): the plain
    path, every position's full-vocabulary log-softmax (:func:`token_logps_and_entropy` chunks it)."""
    logps, _ = _plain_scores(model, input_ids, attention_mask, completion_length, temperature, entropy=False)
    return logps


def _plain_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    width: int,
    temperature: float,
    *,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[
        :, -width - 1 : -1
    ]
    z = logits.to(accumulation_dtype(logits.dtype)) / temperature
    logps = torch.log_softmax(z, dim=-1)
    picked = logps.gather(-1, input_ids[:, -width:].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked, None
    with torch.no_grad():
        return picked, -(logps.exp() * logps).sum(-1)


def token_logps_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    plan: LossPlan | None = None,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per completion token ``[B, T]`` (``T``: ``completion_mask``'s width, the rows' last ``T`` tokens), the
    log-prob under ``model`` at ``temperature`` and, with ``entropy``, the entropy of that distribution (no
    gradient; TRL's ``entropy`` metric and ``top_entropy_quantile`` mask).

    With ``plan.chunk_tokens > 0`` (the run's loss plan: the head is a bias-free linear layer whose output is the
    logits after the plan's transform) the head's pre-hook takes the final hidden states at the completion
    positions of ``completion_mask`` (a host tensor) only and :class:`_ChunkedTokenLogps` computes ``chunk_tokens``
    rows at a time, the temperature inside the chunk; backward recomputes each chunk's logits. Positions outside
    the mask get log-prob 0 and entropy 0 (the loss masks them). Otherwise the plain path: the full fp32
    log-softmax over every position (``[B, T, vocab]`` kept for backward).
    """
    width = completion_mask.shape[1]
    if plan is None or plan.chunk_tokens <= 0:
        return _plain_scores(model, input_ids, attention_mask, width, temperature, entropy=entropy)
    host = completion_mask.cpu().bool()
    rows, cols = host.nonzero(as_tuple=True)  # host positions: the device is not read
    start = input_ids.shape[1] - width
    device = input_ids.device
    request = _CompletionScores(
        rows=rows.to(device),
        positions=(start - 1 + cols).to(device),  # hidden position t predicts token t + 1
        targets=input_ids[rows.to(device), (start + cols).to(device)],
        plan=plan,
        temperature=temperature,
        entropy=entropy,
    )
    head = model.get_output_embeddings()  # type: ignore[operator]
    with head_input_replaced(head, request):
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if request.result is None:
        raise RuntimeError(
            f"the chunked completion log-probs were not computed: {type(model).__name__}'s output head did not run "
            "during the forward; set ce_chunk_tokens=0"
        )
    values, entropies = request.result
    shape, index = (input_ids.shape[0], width), (request.rows, cols.to(device))
    logps = torch.zeros(shape, dtype=values.dtype, device=device).index_put(index, values)
    ent = (
        torch.zeros(shape, dtype=values.dtype, device=device).index_put(index, entropies) if entropy else None
    )
    return logps, ent


@dataclass(kw_only=True)
class _CompletionScores:
    """The head pre-hook's request of one :func:`token_logps_and_entropy` forward, and its result."""

    rows: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    plan: LossPlan
    temperature: float
    entropy: bool
    result: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, head: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
        hidden = full[self.rows, self.positions]
        p = self.plan
        self.result = _ChunkedTokenLogps.apply(
            hidden, head.weight, self.targets, p.chunk_tokens, self.temperature, p.transform, self.entropy
        )
        # The head itself runs on the last position only (contiguous: see hf_fsdp2.train.loss._ChunkedLoss).
        return full[:, -1:].contiguous()


def _chunk_logits(
    h: torch.Tensor, head: torch.Tensor, transform: LogitTransform, temperature: float, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``transform(h @ head.T) / temperature`` in ``acc``, and the soft-cap's tanh (its derivative needs it)."""
    z, capped = transform.chunk_logits(h, head, acc)
    return z.div_(temperature), capped


class _ChunkedTokenLogps(torch.autograd.Function):
    """Log-probs (and entropies) of ``targets`` under ``transform(hidden @ weight.T) / temperature``, ``chunk`` rows
    at a time: one ``[chunk x vocab]`` block exists at a time in forward and in backward.

    Forward keeps the hidden rows and each row's log-sum-exp; backward recomputes each chunk's logits and takes
    ``d logp / d z = one_hot - softmax`` times the incoming gradient, back through the temperature and the transform,
    to the hidden rows and the head (an fp32 accumulator, as the chunked cross entropy's). Unlike the cross entropy,
    whose gradient is known in forward, GRPO's loss is a function of the log-probs: the head's weight is needed in
    backward, which FSDP2 keeps gathered (the head is in the root's or the tail's group, not resharded after
    forward); a freed weight is refused by name.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        temperature: float,
        transform: LogitTransform,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(hidden.dtype)
        head = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.zeros(n if want_entropy else 0, dtype=acc, device=hidden.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z, _ = _chunk_logits(hidden[start:end], head, transform, temperature, acc)
            norm = torch.logsumexp(z, dim=-1)
            lse[start:end] = norm
            logps[start:end] = z.gather(1, targets[start:end, None]).squeeze(1) - norm
            if want_entropy:  # H = lse - sum(softmax * z), a row dot product: no second [chunk x vocab] block
                probs = (z - norm[:, None]).exp_()
                entropy[start:end] = norm - (probs.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.settings = (chunk, temperature, transform)  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor, _: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk, temperature, transform = ctx.settings  # type: ignore[attr-defined]
        if weight.untyped_storage().size() == 0:
            raise RuntimeError(
                "the output head's weight was freed before the chunked GRPO scoring's backward (FSDP2 resharded it "
                "after forward): set ce_chunk_tokens=0 for this model"
            )
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        acc, operand = lse.dtype, hidden.dtype
        head = weight if weight.dtype == operand else weight.to(operand)
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g = grad.to(acc)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            z, capped = _chunk_logits(h, head, transform, temperature, acc)
            # d(sum g logp)/dz = g (one_hot - softmax), in place of the logits
            d = z.sub_(lse[start:end, None]).exp_().mul_(-g[start:end, None])
            d[torch.arange(end - start, device=d.device), targets[start:end]] += g[start:end]
            d.div_(temperature)
            if capped is not None:
                d.mul_(1.0 - capped.square_())
            if transform.scale != 1.0:
                d.mul_(transform.scale)
            dz = d.to(operand)
            del z, d, capped
            if grad_hidden is not None:
                grad_hidden[start:end] = dz @ head
            if grad_weight is not None:
                if operand == acc:
                    grad_weight.addmm_(dz.t(), h)
                elif fp32_accumulating_addmm(grad_weight.device.type, operand):
                    _addmm_into_fp32(grad_weight, dz.t(), h)
                else:
                    grad_weight.add_(dz.t() @ h)
        gw = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, gw, None, None, None, None, None
