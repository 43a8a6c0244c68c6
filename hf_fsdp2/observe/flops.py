"""FLOPs per token and MFU (torchtitan / nanoGPT conventions, docs/observability.md).

A sequence of ``s`` real tokens costs ``s * (6 * N + 12 * L * H * Q * s)`` where ``N`` is the parameter count
without the input embedding table (of a mixture of experts, the parameters a token runs: each layer's routed experts
counted ``top_k / experts`` of them, :func:`active_non_embedding_params`), ``L`` layers, ``H`` attention heads, ``Q`` head dim; ``T = s`` is each
sequence's own non-pad length (a packed row holds several sequences). Forward + backward only:
activation-checkpointing recompute is never counted. MFU = achieved FLOP/s per device / the device's peak
dense bf16 FLOP/s (``PEAK_FLOPS`` or the ``peak_flops`` key); without a known peak only the achieved FLOP/s
is reported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.labels import IGNORE_INDEX

# Peak dense bf16 tensor-core FLOP/s of one device as torch sees it (no sparsity), from the vendors'
# datasheets (their "with sparsity" figures halved). Matched against torch.cuda.get_device_name()
# ("NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL", "NVIDIA L40S", "AMD Instinct MI250X", ...) by
# peak_flops_for: whole tokens only, the longest name first, so "L4" never matches "NVIDIA L40" nor
# "H200" "NVIDIA GH200 480GB", and "H100 NVL" wins over "H100".
PEAK_FLOPS: dict[str, float] = {
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "H200 NVL": 835e12,  # the PCIe card, 600 W: 1,671 TFLOP/s with sparsity
    "H200": 989e12,  # SXM
    "GH200": 989e12,
    "H20": 148e12,
    "B200": 2.25e15,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    # Each of the package's two GCDs is a device of its own (torch sees 8 on a 4-package node): half of
    # the 383 TFLOP/s AMD quotes per package.
    "MI250X": 191.5e12,
}
# Longest first: the most specific name that matches wins.
_PEAK_PATTERNS = tuple(
    (re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])"), flops)
    for name, flops in sorted(PEAK_FLOPS.items(), key=lambda item: -len(item[0]))
)


def peak_flops_for(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from ``PEAK_FLOPS``, or None when it is not listed.

    Args:
        device_name: what ``torch.cuda.get_device_name()`` reports, e.g. ``"NVIDIA H200 NVL"``.

    Returns:
        The entry of the longest table name found in ``device_name`` as whole tokens (delimited by
        anything but a letter or digit: ``"A100"`` matches ``"NVIDIA A100-SXM4-80GB"``, ``"L4"`` does not
        match ``"NVIDIA L40"``), or None (then the ``peak_flops`` key gives the peak, else no MFU).
    """
    for pattern, flops in _PEAK_PATTERNS:
        if pattern.search(device_name):
            return flops
    return None


