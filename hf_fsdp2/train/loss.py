"""Token-level cross entropy normalised by the global number of target tokens of an optimizer step.

The loss of a step is ``sum of per-token CE over every target token of every micro-batch on every
rank / number of those tokens``: a long example weighs as much per token as a short one, whatever
the micro-batch split, the accumulation or the number of ranks (not a mean of per-batch means).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor, Partial

from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.train.chunked_ce import (
    LogitTransform,
    accumulation_dtype,
    chunked_linear_cross_entropy_sum,
    head_input_replaced,
    target_rows,
    vocab_shard,
)
from hf_fsdp2.train.router import router_loss


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss in a batch of unshifted labels (the first position never does).

    Args:
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        The number of (shifted) target tokens.
    """
    return int((labels[:, 1:] != IGNORE_INDEX).sum().item())


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross entropy over the target tokens, in fp32 (fp64 for fp64 logits).

    Args:
        logits: ``[batch, seq, vocab]`` model outputs.
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.

    Returns:
        A scalar fp32 tensor: the summed loss (0 when there is no target token).
    """
    # Shift the labels (pad ignored positions at the end), not the logits: slicing the logits would copy the whole
    # [tokens x vocab] tensor, and its gradient again in backward. Labels one column wider than the logits (a
    # context-parallel part: hf_fsdp2.parallel.all_to_all) carry the last position's target: nothing is padded.
    shift_labels = F.pad(labels[:, 1:], (0, logits.size(1) - labels.size(1) + 1), value=IGNORE_INDEX)
    shift_labels = shift_labels.to(logits.device)
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


def logit_transform_for(config: Any) -> LogitTransform:
    """The logit post-processing a model config declares (see :class:`LogitTransform`)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(config, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if (
        getattr(config, "lm_head_multiplier", None) is not None
    ):  # Falcon-H1 (muP): logits * lm_head_multiplier
        scale *= float(config.lm_head_multiplier)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def shifted_target_rows(labels: torch.Tensor) -> torch.Tensor:
    """:func:`target_rows` of ``[batch, seq]`` labels as the chunked loss shifts them (``labels[:, 1:]``)."""
    return target_rows(labels[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------------
# The loss plan: decided once, before the first step, the same on every rank
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossPlan:
    """How every micro-batch's loss is computed for a whole run; never chosen per batch.

    A per-batch choice (say chunked only for large batches) makes ranks with different batch sizes run
    different backward graphs, whose FSDP2 collectives then stop matching: a deadlock. The plan is
    fixed at start-up and agreed by all ranks (:func:`plan_loss`).

    Attributes:
        chunk_tokens: rows per chunk of the chunked CE; 0 = plain logits.
        transform: the model's logit post-processing, applied by the chunked path.
        router_aux_coef: weight of the MoE router load-balancing loss added to the step's loss (0 = none;
            set when the model config asks for it with ``output_router_logits``).
        notes: what was decided and why, for the start-of-run log.
    """

    chunk_tokens: int = 0
    transform: LogitTransform = field(default_factory=LogitTransform)
    router_aux_coef: float = 0.0
    notes: tuple[str, ...] = ()


def router_aux_coef(config: Any) -> float:
    """The router auxiliary-loss weight a MoE config asks for (``output_router_logits``), else 0; a composite's from its
    text config (where Qwen3.5-MoE's composite reads them)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "output_router_logits", False):
        return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    return 0.0


def _chunkable_head(model: torch.nn.Module) -> tuple[torch.nn.Module | None, str]:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, torch.nn.Module) or getattr(head, "weight", None) is None:
        return None, f"{type(model).__name__} has no output head with a weight"
    if getattr(head, "bias", None) is not None:
        return None, f"{type(model).__name__}'s output head has a bias"
    return head, ""


def _probe_transform(model: torch.nn.Module, head: torch.nn.Module, transform: LogitTransform) -> str:
    """Check that the model's logits are ``transform(head output)``; '' when they are, else why not.

    The head's output is replaced (forward hook) by known values of magnitude up to 50, so whatever the
    model does to it afterwards shows in the logits it returns, independent of its weights. Every rank
    runs the same forward (collective under FSDP2), eagerly, without gradients.
    """
    calls: list[tuple[int, ...]] = []
    made: list[torch.Tensor] = []

    def replace(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(args[0].shape))
        gen = torch.Generator().manual_seed(0)
        values = (torch.rand(output.shape, generator=gen, dtype=torch.float64) * 100 - 50).to(torch.float32)
        made.append(values)
        return values.to(output.device)

    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    ids = torch.arange(1, 5, device=device)[None, :]
    handle = head.register_forward_hook(replace)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
        model.train(was_training)
    if len(calls) != 1 or calls[0][:2] != (1, 4):
        return f"the output head ran {len(calls)} time(s) on inputs {calls}, not once on every position"
    expected = transform.apply(made[0])
    got = logits.detach().float().cpu()
    if got.shape != expected.shape:
        return f"the logits have shape {tuple(got.shape)}, the head's output {tuple(expected.shape)}"
    # A few fp32 elementwise ops on values up to 50: rounding stays far below 64 ulps of 50.
    diff = float((got - expected).abs().max())
    if diff > 64 * torch.finfo(torch.float32).eps * 50:
        return (
            f"its logits are not the head's output after the known post-processing ({transform.describe()}): "
            f"they differ by up to {diff:.3g}"
        )
    return ""


def plan_loss(model: torch.nn.Module, chunk_tokens: int, *, probe: bool = True) -> LossPlan:
    """Decide the loss path of a run, the same on every rank (collective when ``probe`` is on).

    The chunked path is taken when ``chunk_tokens > 0``, the head is a bias-free linear layer, and a probe
    forward shows that the model's logits are the head's output after the post-processing its config
    declares (:func:`logit_transform_for`). Otherwise the plain path, with the reason in ``notes``.

    Args:
        model: the model as it will be trained (sharded or not); every rank passes its own.
        chunk_tokens: ``ce_chunk_tokens``.
        probe: run the probe forward (every rank must then call this function).

    Returns:
        The plan.
    """
    from hf_fsdp2 import collectives

    config = getattr(model, "config", None)
    transform = logit_transform_for(config)
    aux = router_aux_coef(config)
    notes = []
    if aux:
        notes.append(f"router auxiliary loss added with weight {aux:g} (output_router_logits in the config)")
    if chunk_tokens <= 0:
        notes.append("loss on the full logits (ce_chunk_tokens=0)")
        return LossPlan(0, transform, aux, tuple(notes))
    head, why = _chunkable_head(model)
    if head is not None and probe:
        why = _probe_transform(model, head, transform)
    if collectives.all_ranks_true(not why):
        notes.append(
            f"chunked cross entropy, {chunk_tokens} tokens per chunk; logit post-processing: {transform.describe()}"
        )
        return LossPlan(chunk_tokens, transform, aux, tuple(notes))
    notes.append(
        f"loss on the full logits instead of chunks: {why or 'the probe failed on another rank'} "
        "(the chunked loss would not be the model's)"
    )
    return LossPlan(0, transform, aux, tuple(notes))


@dataclass
class LossOutput:
    """A micro-batch's summed CE over its target tokens, and the router auxiliary loss when planned."""

    ce_sum: torch.Tensor
    aux_loss: torch.Tensor | None = None


def causal_lm_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    rows: torch.Tensor | None = None,
) -> LossOutput:
    """Run the model and return the summed next-token cross entropy over the target tokens.

    With ``plan.chunk_tokens > 0`` the full ``[tokens x vocab]`` logits are never materialised: a forward
    pre-hook on the output head takes the final hidden states and the head's weight *inside* the head's
    own call (so FSDP2 has gathered the weight and attaches its gradient reduction as for any call),
    computes the loss and its gradients chunk by chunk (:func:`chunked_linear_cross_entropy_sum`, with
    the model's logit post-processing), and lets the head itself run on one position only. The path
    depends on the plan only, never on the batch: every rank runs the same graph.

    Args:
        model: the causal LM (``plan_loss`` checked its head).
        inputs: forward keyword arguments (input_ids and attention_mask or position_ids).
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss; ``[batch, seq + 1]``: the last
            column is the last position's target (a context-parallel part, :func:`~hf_fsdp2.parallel.all_to_all.shard_sequence`).
        plan: from :func:`plan_loss`.
        rows: the chunked loss's target positions (:func:`shifted_target_rows` of the labels), computed from
            host labels so that no device read is needed; None = found here from ``labels``.

    Returns:
        The summed CE (fp32, fp64 for fp64 models) and the router auxiliary loss of the micro-batch's global tokens
        (:func:`~hf_fsdp2.train.router.router_loss`; collective), or None.
    """
    extra = {"output_router_logits": True} if plan.router_aux_coef else {}
    if plan.chunk_tokens <= 0:
        out = model(**inputs, **extra, use_cache=False)
        return LossOutput(
            cross_entropy_sum(out.logits, labels), router_loss(out, model, inputs) if extra else None
        )
    head = model.get_output_embeddings()  # type: ignore[operator]
    targets = labels[:, 1:].reshape(-1)
    if rows is None:
        # Found here, before the model runs: under whole-model compile a nonzero() inside the head's hook would
        # break the graph there and recompile its remainder every step.
        rows = target_rows(targets)
    request = _ChunkedLoss(targets=targets, rows=rows, plan=plan, positions=labels.size(1) - 1)
    with head_input_replaced(head, request):
        out = model(**inputs, **extra, use_cache=False)
    if request.result is None:
        raise RuntimeError(
            f"the chunked loss was not computed: {type(model).__name__}'s output head {type(head).__name__} did not "
            "run during the forward; set ce_chunk_tokens=0"
        )
    return LossOutput(request.result, router_loss(out, model, inputs) if extra else None)


@dataclass(kw_only=True)
class _ChunkedLoss:
    """The chunked loss of one :func:`causal_lm_loss` forward, computed from the head's input; its result."""

    targets: torch.Tensor
    rows: torch.Tensor
    plan: LossPlan
    positions: int  # hidden positions that have a target column: labels' width - 1
    result: torch.Tensor | None = None

    def __call__(self, head: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
        # Tensor parallel splits the head over the vocabulary (parallel/sequence_parallel.py): its input is the whole
        # sequence replicated over tp, its weight this rank's rows. The loss computes on the local tensors (loss
        # parallel); the input's gradient is this rank's partial sum over its rows, reduced over tp on the way back.
        assert isinstance(head.weight, torch.Tensor)
        vocab = vocab_shard(head.weight)
        if isinstance(full, DTensor):
            local = full.to_local(grad_placements=[Partial()] if vocab is not None else None)
        else:
            local = full
        hidden = local[:, : self.positions].reshape(-1, local.size(-1))
        weight = head.weight.to_local() if isinstance(head.weight, DTensor) else head.weight
        assert isinstance(weight, torch.Tensor)
        self.result = chunked_linear_cross_entropy_sum(
            hidden,
            weight,
            self.targets.to(local.device),
            self.plan.chunk_tokens,
            self.plan.transform,
            self.rows.to(local.device, non_blocking=True),
            vocab,
        )
        # The head itself runs on the last position only. Contiguous: a view's stride follows the sequence length,
        # which the head's compiled graph would be guarded on (one recompile per new stride, measured).
        return full[:, -1:].contiguous()


def causal_lm_loss_sum(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The summed CE of :func:`causal_lm_loss` alone (evaluation, benches); ``rows`` as there."""
    return causal_lm_loss(model, inputs, labels, plan, rows).ce_sum
