"""One forward + backward of the meta model at the run's micro-batch shape (:func:`compute_bytes`): the
activations and loss autograd keeps (:class:`~hf_fsdp2.plan.saved.SavedTensorMeter`) and the
largest working set, with the run's activation checkpointing, loss path and attention kernel."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_fsdp2.config.plans import ACPlan
from hf_fsdp2.lora.quantize import is_nf4
from hf_fsdp2.plan.context import meta_context_parallel, rank_inputs
from hf_fsdp2.plan.meta_model import build_meta_model, check_plannable, layer_classes
from hf_fsdp2.plan.saved import SavedBytes, SavedTensorMeter, param_storages, storages
from hf_fsdp2.plan.settings import PlanError, PlanSettings

if TYPE_CHECKING:
    from hf_fsdp2.attention_layout import AttentionLayout


class _MetaForward(TorchFunctionMode):
    """Let a transformers forward run on meta tensors as it runs on the device.

    A meta tensor has no values: the data-dependent checks of the mask code (is there padding? packed
    sequences?) read as True, as they do for the planned batch (full rows, one sequence each). SDPA on meta
    decomposes into the math kernel (which saves the attention probabilities); it is sent to the kernel the
    device picks instead: ``flash_attention_for_cpu`` on CPU; on a GPU flash attention, or memory-efficient
    attention with a mask or a head dim over 256 (each saves query, key, value, output and logsumexp).
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            out = self._attention(*args, **kwargs)
            if out is not None:
                return out
        if func in _GROUPED_MM and args[0].is_meta and args[0].dtype != torch.bfloat16:
            # The meta kernel of grouped_mm takes bf16 only (CUDA's); the CPU kernel and the fp32 loop the experts
            # fall back to save the same two inputs.
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            return _MetaGroupedMM.apply(args[0], args[1], offs)
        return func(*args, **kwargs)

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor | None:
        aten = torch.ops.aten
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As scaled_dot_product_attention does before any kernel: a new additive mask in the query's dtype,
            # per call (the memory-efficient kernel keeps it for backward: one per layer).
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
        if self.device_type == "cpu":
            if dropout_p:
                return None  # the CPU picks the math kernel with dropout, as the meta decomposition does
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if attn_mask is None and query.shape[-1] <= 256:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if key.shape[1] != query.shape[1]:  # memory-efficient attention takes no grouped KV heads
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]


class _MetaGroupedMM(torch.autograd.Function):
    """``grouped_mm(x [S, in], w [G, in, out], offs)`` on meta tensors of any dtype: the output's shape, and what the
    kernel saves for backward (both inputs and the offsets)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        return x.new_empty((x.shape[0], w.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), None


_GROUPED_MM = tuple(
    f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None
)


def _under_meta_forward(forward: Any, device_type: str) -> Any:
    """``forward`` run under :class:`_MetaForward`: a checkpointed layer recomputes in backward, where the
    autograd engine does not carry torch-function modes, so each layer enters its own."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _MetaForward(device_type):
            return forward(*args, **kwargs)

    return run


class _LiveBytes(TorchDispatchMode):
    """The largest total of live storages that ops created (parameters and their storages excluded)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            for storage in storages(value):
                key = storage._cdata
                if key not in self.exclude and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        # ``current`` still counts the storages that died since the last sweep, so it bounds the live total from
        # above: only a bound over the peak needs the sweep (exact, and linear rather than quadratic in ops).
        # A weak reference keeps its storage's address, so a dead entry's key is never reused meanwhile.
        if self.current > self.peak:
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.current -= self.live.pop(key)[1]
            self.peak = max(self.peak, self.current)
        return out


@dataclass(frozen=True)
class ComputeBytes:
    """What one micro-batch's forward + backward needs besides the sharded state and the FSDP buffers."""

    saved: SavedBytes
    peak: int  # the largest total of live tensors during forward + backward (saved ones included)

    @property
    def transient(self) -> int:
        return max(0, self.peak - self.saved.activations - self.saved.loss)


