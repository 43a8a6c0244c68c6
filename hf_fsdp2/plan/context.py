"""Context parallel in the memory plan (``cp_size > 1``, the all-to-all backend of :mod:`hf_fsdp2.parallel.all_to_all`).

Each rank of a context-parallel group holds ``ceil(S / cp)`` tokens of every sequence (``S`` padded to a multiple of
``cp``), so the meta forward of :mod:`hf_fsdp2.plan.compute` runs at that width: activations, norms, MLPs, the loss
and logits cost ``1/cp``. Around each attention the run's own :func:`~hf_fsdp2.parallel.all_to_all.cp_attention` runs
on the meta model too (:func:`meta_context_parallel`): q, k, v of ``[b, heads, S/cp, d]`` become ``[b, heads/cp, S,
d]`` (KV heads repeated when they do not divide), the kernel runs on the whole sequence with ``heads/cp`` heads (its
saved tensors and temporaries are those of ``S`` tokens), the documents' and window's mask is built per layer when the
run builds one (on CUDA flex attention's block mask, a fused kernel's saved tensors; elsewhere a dense ``[b, 1, S, S]``
one: :mod:`hf_fsdp2.parallel.block_mask`), and the output goes back as ``[b, S/cp, heads, d]``. The all-to-all, which needs a process group, is
replaced there by a local copy of the same shape (what a rank receives), so every byte the run allocates around it
is counted by the meta forward. :class:`ContextPlan` states those per-layer sizes from the shapes alone, for the
plan's lines and its tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.nn.functional as F

from hf_fsdp2.config.plans import ConfigError, HeadSplit, split_heads
from hf_fsdp2.plan.settings import PlanError, PlanSettings

if TYPE_CHECKING:
    from hf_fsdp2.attention_layout import AttentionLayout


def _text_config(model_config: Any) -> Any:
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def head_dim(model_config: Any) -> int:
    """The attention head size of a config (``head_dim`` when it has one, else hidden / heads)."""
    text = _text_config(model_config)
    explicit = getattr(text, "head_dim", None)
    return int(explicit) if explicit else int(text.hidden_size) // int(text.num_attention_heads)


@dataclass(frozen=True, kw_only=True)
class ContextPlan:
    """The per-layer bytes the all-to-all adds on one rank, from the shapes alone.

    Attributes:
        split: the head split (:func:`~hf_fsdp2.config.plans.split_heads`, as the run makes it).
        rows: rows of a micro-batch (1 when padding-free).
        tokens: the whole sequence a row has after padding to a multiple of ``cp`` (``S``).
        head_dim: size of one head.
        itemsize: bytes of the compute dtype.
        kernel: the run's attention kernel the all-to-all wraps.
        mask_rows: rows of the mask the run builds per layer (1 for a plain causal one of one document per row), 0
            when it builds none.
        mask_itemsize: 1 (bool, for sdpa) or the compute dtype's (an additive mask, for eager).
        block: the mask is flex attention's block mask (the device trains flex attention), not a dense one.
        documents: the block mask reads each row's document ids (packed or padding-free rows).
    """

    split: HeadSplit
    rows: int
    tokens: int
    head_dim: int
    itemsize: int
    kernel: str
    mask_rows: int
    mask_itemsize: int
    block: bool = False
    documents: bool = False

    @property
    def part(self) -> int:
        """Tokens of each sequence one rank holds: ``S / cp``."""
        return self.tokens // self.split.cp

    @property
    def gathered_bytes(self) -> int:
        """q, k and v after the first all-to-all: ``[rows, heads/cp, S, d]`` and twice ``[rows, kv x repeat / cp,
        S, d]``; the kernel keeps them for backward."""
        s = self.split
        heads = s.heads // s.cp + 2 * (s.kv_heads * s.kv_repeat) // s.cp
        return self.rows * heads * self.tokens * self.head_dim * self.itemsize

    @property
    def scattered_bytes(self) -> int:
        """The output after the second all-to-all: ``[rows, S/cp, heads, d]`` (the kernel's ``[rows, S, heads/cp,
        d]`` output is as large)."""
        return self.rows * self.part * self.split.heads * self.head_dim * self.itemsize

    @property
    def mask_bytes(self) -> int:
        """The mask built per layer (0 when none): the block mask's tile lists and document ids
        (:func:`~hf_fsdp2.parallel.block_mask.block_mask_bytes`), or the dense ``[rows, 1, S, S]`` one."""
        from hf_fsdp2.parallel.block_mask import block_mask_bytes, dense_mask_bytes

        if not self.mask_rows:
            return 0
        if self.block:
            return block_mask_bytes(self.mask_rows, self.tokens, self.documents)
        return dense_mask_bytes(self.mask_rows, self.tokens, self.mask_itemsize)

    def describe(self, human_bytes: Callable[[float], str]) -> str:
        """The plan's line: what context parallel does and what it costs per layer (sizes written by
        ``human_bytes``, the table's)."""
        s = self.split
        if not self.mask_rows:
            mask = "; no mask (causal kernel)"
        elif self.block:
            mask = f"; flex attention's block mask per layer {human_bytes(self.mask_bytes)} (no dense mask)"
        else:
            mask = (
                f"; a [{self.mask_rows}, 1, {self.tokens}, {self.tokens}] "
                f"{'bool' if self.mask_itemsize == 1 else 'additive'} mask per layer {human_bytes(self.mask_bytes)}"
            )
        return (
            f"context parallel {s.cp} (all-to-all around the {self.kernel} kernel): each rank holds {self.part} of "
            f"the {self.tokens} tokens of every sequence (activations, MLPs, loss and logits at 1/{s.cp}); per "
            f"attention: {s.describe()}, q/k/v gathered {human_bytes(self.gathered_bytes)} (kept by the kernel), "
            f"output scattered back {human_bytes(self.scattered_bytes)}{mask}"
        )


