"""Token-level cross entropy normalised by the global number of target tokens of an optimizer step.

The loss of a step is ``sum of per-token CE over every target token of every micro-batch on every
rank / number of those tokens``: a long example weighs as much per token as a short one, whatever
the micro-batch split, the accumulation or the number of ranks (not a mean of per-batch means).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from hf_fsdp2.labels import IGNORE_INDEX


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


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to the head's output before it is a logit: ``softcap(raw * scale)``.

    Gemma-2/3 cap the logits (``final_logit_softcapping``: ``c * tanh(x / c)``), Granite divides them
    (``logits_scaling``), Cohere multiplies them (``logit_scale``). The chunked loss computes from the
    head's raw output, so it must apply the same transform, or its loss is not the model's.
    """

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """The logits from the head's raw output."""
        out = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def describe(self) -> str:
        parts = []
        if self.scale != 1.0:
            parts.append(f"x {self.scale:g}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        return ", ".join(parts) or "none"


def logit_transform_for(config: Any) -> LogitTransform:
    """The logit post-processing a model config declares (see :class:`LogitTransform`)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(config, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``transform(hidden @ weight.T)`` over chunks of rows; gradients computed in forward.

    Only the rows with a target are computed (with assistant-only or completion-only loss most positions have
    none: their logits are never needed), and only one ``[chunk x vocab]`` block exists at a time, exponentiated
    once: the softmax gives both the log-sum-exp and the gradient. Backward scales the saved gradients
    (``[tokens x hidden]`` and ``[vocab x hidden]``) by the incoming gradient.

    Precision, as fused linear cross-entropy kernels do it: the three GEMMs (logits, gradient of the hidden
    states, gradient of the head) take operands in the inputs' dtype (bf16 under mixed precision; the kernels
    accumulate in fp32), and only the loss needs fp32: the log-sum-exp, the chunk's softmax and the head's
    gradient accumulator. Where torch has it (CUDA, :func:`fp32_accumulating_addmm`), the head's gradient GEMM
    adds into that fp32 accumulator itself; elsewhere (CPU) each chunk's bf16 product is a ``[vocab x hidden]``
    temporary added to it: one more bf16 rounding, a ``2 x vocab x hidden``-byte temporary and ``4 x vocab x hidden``
    bytes more memory traffic per chunk (its write and read; computed: 0.5 GB and 1.05 GB for a 128256 x 2048
    head), on top of the ``8 x vocab x hidden`` bytes of the accumulator's read and write both paths have. The softmax gradient is rounded to bf16 for its two GEMMs, as the plain path rounds
    the logits' gradient (``tests/unit/test_loss.py`` bounds the difference). fp32 operands would run at a
    fraction of a GPU's bf16 rate (TF32 is off by default) and need an fp32 copy of the head.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        transform: LogitTransform,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        acc = accumulation_dtype(hidden.dtype)
        operand = hidden.dtype  # of the GEMMs: bf16 under mixed precision, else fp32 (fp64 for fp64)
        grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight.requires_grad else None
        )
        total = torch.zeros((), dtype=acc, device=hidden.device)
        if rows is None:  # the positions with a target (nonzero() waits for the device: pass them in)
            rows = target_rows(targets)
        # The head in the GEMMs' dtype, cast once per call and only when it differs (never under FSDP2's policy).
        head = weight if weight.dtype == operand else weight.to(operand)
        for start in range(0, rows.numel(), chunk):
            index = rows[start : start + chunk]
            h = hidden.index_select(0, index)
            t = targets.index_select(0, index)
            logits = (h @ head.t()).to(acc)
            capped = None
            if transform.scale != 1.0:
                logits.mul_(transform.scale)
            if transform.softcap:
                capped = torch.tanh(logits / transform.softcap)
                logits = capped * transform.softcap
            picked = logits.gather(1, t[:, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: the logits are not needed any more
            norm = probs.sum(dim=-1, keepdim=True)
            total += ((top + norm.log()).squeeze(1) - picked).sum()
            # d(sum CE)/d logits = softmax - one-hot, computed in place.
            probs.div_(norm)
            probs[torch.arange(probs.size(0), device=probs.device), t] -= 1.0
            # Back through the transform to the head's raw output.
            if capped is not None:
                probs.mul_(1.0 - capped.square_())
            if transform.scale != 1.0:
                probs.mul_(transform.scale)
            grad_logits = probs.to(operand)  # a no-op for fp32 inputs
            del logits, probs, capped  # the fp32 block is not needed for the GEMMs (nor in the next chunk)
            if grad_hidden is not None:
                grad_hidden.index_copy_(0, index, grad_logits @ head)
            if grad_weight is not None:
                if operand == acc:
                    grad_weight.addmm_(grad_logits.t(), h)
                elif fp32_accumulating_addmm(grad_weight.device.type, operand):
                    # bf16 operands, the fp32 accumulator as the GEMM's addend and output (CUDA): no bf16 product.
                    _addmm_into_fp32(grad_weight, grad_logits.t(), h)
                else:
                    # Without that op (CPU; torch before out_dtype): the chunk's product is rounded to bf16 once
                    # (fp32 inside the GEMM), written as a [vocab x hidden] bf16 temporary and added to the fp32
                    # accumulator: one more bf16 rounding and one more read+write of [vocab x hidden] per chunk.
                    grad_weight.add_(grad_logits.t() @ h)
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
        return gh, gw, None, None, None, None


def _addmm_into_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with bf16/fp16 ``a``, ``b`` and an fp32 ``acc`` that the GEMM reads and writes itself."""
    torch.addmm(acc, a, b, torch.float32, out=acc)  # out_dtype (4th argument): CUDA only in torch 2.13


@functools.cache
def fp32_accumulating_addmm(device_type: str, operand: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32, a, b, torch.float32, out=fp32)`` works for ``operand`` inputs on this device type.

    A feature test, run once per process and device type: torch 2.13 has the op for bf16/fp16 on CUDA only
    (CPU raises "Could not run 'aten::addmm.dtype_out'"), and older torch lacks the ``out_dtype`` argument.
    """
    try:
        device = torch.device(device_type)
        a = torch.full((2, 2), 1.0, dtype=operand, device=device)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device)
        _addmm_into_fp32(acc, a, a)
        return bool((acc == 3.0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@torch.compiler.disable  # eager by construction: its loop count is the step's target rows (see _replace_head_input)
def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    transform: LogitTransform | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed CE of ``transform(hidden @ weight.T)`` against ``targets`` without the full logits.

    Args:
        hidden: ``[tokens, hidden]`` final hidden states (already shifted: row i predicts targets[i]).
        weight: ``[vocab, hidden]`` output-head weight.
        targets: ``[tokens]`` next-token ids, ``-100`` where no loss.
        chunk_tokens: rows per chunk.
        transform: the model's logit post-processing (none by default).
        rows: :func:`target_rows` of ``targets`` on ``hidden``'s device, found from host labels; None = found
            here, which reads the device once (``nonzero``) on a GPU.

    Returns:
        A scalar tensor (fp32, fp64 for fp64 inputs) whose gradients match the plain computation's.
    """
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, chunk_tokens, transform or LogitTransform(), rows
    )