def _chunked_loss_possible(model: torch.nn.Module) -> bool:
    head = model.get_output_embeddings()  # type: ignore[operator]
    return (
        isinstance(head, torch.nn.Module)
        and getattr(head, "weight", None) is not None
        and getattr(head, "bias", None) is None
    )


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _planned_inputs(
    ids: torch.Tensor, layout: AttentionLayout, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The forward's inputs for the planned rows. Rows of several documents carry restarting ``position_ids``
    and no ``attention_mask``; on meta the packed-sequence check of transformers' masking_utils cannot read them
    (no values), so where the run's kernel gets a dense mask it is handed here, the mask transformers builds:
    ``[rows, 1, T, T]``, bool for sdpa (``sdpa_mask``), the compute dtype for eager (``eager_mask``)."""
    if not (layout.padding_free or layout.packing):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = {"input_ids": ids, "position_ids": torch.zeros_like(ids)}
    if layout.dense_mask:
        rows, tokens = ids.shape
        mask_dtype = torch.bool if layout.kernel == "sdpa" else dtype
        inputs["attention_mask"] = torch.zeros((rows, 1, tokens, tokens), dtype=mask_dtype, device=ids.device)
    return inputs


def compute_bytes(model_config: Any, settings: PlanSettings) -> ComputeBytes:
    """Run one forward + backward of the meta model at the run's micro-batch shape and count its memory.

    Activation checkpointing is the toolkit's own, applied as the run applies it; ``offload`` is planned from
    a ``full`` forward whose layer inputs go to host memory. Every parameter is cast to the compute dtype (what
    FSDP2's mixed-precision policy gathers); a parameter's gradient is dropped as soon as it is accumulated,
    as FSDP2 reduce-scatters it (the buffers of that are in :func:`fsdp_buffer_bytes`).

    Raises:
        PlanError: the model cannot run on the meta device (data-dependent code such as experts that are not
            transformers' fused experts).
    """
    import torch.fx.experimental._config as fx_config

    from hf_fsdp2.parallel.activations import apply_activation_checkpointing, decoder_layers
    from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, logit_transform_for, router_aux_coef

    model = build_meta_model(model_config, settings)
    check_plannable(model_config, model)
    layer_cls = layer_classes(model, settings)
    for _, layer in decoder_layers(model, layer_cls):
        layer.forward = _under_meta_forward(layer.forward, settings.device_type)
    offload = settings.ac.mode == "offload"
    plan = ACPlan("full", settings.ac.every_k, pin_memory=False) if offload else settings.ac
    try:
        apply_activation_checkpointing(model, plan, layer_cls)
    except ValueError as err:
        raise PlanError(str(err)) from err
    compute = settings.compute_dtype
    for param in model.parameters():  # an NF4 weight stays NF4: its linear dequantises to the input's dtype
        if compute is not None and param.dtype != compute and not is_nf4(param):
            param.data = param.data.to(compute)
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    chunk = settings.ce_chunk_tokens if _chunked_loss_possible(model) else 0
    loss_plan = LossPlan(chunk, logit_transform_for(model.config), router_aux_coef(model.config))
    params = param_storages(model)
    layout = settings.layout(model_config)
    # Padding-free: the micro-batch is one row of all its tokens (so a dense mask is [1, 1, T, T] over all of them).
    shape = (
        (1, settings.micro_batch * settings.seq_len)
        if layout.padding_free
        else (settings.micro_batch, settings.seq_len)
    )
    live = _LiveBytes(params)
    meter = SavedTensorMeter(model, layer_cls)
    # Context parallel: the run's all-to-all attention on rank 0's part of each sequence (hf_fsdp2.plan.context).
    parallel = (
        meta_context_parallel(model, settings.cp, settings.device_type)
        if settings.cp > 1
        else contextlib.nullcontext()
    )
    try:
        # Data-dependent sizes (nonzero: the rows with a target) read as "every element": the planned batch
        # is full rows, every token a target.
        with (
            _MetaForward(settings.device_type),
            live,
            fx_config.patch(meta_nonzero_assume_all_nonzero=True),  # type: ignore[attr-defined]
            parallel,
        ):
            ids = torch.zeros(shape, dtype=torch.long, device="meta")
            if settings.cp > 1:
                inputs, labels = rank_inputs(ids, layout, settings.cp)
            else:
                inputs, labels = _planned_inputs(ids, layout, compute or _param_dtype(model)), ids
            with meter:
                out = causal_lm_loss(model, inputs, labels, loss_plan)
            saved = meter.result(offload_layer_inputs=offload)
            on_device = meter.result()
            total = out.ce_sum if out.aux_loss is None else out.ce_sum + out.aux_loss
            del out
            total.backward()
    except (RuntimeError, NotImplementedError) as err:
        raise PlanError(
            f"{type(model).__name__} cannot run its forward on the meta device ({str(err).splitlines()[0]}); "
            "the activation memory of this model cannot be planned (data-dependent code such as MoE routing)"
        ) from err
    # offload: the forward ran as full, whose layer inputs the run keeps in host memory instead (one comes back
    # at a time for its recompute, as full's working set already counts).
    return ComputeBytes(saved, live.peak - (on_device.activations - saved.activations))