def rank_tokens(settings: PlanSettings, padding_free: bool) -> tuple[int, int]:
    """The micro-batch a rank runs: ``(rows, whole-sequence tokens S)``; each rank holds ``S / cp`` of them (the
    width padded to a multiple of ``cp``, as :func:`~hf_fsdp2.parallel.all_to_all.shard_sequence` pads it)."""
    rows, width = (
        (1, settings.micro_batch * settings.seq_len)
        if padding_free
        else (settings.micro_batch, settings.seq_len)
    )
    return rows, width + (-width) % settings.cp


def builds_mask(layout: AttentionLayout, model_config: Any) -> bool:
    """Whether :func:`~hf_fsdp2.parallel.all_to_all.cp_attention` builds a ``[b, 1, S, S]`` mask: for eager always, for
    sdpa when rows hold several documents or the model has a sliding window; flash kernels take position_ids."""
    if layout.kernel.startswith("flash"):
        return False
    window = getattr(_text_config(model_config), "sliding_window", None)
    return layout.kernel == "eager" or layout.packing or layout.padding_free or bool(window)


def context_plan(
    model_config: Any, settings: PlanSettings, layout: AttentionLayout, itemsize: int
) -> ContextPlan:
    """The :class:`ContextPlan` of a run with ``settings.cp > 1``, refusing what the run refuses.

    Raises:
        PlanError: heads that do not split over ``cp`` (the run's :func:`split_heads`), or a kernel the all-to-all
            cannot wrap.
    """
    from hf_fsdp2.parallel.all_to_all import INNER_KERNELS

    if layout.kernel not in INNER_KERNELS:
        raise PlanError(
            f"context parallel (all-to-all) wraps the attention kernels {', '.join(INNER_KERNELS)}; this run's "
            f"kernel is {layout.kernel!r}: set attn_implementation to sdpa (or flash_attention_2 on GPU)"
        )
    text = _text_config(model_config)
    try:
        split = split_heads(
            int(text.num_attention_heads), getattr(text, "num_key_value_heads", None), settings.cp
        )
    except ConfigError as err:
        raise PlanError(str(err)) from err
    rows, tokens = rank_tokens(settings, layout.padding_free)
    from hf_fsdp2.parallel.all_to_all import ContextParallelError, check_dense_mask, dense_mask_reason
    from hf_fsdp2.parallel.block_mask import flex_trains_on

    mask = builds_mask(layout, model_config)
    documents = layout.packing or layout.padding_free
    # One document per row and no window: allowed_pairs gives one [1, 1, S, S] mask for every row.
    mask_rows = (rows if documents else 1) if mask else 0
    if mask_rows and not flex_trains_on(settings.device_type):
        try:  # the run's refusal of a dense mask too large for one layer
            check_dense_mask(mask_rows, tokens, 1, dense_mask_reason(settings.device_type, {}))
        except ContextParallelError as err:
            raise PlanError(str(err)) from err
    return ContextPlan(
        split=split,
        rows=rows,
        tokens=tokens,
        head_dim=head_dim(model_config),
        itemsize=itemsize,
        kernel=layout.kernel,
        mask_rows=mask_rows,
        mask_itemsize=1 if layout.kernel == "sdpa" else itemsize,
        block=flex_trains_on(settings.device_type),
        documents=documents,
    )


