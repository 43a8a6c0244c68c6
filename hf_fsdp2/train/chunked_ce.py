"""The chunked linear cross entropy and the output-head hook that feeds it.

The summed CE of ``transform(hidden @ weight.T)`` computed chunk by chunk from the final hidden states, without the
full ``[tokens x vocab]`` logits, with its gradients computed in forward; and the forward pre-hook on the output head
that hands it the hidden states inside the head's own call (:func:`head_input_replaced`). The loss plan that decides
when it is used, and :func:`hf_fsdp2.train.loss.causal_lm_loss` that uses it, are in :mod:`hf_fsdp2.train.loss`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_fsdp2.labels import IGNORE_INDEX


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed and accumulated in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to the head's output before it is a logit: ``softcap(raw * scale)``.

    Gemma-2/3 cap the logits (``final_logit_softcapping``: ``c * tanh(x / c)``), Granite divides them
    (``logits_scaling``), Cohere and Falcon-H1 multiply them (``logit_scale``, ``lm_head_multiplier``). The chunked
    loss computes from the head's raw output, so it must apply the same transform, or its loss is not the model's.
    """

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """The logits from the head's raw output."""
        out = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def chunk_logits(
        self, h: torch.Tensor, head: torch.Tensor, acc: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk's logits ``transform(h @ head.T)`` in ``acc`` (scaled in place), and the soft-cap's tanh, which
        the backward's derivative needs (None without a cap)."""
        logits = (h @ head.t()).to(acc)
        capped = None
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap:
            capped = torch.tanh(logits / self.softcap)
            logits = capped * self.softcap
        return logits, capped

    def describe(self) -> str:
        parts = []
        if self.scale != 1.0:
            parts.append(f"x {self.scale:g}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        return ", ".join(parts) or "none"


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
        vocab: VocabShard | None,
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
            logits, capped = transform.chunk_logits(h, head, acc)
            if vocab is None:
                picked = logits.gather(1, t[:, None]).squeeze(1)
                top = logits.amax(dim=-1, keepdim=True)
                probs = logits.sub_(top).exp_()  # in place: the logits are not needed any more
                norm = probs.sum(dim=-1, keepdim=True)
                total += ((top + norm.log()).squeeze(1) - picked).sum()
                # d(sum CE)/d logits = softmax - one-hot, computed in place.
                probs.div_(norm)
                probs[torch.arange(probs.size(0), device=probs.device), t] -= 1.0
            else:
                probs, chunk_loss = _vocab_parallel_softmax_grad(logits, t, vocab)
                total += chunk_loss
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
        return gh, gw, None, None, None, None, None


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of an output head split over the vocabulary across a tensor-parallel group (loss parallel):
    the group, and the first vocabulary id it holds."""

    group: Any
    start: int


def vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """The :class:`VocabShard` of a head weight that is a DTensor split over its rows (``Shard(0)``, torch.chunk's
    split) on a 1-D mesh (tensor parallel's ``VocabHead``); None for any other weight."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor) or tuple(weight.placements) != (Shard(0),):
        return None
    mesh = weight.device_mesh
    rows = int(weight.shape[0])
    per = -(-rows // mesh.size())
    return VocabShard(mesh.get_group(), min(mesh.get_local_rank() * per, rows))


def _vocab_parallel_softmax_grad(
    logits: torch.Tensor, targets: torch.Tensor, vocab: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of a vocabulary-split head: ``logits`` are this rank's columns ``[chunk, V / tp]``. Each rank's
    maximum, sum of exponentials and target logit (0 where another rank holds the target) travel in one all-gather of
    ``[3, chunk]`` (every rank of the group, same chunk); each rank then has the whole log-sum-exp. Returns the
    gradient of the summed CE for its columns (softmax - one-hot, in place of ``logits``) and the chunk's summed CE
    (the same on every rank)."""
    columns = logits.size(1)
    local = targets - vocab.start
    owned = (local >= 0) & (local < columns)
    index = local.clamp(0, columns - 1)
    picked = logits.gather(1, index[:, None]).squeeze(1).masked_fill(~owned, 0.0)
    top = logits.amax(dim=-1)
    probs = logits.sub_(top[:, None]).exp_()
    stats = torch.stack([top, probs.sum(dim=-1), picked])
    ranks = dist.get_world_size(vocab.group)
    gathered = stats.new_empty((ranks * 3, stats.size(1)))
    dist.all_gather_into_tensor(gathered, stats, group=vocab.group)
    per_rank = gathered.view(ranks, 3, -1)
    peak = per_rank[:, 0].amax(dim=0)
    lse = peak + (per_rank[:, 1] * (per_rank[:, 0] - peak).exp()).sum(dim=0).log()
    probs.mul_((top - lse).exp()[:, None])  # exp(logit - top) * exp(top - lse): this rank's softmax columns
    rows = torch.arange(probs.size(0), device=probs.device)
    probs[rows[owned], index[owned]] -= 1.0
    return probs, (lse - per_rank[:, 2].sum(dim=0)).sum()


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
    vocab: VocabShard | None = None,
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
        vocab: ``weight`` is this rank's rows of a head split over the vocabulary (:func:`vocab_shard`): loss
            parallel, one ``[3, chunk]`` all-gather over its group per chunk; the gradient of ``hidden`` is then this
            rank's partial sum (the caller reduces it over the group).

    Returns:
        A scalar tensor (fp32, fp64 for fp64 inputs) whose gradients match the plain computation's.
    """
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, targets, chunk_tokens, transform or LogitTransform(), rows, vocab
    )


def target_rows(targets: torch.Tensor) -> torch.Tensor:
    """The positions of ``[tokens]`` shifted targets that carry a loss (not ``-100``), in order."""
    return (targets != IGNORE_INDEX).nonzero().squeeze(1)


HeadInput = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
"""What replaces the output head's input during one forward: ``(head, final hidden states) -> new input``."""

# The pending replacement of each output head's input, set around one forward (:func:`head_input_replaced`). Kept
# outside the module (not a hook closure, not a module attribute) so that torch.compile never sees it: a closure
# holding this step's tensors is guarded on their shapes, and a new hook every step changes the hooks dict; either
# recompiles the whole model every step until dynamo's recompile limit (measured: 27 recompiles in 8 steps).
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