def target_rows(targets: torch.Tensor) -> torch.Tensor:
    """The positions of ``[tokens]`` shifted targets that carry a loss (not ``-100``), in order."""
    return (targets != IGNORE_INDEX).nonzero().squeeze(1)


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
    """The router auxiliary-loss weight a MoE config asks for (``output_router_logits``), else 0."""
    if getattr(config, "output_router_logits", False):
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
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
        labels: ``[batch, seq]`` labels aligned with input_ids, ``-100`` where no loss.
        plan: from :func:`plan_loss`.
        rows: the chunked loss's target positions (:func:`shifted_target_rows` of the labels), computed from
            host labels so that no device read is needed; None = found here from ``labels``.

    Returns:
        The summed CE (fp32, fp64 for fp64 models) and the router auxiliary loss (or None).
    """
    extra = {"output_router_logits": True} if plan.router_aux_coef else {}
    if plan.chunk_tokens <= 0:
        out = model(**inputs, **extra, use_cache=False)
        return LossOutput(
            cross_entropy_sum(out.logits, labels), getattr(out, "aux_loss", None) if extra else None
        )
    head = model.get_output_embeddings()  # type: ignore[operator]
    targets = labels[:, 1:].reshape(-1)
    if rows is None:
        # Found here, before the model runs: under whole-model compile a nonzero() inside the head's hook would
        # break the graph there and recompile its remainder every step.
        rows = target_rows(targets)
    request = _ChunkedLoss(targets, rows, plan)
    with head_input_replaced(head, request):
        out = model(**inputs, **extra, use_cache=False)
    if request.result is None:
        raise RuntimeError(
            f"the chunked loss was not computed: {type(model).__name__}'s output head {type(head).__name__} did not "
            "run during the forward; set ce_chunk_tokens=0"
        )
    return LossOutput(request.result, getattr(out, "aux_loss", None) if extra else None)


@dataclass
class _ChunkedLoss:
    """The chunked loss of one :func:`causal_lm_loss` forward, computed from the head's input; its result."""

    targets: torch.Tensor
    rows: torch.Tensor
    plan: LossPlan
    result: torch.Tensor | None = None

    def __call__(self, head: torch.nn.Module, full: torch.Tensor) -> torch.Tensor:
        hidden = full[:, :-1].reshape(-1, full.size(-1))
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        self.result = chunked_linear_cross_entropy_sum(
            hidden,
            weight,
            self.targets.to(full.device),
            self.plan.chunk_tokens,
            self.plan.transform,
            self.rows.to(full.device, non_blocking=True),
        )
        # The head itself runs on the last position only. Contiguous: a view's stride follows the sequence length,
        # which the head's compiled graph would be guarded on (one recompile per new stride, measured).
        return full[:, -1:].contiguous()