def _received(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """What the all-to-all hands a rank, without a process group: a new tensor of the input's shape (the input made
    contiguous first, as the run's collective does); gradients flow through as the collective's do."""
    return chunks.contiguous().clone()


def _fused_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    *,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Flex attention's fused kernel on meta tensors: what it allocates and keeps (query, key, value, output and the
    log-sum-exp, no scores) is what a flash kernel keeps, which the planner's meta forward sends sdpa to on a GPU."""
    grouped = key.shape[1] != query.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=grouped)
    return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def meta_context_parallel(model: torch.nn.Module, cp: int, device_type: str) -> Iterator[None]:
    """Run ``model``'s attention through the run's :func:`~hf_fsdp2.parallel.all_to_all.cp_attention` over ``cp``
    emulated ranks inside the block (the meta model: no process group; each all-to-all a local copy of its shape),
    choosing the mask as the run does on ``device_type`` (flex attention's block mask where it trains)."""
    from hf_fsdp2.parallel import all_to_all
    from hf_fsdp2.parallel.block_mask import flex_trains_on

    try:
        all_to_all.enable_context_parallel(model, None, cp)
    except (ConfigError, all_to_all.ContextParallelError) as err:
        raise PlanError(str(err)) from err
    with (
        mock.patch.object(all_to_all, "_all_to_all", _received),
        mock.patch.object(all_to_all, "flex_trains_on", lambda device: flex_trains_on(device_type)),
        mock.patch.object(all_to_all, "flex", _fused_flex),
    ):
        yield


def rank_inputs(
    ids: torch.Tensor, layout: AttentionLayout, cp: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank 0's part of the planned micro-batch ``ids`` (``[rows, S]``) as the run's step hands it to the model
    (:func:`~hf_fsdp2.parallel.all_to_all.shard_sequence`: no attention mask, the part's position_ids, the whole row's
    positions for a mask over documents) and its labels (one column wider)."""
    from hf_fsdp2.parallel.all_to_all import POSITIONS_KEY, shard_sequence

    batch = {"input_ids": ids, "labels": ids}
    documents = (layout.padding_free or layout.packing) and not layout.kernel.startswith("flash")
    if documents:
        batch["position_ids"] = torch.zeros_like(ids)
    # shard_sequence numbers a row's positions on the host: the meta forward needs every input on meta.
    part = {k: v.to(ids.device) for k, v in shard_sequence(batch, cp, 0).items()}
    inputs = {k: v for k, v in part.items() if k != "labels"}
    if not documents:
        inputs.pop(POSITIONS_KEY, None)
    return inputs, part["labels"]
