"""The batch layout and attention kernel of a run: padding-free or padded batches, and the kernel that keeps
the documents of a row apart, decided once from the model's config and the environment (every rank alike)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from hf_fsdp2.composite import composite_spec, model_class
from hf_fsdp2.padding_free_probe import PROBE_FAILED, VARLEN_ATTENTION, padding_free_matches

# What makes a varlen kernel loadable: the flash-attn build itself, or the ``kernels`` package, from which
# transformers loads kernels-community's build (from its cache, or the hub) when flash-attn is missing.
_VARLEN_MODULES = {
    "flash_attention_2": ("flash_attn", "kernels"),
    "flash_attention_3": ("flash_attn_interface", "kernels"),
}
# Kernels that keep the documents of one row apart only through a dense ``[rows, 1, T, T]`` mask that
# transformers' masking_utils materialises from position_ids (sdpa: bool; eager: the compute dtype).
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def installed_attention_kernels() -> frozenset[str]:
    """The varlen attention kernels importable in this environment (``flash_attention_2`` / ``_3``)."""
    return frozenset(
        name for name, modules in _VARLEN_MODULES.items() if any(importlib.util.find_spec(m) for m in modules)
    )


@dataclass(frozen=True, kw_only=True)
class AttentionLayout:
    """How a run's micro-batches are laid out and which attention kernel keeps their documents apart.

    Attributes:
        padding_free: each micro-batch flattened into one row, ``position_ids`` restarting per document.
        packing: rows hold several documents (packing, or continued pre-training's rows).
        attn_implementation: what :func:`hf_fsdp2.model.load_model` is given (``auto``: transformers picks).
        kernel: the attention that runs: ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2`` ...
        dense_mask: transformers builds a dense ``[rows, 1, T, T]`` mask every forward to keep the documents of a
            row apart (documents share rows under sdpa or eager); the memory plan counts it.
        reason: why, for the start-up log.
        warning: a cost the user chose explicitly (padding-free over a dense mask on a GPU), or the padding-free
            probe's failure (padded batches kept), else None.
    """

    padding_free: bool
    packing: bool
    attn_implementation: str
    kernel: str
    dense_mask: bool
    reason: str
    warning: str | None = None

    def describe(self, *, why: bool = True) -> str:
        """One line: the layout (and why), the kernel and how it keeps documents apart."""
        layout = "padding-free" if self.padding_free else ("packed rows" if self.packing else "padded")
        if not (self.padding_free or self.packing):
            mask = "a padding mask, none for a micro-batch without padding"
        elif self.dense_mask:
            mask = "documents apart by a dense [T x T] mask"
        elif self.kernel == "flex_attention":
            mask = "documents apart by a block mask from position_ids"
        else:
            mask = "documents apart by position_ids (varlen)"
        return (
            f"batches: {layout}" + (f" ({self.reason})" if why else "") + f"; attention {self.kernel}, {mask}"
        )


# Layer kinds (transformers' ``layer_types`` names) that do not keep the documents of one row apart by
# position_ids, and what crosses the boundary. transformers' kernels for them (mamba-ssm, causal-conv1d,
# flash-linear-attention) take boundaries only as ``seq_idx`` / ``cu_seqlens``, which this toolkit's rows do not carry,
# and their torch fallbacks take none; attention layers beside them keep documents apart, these do not. (Chunked
# and sliding attention are masks: transformers counts their chunks and windows per document, which the probe
# checks with a window and a chunk shorter than its examples.)
ROW_STATE_LAYERS: dict[str, str] = {
    "linear_attention": "a recurrent state (Mamba-2 or gated DeltaNet) carried from token to token along the row",
    "hybrid": "a Mamba mixer beside the attention, its recurrent state carried along the row",
    "hybrid_sliding": "a linear-attention state beside the sliding attention, carried along the row",
    "conv": "a causal convolution whose window reaches back into the previous document",
}
# Older configs' name for Mamba layers (transformers remaps it the same way).
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention"}


def row_state_layers(config: PretrainedConfig) -> dict[str, int]:
    """The layer kinds of ``config`` that would let two documents of one row reach each other, with their counts
    (empty: every layer keeps documents apart by position_ids). Read from ``layer_types`` (the text config's, for a
    composite model), so every rank answers the same before any weight is read."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    found: dict[str, int] = {}
    for kind in types if isinstance(types, (list, tuple)) else ():
        kind = _LEGACY_LAYER_TYPES.get(kind, kind)
        if kind in ROW_STATE_LAYERS:
            found[kind] = found.get(kind, 0) + 1
    return found


def _row_state_summary(config: PretrainedConfig, found: dict[str, int]) -> str:
    cls = _model_class(config)
    name = cls.__name__ if cls is not None else type(config).__name__
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    total = len(getattr(text, "layer_types", None) or ()) or "?"
    kinds = "; ".join(
        f"{n} of its {total} layers are {kind}: {ROW_STATE_LAYERS[kind]}" for kind, n in found.items()
    )
    return f"{name} (model_type {getattr(config, 'model_type', '?')}): {kinds}"


def _rows_asked(packing: bool, padding_free: bool | None) -> str:
    return ", ".join(
        ["rows of several documents (packing, or continued pre-training without cross_document_attention)"]
        * packing
        + ["padding_free=true"] * bool(padding_free)
    )


def check_row_layers(
    config: PretrainedConfig, *, packing: bool, padding_free: bool | None, cp_size: int = 1
) -> None:
    """Refuse what a model with layers that carry state along a row (:func:`row_state_layers`) cannot run: rows of
    several documents (packing, padding-free batches), which would reach each other through those layers, and a
    sequence split over context-parallel ranks, which those layers would read in disjoint parts. Decided from the
    config before any work, the same on every rank.

    Args:
        config: the model's config.
        packing: rows hold several documents (``packing``, or continued pre-training's rows without
            ``cross_document_attention``).
        padding_free: the ``padding_free`` setting (None: unset, decided padded for such a model).
        cp_size: the context-parallel degree.

    Raises:
        ConfigError: naming the model, its layer kinds and the fix.
    """
    from hf_fsdp2.config.plans import ConfigError

    found = row_state_layers(config) if (packing or padding_free or cp_size > 1) else {}
    if found and cp_size > 1:
        raise ConfigError(
            f"cp_size={cp_size} on {_row_state_summary(config, found)}. Context parallel gives each rank a part of "
            "every sequence and gathers whole sequences around attention only, so these layers would run each part "
            "from an empty state. Set cp_size: 1 (activation_checkpointing and ce_chunk_tokens for long sequences)"
        )
    if found and (packing or padding_free):
        raise ConfigError(
            f"{_rows_asked(packing, padding_free)} on {_row_state_summary(config, found)}. Two documents in one row "
            "would reach each other through these layers (they read no position_ids, and this toolkit passes their "
            "kernels no document boundaries), so each document's loss would depend on the one before it. Set "
            "packing: false and padding_free: false (padded batches, one document per row; left unset, "
            "padding_free picks them for this model); for continued pre-training, cross_document_attention: true "
            "trains rows of documents that see each other on purpose"
        )


def _model_class(config: PretrainedConfig) -> type | None:
    """The class the run builds for ``config``: a composite's own (:func:`~hf_fsdp2.composite.model_class`), else
    the one ``AutoModelForCausalLM`` builds (None: remote code, unknown here).

    Raises:
        ConfigError: an image-text-to-text checkpoint this version does not train.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if composite_spec(config) is not None:
        return model_class(config)  # type: ignore[no-any-return]
    try:
        found = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    return found[0] if isinstance(found, tuple) else found  # some configs map to several classes


def choose_attention_layout(
    model_config: PretrainedConfig,
    *,
    device_type: str,
    attn_implementation: str = "auto",
    packing: bool = False,
    padding_free: bool | None = None,
    installed: frozenset[str] | None = None,
    trust_remote_code: bool = False,
) -> AttentionLayout:
    """The batch layout and attention kernel of a run, decided from config and environment only.

    Every rank (and the memory plan) decides the same. Documents flattened into one row are kept apart by
    ``position_ids``: varlen flash kernels take the boundaries as they are, ``flex_attention`` gets a block mask
    (``masking_utils.flex_attention_mask``), but sdpa and eager get a dense ``[rows, 1, T, T]`` mask
    (``masking_utils.sdpa_mask`` / ``eager_mask``): over a flattened micro-batch T is all its tokens, so on a
    GPU that is T^2 attention over all documents, no flash kernel and a T^2 bias per layer kept for backward,
    slower and bigger than padded batches. So, with ``padding_free`` unset:

    - a GPU (any device but ``cpu``): padding-free with ``flash_attention_2``/``_3`` or ``flex_attention``
      (once the CPU probe shows the model's masks follow position_ids), padded batches with sdpa/eager;
    - the CPU: padding-free where the CPU probe (:func:`padding_free_matches`) shows the same logits
      (measured faster there: bench/trainer_bench.py);
    - ``packing``: packed rows instead, except under ``flash_attention_2``/``_3``: rows of several documents are
      flattened into one row there, since transformers' flash path finds documents in ``position_ids`` only in a
      one-row batch (``_is_packed_sequence``); kept as ``[rows, length]`` each would attend to the documents before
      it in its row (so ``padding_free: false`` is refused there, a ConfigError).

    ``attn_implementation: auto`` keeps transformers' choice (sdpa, else eager), not flex_attention: transformers
    runs flex through ``torch.compile`` (Triton and a host C compiler on the node, compile time in the first
    step, a recompile as padding-free lengths vary) and refuses attention dropout in training; it is one key
    away (``attn_implementation: flex_attention``) and the log says so.

    Args:
        model_config: the model's config.
        device_type: ``cuda``, ``cpu``, ... (the run's device).
        attn_implementation: the ``attn_implementation`` setting.
        packing: rows hold several documents (``packing``, or continued pre-training's rows).
        padding_free: the ``padding_free`` setting (None: decided here).
        installed: varlen kernels importable (None: :func:`installed_attention_kernels`).
        trust_remote_code: for the probe.

    Returns:
        The layout; ``warning`` set for ``padding_free: true`` over a dense mask on a GPU (allowed: asked for).

    A model with layers that carry state along a row (:func:`row_state_layers`: Mamba, linear attention, short
    convolutions) gets padded batches, and rows of several documents asked for are refused
    (:func:`check_row_layers`). Rows of several documents asked for on sdpa, eager or flex are probed too, and
    refused where the model's masks do not keep them apart.

    Raises:
        ConfigError: flex_attention or a flash kernel on a model class without it (Gemma 3's and Llama 4's
            composites have no flash path), a flash kernel nothing here can load, or rows of
            several documents on a model whose layers or masks would let them reach each other.
    """
    from hf_fsdp2.config.plans import ConfigError

    cls = _model_class(model_config)
    if attn_implementation == "auto":
        kernel = "eager" if cls is not None and not getattr(cls, "_supports_sdpa", False) else "sdpa"
    else:
        kernel = attn_implementation
    name = cls.__name__ if cls is not None else type(model_config).__name__
    if kernel == "flex_attention" and cls is not None and not getattr(cls, "_supports_flex_attn", False):
        raise ConfigError(
            f"attn_implementation=flex_attention: {name} does not support it (_supports_flex_attn is false in "
            "this transformers); use sdpa (padded batches on a GPU) or flash_attention_2"
        )
    if kernel in _VARLEN_MODULES and cls is not None and not getattr(cls, "_supports_flash_attn", False):
        raise ConfigError(
            f"attn_implementation={kernel}: {name} does not support it (_supports_flash_attn is false in this "
            "transformers: the class refuses it when loading); use sdpa"
            + (" or flex_attention" if getattr(cls, "_supports_flex_attn", False) else "")
        )
    gpu = device_type != "cpu"
    have = installed_attention_kernels() if installed is None else installed
    if gpu and kernel in _VARLEN_MODULES and kernel not in have:
        raise ConfigError(
            f"attn_implementation={kernel} needs the {_VARLEN_MODULES[kernel][0]} package or the kernels package "
            "(transformers then loads kernels-community's build from its cache or the hub); neither is importable "
            "here. Install one, or set attn_implementation to flex_attention (block masks, no extra package) or sdpa"
        )
    check_row_layers(model_config, packing=packing, padding_free=padding_free)
    row_state = row_state_layers(model_config)
    dense = kernel in DENSE_MASK_ATTENTION
    proxy = "eager" if cls is not None and not getattr(cls, "_supports_sdpa", False) else "sdpa"
    warning = None
    if (packing or padding_free) and kernel in (*DENSE_MASK_ATTENTION, "flex_attention"):
        # Rows of several documents asked for: the probe checks that this model's masks keep them apart (flex
        # through sdpa/eager: the same mask function), as it does before choosing padding-free batches itself.
        kept, probed = padding_free_matches(
            model_config,
            proxy if kernel == "flex_attention" else attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        if not kept and not probed.startswith(PROBE_FAILED):
            raise ConfigError(
                f"{_rows_asked(packing, padding_free)} on {name} (model_type "
                f"{getattr(model_config, 'model_type', '?')}): documents of one row would see each other: {probed} "
                "(a probe forward, two examples padded and flattened into one row). Set packing: false and "
                "padding_free: false (padded batches)"
                + (
                    "; or attn_implementation: flash_attention_2 (varlen kernels take the boundaries from "
                    "position_ids)"
                    if cls is not None and getattr(cls, "_supports_flash_attn", False)
                    else ""
                )
            )
        if not kept:
            warning = f"{_rows_asked(packing, padding_free)} kept as asked, unchecked: {probed}"
    if packing and kernel in VARLEN_ATTENTION and not padding_free:
        # transformers' flash path (_flash_attention_forward) finds documents in position_ids only when the batch
        # has one row (_is_packed_sequence): kept as [rows, length], each document would attend to those before it
        # in its row. Flattened into one row, every document is apart, at no cost to a varlen kernel.
        if padding_free is False:
            raise ConfigError(
                f"padding_free=false with rows of several documents (packing=true, or continued pre-training "
                f"without cross_document_attention) under attn_implementation={kernel}: transformers' flash path "
                "keeps the documents of a batch apart only when the batch has one row, so each document of a kept "
                "row would attend to the documents before it. Unset padding_free (the rows are then flattened into "
                "one row, the same work for the varlen kernel), or keep rows with attn_implementation: "
                "flex_attention or sdpa"
            )
        flat = True
        why = (
            f"rows of several documents flattened into one row: transformers' {kernel} path keeps documents "
            "apart by position_ids only in a one-row batch"
        )
    elif padding_free is False:
        flat, why = False, "padding_free=false"
    elif padding_free is None and packing:
        flat, why = False, "packing=true packs rows instead"
    elif padding_free:
        flat, why = True, "padding_free=true"
        if gpu and dense:
            warning = (
                f"padding_free=true with {kernel} attention on {device_type}: transformers builds a dense [T x T] "
                "mask over each flattened micro-batch (T = all its tokens), so attention costs T^2 over all its "
                "documents without the flash kernel and keeps a T^2 bias per layer for backward (the memory plan "
                "counts it); set attn_implementation: flex_attention (block mask) or flash_attention_2, or "
                "padding_free: false"
            )
    elif row_state:
        flat, why = (
            False,
            f"padding_free auto: {_row_state_summary(model_config, row_state)}, so documents stay one per row",
        )
    elif kernel in VARLEN_ATTENTION:
        flat, why = True, f"padding_free auto: {kernel} takes document boundaries from position_ids (varlen)"
    elif gpu and kernel == "flex_attention":
        flat, probed = padding_free_matches(model_config, proxy, trust_remote_code=trust_remote_code)
        why = "padding_free auto: " + (
            f"flex_attention keeps documents apart with a block mask from position_ids, no dense mask ({probed})"
            if flat
            else probed
        )
        warning = why if probed.startswith(PROBE_FAILED) else None
    elif gpu:
        flat = False
        better = " or ".join(
            ["flex_attention"] * bool(getattr(cls, "_supports_flex_attn", False))
            + [f"{k} (installed)" for k in sorted(have & set(VARLEN_ATTENTION))]
        )
        why = (
            f"padding_free auto: {kernel} on {device_type} would keep the documents of a flattened micro-batch "
            "apart with a dense [T x T] mask over all its tokens"
            + (f"; set attn_implementation: {better} for padding-free batches" if better else "")
        )
        if attn_implementation == "auto":
            why += (
                " (auto keeps transformers' sdpa: flex_attention compiles Triton kernels at the first step)"
            )
    else:
        flat, probed = padding_free_matches(
            model_config, attn_implementation, trust_remote_code=trust_remote_code
        )
        why = f"padding_free auto: {probed}"
        warning = why if probed.startswith(PROBE_FAILED) else None
    return AttentionLayout(
        padding_free=flat,
        packing=packing,
        attn_implementation=attn_implementation,
        kernel=kernel,
        dense_mask=dense and (flat or packing),
        reason=why,
        warning=warning,
    )


def check_loaded_attention(
    loaded: str | None, *, asked: str, packing: bool, padding_free: bool, model_cls: type
) -> None:
    """Refuse rows of several documents (``packing`` / ``padding_free``) on a loaded model whose attention does not
    keep them apart by ``position_ids``. A kernel transformers substituted for the flash kernel asked for is kept:
    a class that lists its own flash kernels (``_compatible_flash_implementations``: gpt-oss names
    kernels-community's vllm-flash-attn3, which takes its attention sinks) is loaded with the first of them instead
    of ``flash_attention_2``/``_3``, run through the same flash path, which takes the boundaries from position_ids.

    Args:
        loaded: the loaded model's ``config._attn_implementation``.
        asked: the ``attn_implementation`` setting.
        packing: rows hold several documents.
        padding_free: micro-batches flattened into one row.
        model_cls: the loaded model's class.

    Raises:
        ConfigError: naming the settings, the kernel that runs and the fix.
    """
    from hf_fsdp2.config.plans import PACKED_ATTENTION_IMPLEMENTATIONS, ConfigError

    if not (packing or padding_free) or loaded in PACKED_ATTENTION_IMPLEMENTATIONS:
        return
    own = getattr(model_cls, "_compatible_flash_implementations", None) or ()
    if asked in VARLEN_ATTENTION and loaded is not None and loaded in own and "flash" in loaded:
        return
    raise ConfigError(
        f"packing={packing}, padding_free={padding_free} need an attention implementation that keeps "
        f"examples apart by position_ids, one of {list(PACKED_ATTENTION_IMPLEMENTATIONS)}; the model runs "
        f"{loaded!r}: set attn_implementation to one of them or turn packing off"
    )


def method_rows(data: Any, batch_rows: str) -> tuple[bool, bool | None]:
    """``(packing, padding_free)`` of a method's data section as the layout decision reads them, by the method's
    ``batch_rows``: ``as_configured`` (SFT) as set; ``corpus`` (CPT) rows hold several documents unless
    ``cross_document_attention`` and are full already (padding-free only when asked, or under a flash kernel, which
    separates documents only in a one-row batch); ``padded`` (pairs, unpaired examples, prompt + completion rows)
    padded."""
    if batch_rows == "corpus":
        if data.cross_document_attention:  # one sequence per row
            return False, bool(data.padding_free)
        return True, data.padding_free
    if batch_rows == "padded":
        return False, False
    return bool(data.packing), data.padding_free


def attention_layout_for(
    cfg: Any,
    model_config: PretrainedConfig,
    *,
    device_type: str,
    batch_rows: str = "as_configured",
    installed: frozenset[str] | None = None,
) -> AttentionLayout:
    """:func:`choose_attention_layout` for a method's config sections (:func:`method_rows`)."""
    packing, padding_free = method_rows(cfg.data, batch_rows)
    return choose_attention_layout(
        model_config,
        device_type=device_type,
        attn_implementation=cfg.model.attn_implementation,
        packing=packing,
        padding_free=padding_free,
        installed=installed,
        trust_remote_code=cfg.model.trust_remote_code,
    )