HeadInput = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""What replaces the output head's input during one forward: ``(head, final hidden states) -> new input``."""

# The pending replacement of each output head's input, set around one forward (:func:`head_input_replaced`). Kept
# outside the module (not a hook closure, not a module attribute) so that torch.compile never sees it: a closure
# holding this step's tensors is guarded on their shapes, and a new hook every step changes the hooks dict; either
# recompiles the whole model every step until dynamo's recompile limit (measured: 27 recompiles in 8 steps,
# issue 23).
_REQUESTS: weakref.WeakKeyDictionary[torch.nn.Module, HeadInput] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


@torch.compiler.disable
def _replace_head_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """The head's forward pre-hook, registered once per head: applies the pending :data:`HeadInput`, if any.

    Eager by construction (``torch.compiler.disable``): the chunked loss's work is GEMMs that compile cannot fuse,
    and its loop runs once per chunk of this step's target rows, a count that changes every step; traced, each
    new count is a new graph. Under whole-model compile the graph breaks here once; the layers before and after
    stay compiled.
    """
    replace = _REQUESTS.get(module)
    if replace is None:  # a forward without a pending request (generation, the probe): the head runs as is
        return None
    return (replace(module, args[0]), *args[1:])


@contextmanager
def head_input_replaced(head: torch.nn.Module, replace: HeadInput) -> Iterator[None]:
    """Within the block, ``head``'s input is ``replace(head, input)``: the same hook every step (installed once),
    the step's tensors held outside the module, so compiled graphs stay valid from step to step."""
    if head not in _HOOKED:
        head.register_forward_pre_hook(_replace_head_input)
        _HOOKED.add(head)
    _REQUESTS[head] = replace
    try:
        yield
    finally:
        _REQUESTS.pop(head, None)


def causal_lm_loss_sum(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    plan: LossPlan,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The summed CE of :func:`causal_lm_loss` alone (evaluation, benches); ``rows`` as there."""
    return causal_lm_loss(model, inputs, labels, plan, rows).ce_sum
