"""Context parallel, ring attention (``cp_backend: ring``): torch's ``context_parallel`` over the ``cp`` mesh dimension.

Each rank of a context-parallel group keeps ``1/cp`` of every sequence in torch's load-balanced ("head-tail")
layout: the sequence is cut into ``2 x cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``, so that
under a causal mask every rank does the same attention work (contiguous parts would leave rank 0 almost idle).
Attention runs as a ring: each rank's queries meet every rank's keys/values as they are passed around the group,
and torch merges the partial results by their log-sum-exp. That is torch's code
(``torch.distributed.tensor.experimental.context_parallel``, the SDPA flash / memory-efficient / cuDNN kernels on
CUDA); this module lays out the batch, hands the model's attention to SDPA with ``is_causal=True`` and no mask, and
enters torch's context around each forward and backward.

What it cannot express, hence refused by name (:func:`check_ring_settings`, at start-up): any mask but plain causal
(packing, padding-free rows, CPT rows that restart positions per document, sliding-window or chunked layers,
attention soft-capping), any kernel but SDPA, and CPU (torch 2.13 has no CPU sharding rule for SDPA:
``aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy``). ``cp_backend: auto`` never picks
ring: the all-to-all backend runs everywhere with any kernel and mask; ring is chosen by asking for it.

The loss: the inputs are sharded on the host (:func:`shard_ring`, the same layout as torch's load balancer), with
each position's target taken from the whole sequence before the cut, so each rank scores exactly its own positions.
The token counts are each rank's own and add up over the group to the batch's, so the step's loss is still the mean
over every target token (:func:`~hf_fsdp2.train.step.forward_backward`'s count all-reduce), as with all-to-all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from hf_fsdp2.config.plans import ConfigError
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.parallel.all_to_all import RING_ATTENTION_NAME, ContextParallelError, check_right_padded

MARK = "_hf_fsdp2_ring"  # on each attention module: the cp device mesh (read by the step and the eval)
RING_CPU_REFUSAL = (
    "cp_backend=ring runs on CUDA only: torch 2.13's ring attention has no CPU sharding rule for SDPA "
    "('aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy'); use cp_backend=all_to_all "
    "(or auto), which runs on CPU and GPU with any kernel"
)


def ring_order(length: int, cp: int) -> torch.Tensor:
    """The whole sequence's positions in rank order under the head-tail layout: ``[length]``, whose ``i``-th slice
    of ``length / cp`` is rank ``i``'s part (chunks ``i`` and ``2cp - 1 - i`` of ``length / 2cp`` positions).

    Raises:
        ContextParallelError: ``length`` is not a multiple of ``2 x cp``.
    """
    if length % (2 * cp):
        raise ContextParallelError(
            f"ring attention cuts a sequence into 2 x cp_size = {2 * cp} chunks; length {length} does not divide "
            f"(pad it to {length + (-length) % (2 * cp)})"
        )
    chunks = torch.arange(length).view(2 * cp, length // (2 * cp))
    return torch.cat([torch.cat([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def shard_ring(
    batch: dict[str, torch.Tensor], cp: int, index: int, *, check_padding: bool = True
) -> dict[str, torch.Tensor]:
    """Context-parallel rank ``index``'s part of a collated micro-batch in the ring layout (host tensors, every rank
    of the group holding the same batch).

    The row is padded on the right to a multiple of ``2 x cp`` (no target; causal attention never lets a real token
    see padding after it), each position's target is read from the whole row (the label of the next position), and
    the rank keeps its positions (:func:`ring_order`): ``input_ids``, ``position_ids`` (their places in the row, for
    the rotary embedding) and ``labels`` one column wider than the input, column ``j + 1`` the target of position
    ``j`` (the losses of :mod:`hf_fsdp2.train.loss` read such labels as "the targets of every position").

    Raises:
        ContextParallelError: a left-padded batch, or rows holding several documents (``position_ids`` that
            restart): ring attention is causal over the whole row and would let documents see each other.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    rows, width = ids.shape
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if check_padding:
        check_right_padded(mask)
    if positions is not None and not torch.equal(positions, torch.arange(width).expand_as(positions)):
        raise ContextParallelError(
            "cp_backend=ring got a batch whose position_ids restart inside a row (packed or padding-free rows): "
            "ring attention is causal over the whole row and cannot keep documents apart; set packing=false and "
            "padding_free=false, or use cp_backend=all_to_all"
        )
    full = width + (-width) % (2 * cp)
    # [rows, full]: the target of each place of the padded row, read before the cut.
    targets = F.pad(labels[:, 1:], (0, full - width + 1), value=IGNORE_INDEX)
    order = ring_order(full, cp)
    mine = order[index * (full // cp) : (index + 1) * (full // cp)]
    return {
        "input_ids": F.pad(ids, (0, full - width), value=0)[:, mine].contiguous(),
        "labels": F.pad(targets[:, mine], (1, 0), value=IGNORE_INDEX).contiguous(),
        "position_ids": mine.expand(rows, -1).contiguous(),
    }


def ring_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention interface the model runs under ring context parallel (registered as
    :data:`~hf_fsdp2.parallel.all_to_all.RING_ATTENTION_NAME`): causal SDPA without a mask, which torch's
    ``context_parallel`` (entered by :func:`ring_context`) turns into ring attention over the cp group.

    ``query``: ``[batch, heads, part, dim]`` (this rank's positions); returns ``[batch, part, heads, dim]``.
    No mask is built for this implementation (transformers builds none for an interface without a mask function);
    one handed in anyway is refused rather than dropped.
    """
    if attention_mask is not None:
        raise ContextParallelError("cp_backend=ring runs causal attention only; the model handed it a mask")
    groups = query.shape[1] // key.shape[1]
    # GQA: whole heads for the ring kernels (torch's ring passes these key/value blocks around, as torchtitan's).
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    dropout = float(kwargs.get("dropout", 0.0)) if module.training else 0.0
    # Looked up at call time: inside torch's context_parallel the name is its ring version.
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=True, scale=kwargs.get("scaling")
    )
    return out.transpose(1, 2).contiguous(), None


def enable_ring_attention(model: torch.nn.Module, group: Any, cp: int, device_type: str = "cuda") -> str:
    """Run ``model``'s attention through :func:`ring_attention` over the context-parallel process group ``group``
    (``cp`` ranks, in cp-rank order; torch's ring needs it as a 1-D DeviceMesh, built here from the group without a
    collective). Call before sharding and compiling. Returns the line the run logs.

    Raises:
        ContextParallelError: a kernel other than SDPA, or a model whose layers need more than a causal mask.
    """
    from transformers.modeling_utils import AttentionInterface

    config: Any = getattr(model, "config")  # noqa: B009  # a transformers model's
    name = getattr(config, "_attn_implementation", None) or "eager"
    if name != "sdpa":
        raise ContextParallelError(
            f"cp_backend=ring runs torch's ring SDPA kernels; the model runs {name!r}: set attn_implementation to "
            "sdpa, or use cp_backend=all_to_all"
        )
    reason = ring_model_refusal(config)
    if reason is None and not getattr(model, "supports_context_parallel", True):
        reason = f"transformers marks {type(model).__name__} as not supporting context parallel"
    if reason:
        raise ContextParallelError(f"cp_backend=ring: {reason}; use cp_backend=all_to_all")
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group, device_type)
    AttentionInterface.register(RING_ATTENTION_NAME, ring_attention)
    marked = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") or type(module).__name__.endswith("Attention"):
            setattr(module, MARK, mesh)
            setattr(module, "_hf_fsdp2_cp", (None, None, name))  # noqa: B010  # whole_sequences restores sdpa
            marked += 1
    if not marked:
        raise ContextParallelError(f"{type(model).__name__} has no attention module ring attention can run")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for sub in {id(c): c for c in (config, text)}.values():
        sub._attn_implementation = RING_ATTENTION_NAME
    return (
        f"context parallel: ring attention (torch context_parallel, SDPA) over {cp} ranks ({marked} attention "
        f"modules); each rank holds 1/{cp} of every sequence in 2 x {cp} load-balanced chunks"
    )


def ring_model_refusal(config: Any) -> str | None:
    """Why a model config's attention is more than ring attention's plain causal mask, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(text, "layer_types", None)
    if kinds is not None and any(kind != "full_attention" for kind in kinds):
        other = sorted({kind for kind in kinds if kind != "full_attention"})
        return f"the model has {', '.join(other)} layers (layer_types), which need more than a causal mask"
    window = getattr(text, "sliding_window", None)
    if kinds is None and window is not None and getattr(text, "use_sliding_window", True):
        return f"the model has a sliding window of {window} tokens, which needs more than a causal mask"
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        return f"the model soft-caps attention logits (attn_logit_softcapping={cap}), which SDPA cannot"
    return None


def check_ring_settings(
    *,
    on_gpu: bool,
    packing: bool,
    padding_free: bool | None,
    attn_implementation: str,
    model_config: Any = None,
) -> None:
    """Refuse, before any work, what ``cp_backend: ring`` cannot run (which methods run it is their capability:
    :func:`hf_fsdp2.run.registry.check_capabilities`).

    Args:
        on_gpu: whether the run has CUDA devices.
        packing: rows hold several documents (SFT ``packing``, CPT rows without ``cross_document_attention``).
        padding_free: ``padding_free`` as set (None: unset, which resolves off with SDPA on a GPU).
        attn_implementation: the model section's ``attn_implementation`` (``auto``: SDPA is asked for below).
        model_config: the model's config, for layers that need more than a causal mask (None: not checked).

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    if not on_gpu:
        raise ConfigError(RING_CPU_REFUSAL)
    if packing:
        raise ConfigError(
            "cp_backend=ring with packed rows (packing=true, or CPT rows with cross_document_attention=false): ring "
            "attention is causal over the whole row and cannot keep documents apart; set packing=false, or use "
            "cp_backend=all_to_all, which keeps documents apart on every rank"
        )
    if padding_free:
        raise ConfigError(
            "cp_backend=ring with padding_free=true: one row per micro-batch holds several examples that ring "
            "attention (causal over the whole row) would let see each other; set padding_free=false, or use "
            "cp_backend=all_to_all"
        )
    if attn_implementation not in ("auto", "sdpa"):
        raise ConfigError(
            f"cp_backend=ring with attn_implementation={attn_implementation}: torch's ring attention runs the SDPA "
            "flash / memory-efficient / cuDNN kernels only; set attn_implementation=sdpa, or use "
            "cp_backend=all_to_all (which wraps any kernel)"
        )
    reason = ring_model_refusal(model_config) if model_config is not None else None
    if reason:
        raise ConfigError(f"cp_backend=ring: {reason}; use cp_backend=all_to_all")


def ring_mesh(model: torch.nn.Module) -> Any:
    """The cp device mesh ``model`` runs ring attention over, or None (all-to-all or no context parallel)."""
    return next((getattr(m, MARK) for m in model.modules() if hasattr(m, MARK)), None)


_CHECKED: set[int] = set()


@contextlib.contextmanager
def ring_context(mesh: Any) -> Iterator[None]:
    """Inside the block, SDPA is torch's ring attention over ``mesh`` (every rank of the cp group enters it for the
    same forwards and backwards; the backward must run inside too). A no-op for ``mesh`` None.

    torch's ``context_parallel`` shards the buffers it is handed; ours are sharded on the host already (the token
    counts and the chunked loss's rows need each rank's labels before the forward), so it is handed a marker of
    ``2 x cp`` positions, whose shard is checked once per mesh against :func:`ring_order`: the two layouts agree.
    """
    if mesh is None:
        yield
        return
    from torch.distributed.tensor.experimental import context_parallel

    cp, index = mesh.size(), mesh.get_local_rank()
    marker = torch.arange(2 * cp, device=mesh.device_type)
    with context_parallel(mesh, buffers=[marker], buffer_seq_dims=[0], no_restore_buffers={marker}):
        if id(mesh) not in _CHECKED:  # one host read per mesh
            expected = ring_order(2 * cp, cp)[2 * index : 2 * index + 2]
            if marker.tolist() != expected.tolist():
                raise ContextParallelError(
                    f"torch's context_parallel gave cp rank {index} positions {marker.tolist()} where the host "
                    f"layout expects {expected.tolist()}: this torch's load balancing differs; use "
                    "cp_backend=all_to_all"
                )
            _CHECKED.add(id(mesh))
        yield