@dataclass(frozen=True)
class FlopsModel:
    """FLOPs of forward + backward: ``6 * N`` per token plus ``12 * L * H * Q`` per token and unit of length.

    Attributes:
        non_embedding_params: ``N``: every parameter except the input embedding table (an output head
            is a matmul and counts; a head tied to the embeddings counts once, as the head).
        layers: ``L``, decoder layers.
        heads: ``H``, attention (query) heads.
        head_dim: ``Q``, dimension of each head.
    """

    non_embedding_params: int
    layers: int
    heads: int
    head_dim: int

    def per_token(self, seq_len: int) -> float:
        """``6 * N + 12 * L * H * Q * T`` for a token of a sequence of ``T = seq_len`` tokens."""
        return 6.0 * self.non_embedding_params + 12.0 * self.layers * self.heads * self.head_dim * seq_len

    def for_sequences(self, lengths: Sequence[int]) -> float:
        """FLOPs of sequences of these non-pad lengths: ``sum(s * per_token(s))``."""
        total = sum(lengths)
        squares = sum(s * s for s in lengths)
        return (
            6.0 * self.non_embedding_params * total
            + 12.0 * self.layers * self.heads * self.head_dim * squares
        )


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters of ``model`` minus its input embedding table (works on meta and unsharded models).

    A tied output head shares the table's tensor: it is then counted once, as the head's matmul.
    """
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    get_input, get_output = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    embeddings = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    if isinstance(embeddings, torch.nn.Module):
        table = getattr(embeddings, "weight", None)
        head_weight = getattr(head, "weight", None) if head is not None else None
        if table is not None and table is not head_weight:
            total -= table.numel()
    return total


def inactive_expert_params(model: torch.nn.Module) -> int:
    """The routed experts' parameters a token does not run: of each experts module transformers dispatches (its fused
    ``[experts, ...]`` tensors, global shapes under expert parallel), the share ``1 - top_k / experts`` (``top_k``: the
    config's ``num_experts_per_tok``). 0 for a dense model; shared experts and routers run for every token and count.
    """
    from hf_fsdp2.parallel.experts import experts_count, find_experts

    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    total = 0.0
    for module in find_experts(model).values():
        experts = experts_count(module)
        if 0 < top_k < experts:
            total += sum(p.numel() for p in module.parameters()) * (experts - top_k) / experts
    return int(total)


def active_non_embedding_params(model: torch.nn.Module) -> int:
    """``N`` of the FLOPs model: :func:`non_embedding_params` less :func:`inactive_expert_params` (a mixture of experts
    counted at the experts each token is routed to, as its "active parameters"; a dense model: every parameter)."""
    return non_embedding_params(model) - inactive_expert_params(model)


def flops_model(model_config: Any, non_embedding: int) -> FlopsModel:
    """The :class:`FlopsModel` of an HF decoder config (``num_hidden_layers``, ``num_attention_heads``, ...).

    Args:
        model_config: the model's ``PretrainedConfig`` (its text config for multimodal models).
        non_embedding: ``N`` from :func:`non_embedding_params`.

    Returns:
        The FLOPs model; ``head_dim`` is the config's, else ``hidden_size // num_attention_heads``.
    """
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return FlopsModel(non_embedding, int(config.num_hidden_layers), heads, int(head_dim))


def sequence_lengths(batch: Mapping[str, torch.Tensor], pad_token_id: int | None) -> list[int]:
    """Non-pad lengths of the sequences of a collated batch (what FLOPs and ``tokens`` count).

    A padded batch (``attention_mask``) holds one sequence per row. A batch with ``position_ids``
    (packed or padding-free) holds a sequence wherever the positions restart at 0; a row's trailing
    run of pad ids without labels is its padding, not a sequence.

    Args:
        batch: ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels``.
        pad_token_id: the pad id (None: no padding detection in packed rows).

    Returns:
        One length per real sequence.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    labels = batch.get("labels")
    if positions is None:
        if mask is None:
            return [int(ids.shape[1])] * int(ids.shape[0])
        return [int(n) for n in mask.sum(dim=1).tolist()]
    lengths: list[int] = []
    width = int(ids.shape[1])
    for row in range(int(ids.shape[0])):
        starts = (positions[row] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, width]
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            n = int(mask[row, a:b].sum()) if mask is not None else b - a
            last = i == len(bounds) - 2
            if mask is None and last and i > 0 and pad_token_id is not None:
                is_pad = bool((ids[row, a:b] == pad_token_id).all()) and (
                    labels is None or bool((labels[row, a:b] == IGNORE_INDEX).all())
                )
                if is_pad:
                    continue
            if n:
                lengths.append(n)
    return lengths


def tokens_and_flops(
    batch: Mapping[str, torch.Tensor], flops: FlopsModel, pad_token_id: int | None
) -> tuple[int, float]:
    """Non-pad tokens and FLOPs of one collated micro-batch, each sequence at its own length.

    What the training loop's meter charges a micro-batch (and the benches, so that their MFU is the
    recipe's): :func:`sequence_lengths` then :meth:`FlopsModel.for_sequences`. A packed row of
    documents of lengths ``s_i`` costs ``sum(s_i * (6N + 12LHQ * s_i))``, less than its width times
    ``per_token(width)``.

    Args:
        batch: ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels`` (host tensors).
        flops: the model's FLOPs model.
        pad_token_id: the pad id (None: no padding detection in packed rows).

    Returns:
        (non-pad tokens, FLOPs of forward + backward).
    """
    lengths = sequence_lengths(batch, pad_token_id)
    return sum(lengths), flops.for_sequences(lengths)
