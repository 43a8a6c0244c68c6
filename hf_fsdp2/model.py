"""Loading the tokenizer and the model (hub id or local folder; a causal LM, or a composite checkpoint with its own
class), and finding the decoder-layer classes and FSDP2 units."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from hf_fsdp2.compat import NO_HUB_KERNELS
from hf_fsdp2.composite import auto_class, composite_spec
from hf_fsdp2.conversions import name_conversions_from_folder
from hf_fsdp2.dtypes import dtype_named
from hf_fsdp2.score_head import auto_map as score_auto_map
from hf_fsdp2.score_head import carries_score_head, needs_score_head, score_head_class
from hf_fsdp2.vision.grain import block_unit

logger = logging.getLogger("hf_fsdp2")

_LOAD_DTYPES = ("float32", "bfloat16", "float16")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") > 1


def _check_source(name: str, what: str) -> str:
    """The name to hand to from_pretrained: a local path with ``~`` expanded, or the hub id as is."""
    path = Path(name).expanduser()
    if _looks_local(name):
        if not path.is_dir():
            raise FileNotFoundError(
                f"{what}={name!r}: no such folder; give a local folder holding config.json, or a hub id like "
                "'HuggingFaceTB/SmolLM2-135M-Instruct'"
            )
        return str(path)
    return name


def load_tokenizer(
    name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer and make sure it has a pad token.

    A tokenizer without a pad token gets its EOS token as pad (labels mask pads with -100 and the
    attention mask hides them, so the EOS targets the model must learn are unaffected).

    Args:
        name_or_path: hub id or local folder.
        revision: hub revision.
        trust_remote_code: allow custom tokenizer code from the repo.

    Returns:
        The tokenizer with ``pad_token_id`` set.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: the tokenizer has neither a pad nor an EOS token.
    """
    name_or_path = _check_source(name_or_path, "tokenizer_name_or_path")
    tokenizer = AutoTokenizer.from_pretrained(
        name_or_path, revision=revision, trust_remote_code=trust_remote_code
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token; add one with "
                "tokenizer.add_special_tokens({'pad_token': ...}) and save it"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer has no pad token: using EOS %r as pad", tokenizer.eos_token)
    return tokenizer


def load_model_config(
    name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> PretrainedConfig:
    """Read a model's config.json (cheap) to check settings before loading weights.

    Raises:
        FileNotFoundError: a local path that does not exist or lacks config.json.
    """
    name_or_path = _check_source(name_or_path, "model_name_or_path")
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model_name_or_path={name_or_path!r} has no config.json; is it an HF model folder?"
        )
    return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)


def check_max_length(max_length: int, config: PretrainedConfig) -> None:
    """Refuse a max_length the model's position embeddings cannot cover (the language model's: a composite keeps
    them in its text config).

    Raises:
        ValueError: max_length above ``max_position_embeddings``.
    """
    limit = getattr(text_config(config), "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise ValueError(
            f"max_length={max_length} exceeds the model's max_position_embeddings={limit}; "
            f"lower max_length to at most {limit}"
        )


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    empty_weights: bool = False,
    reward_head: int | None = None,
) -> torch.nn.Module:
    """Load a causal LM for training (or, ``reward_head``, the same model with a scalar score head); a composite
    checkpoint (vision tower + projector + language model, :mod:`hf_fsdp2.composite`) with its own class.

    Every rank, rank 0 after ``from_pretrained`` and the others after ``from_config`` alike, takes the checkpoint's
    name conversions from the folder's tensor names (:mod:`hf_fsdp2.conversions`): the export's names are then the
    same on every rank, and the checkpoint's.

    Args:
        name_or_path: hub id or local folder.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (the checkpoint's dtype).
        attn_implementation: ``auto`` (transformers picks what the model supports: sdpa, else eager),
            ``sdpa``, ``eager``, ``flash_attention_2``, ...
        revision: hub revision.
        trust_remote_code: allow custom model code from the repo.
        empty_weights: build the model with parameters on the meta device and read no weights (the
            ranks other than 0 under ``fsdp_cpu_ram_efficient_loading``: prepare() fills their shards
            by broadcast from rank 0). Buffers stay real, so computed ones such as rotary frequencies
            are right.
        reward_head: the padding token id: load ``AutoModelForSequenceClassification`` with one label (a reward
            model's score, read at each row's last non-padding token); a head the checkpoint lacks is initialised
            from the global RNG (seed it first: every rank then holds the same values).

    Returns:
        The model in train mode, with ``use_cache`` off (a KV cache is useless in training).

    Raises:
        ConfigError: an image-text-to-text checkpoint this version does not train (:func:`composite_spec`), or
            a checkpoint whose tensor names cannot be read.
    """
    config = load_model_config(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    auto: Any = auto_class(config)
    if reward_head is not None:
        auto = AutoModelForSequenceClassification
        if needs_score_head(config) and not trust_remote_code:
            # No transformers class for this family: transformers' generic one over its base model, registered
            # with the auto class; the export carries it as modeling_score_head.py (config.auto_map).
            score_head_class(config)
            config.auto_map = {**(getattr(config, "auto_map", None) or {}), **score_auto_map(config)}
        config.num_labels, config.pad_token_id = 1, reward_head
        config.id2label, config.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
    name_or_path = _check_source(name_or_path, "model_name_or_path")
    torch_dtype: Any = "auto" if dtype == "auto" else dtype_named(dtype, "torch_dtype", _LOAD_DTYPES)
    attn = None if attn_implementation == "auto" else attn_implementation
    if empty_weights:
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(
                config,
                dtype=config.dtype if torch_dtype == "auto" else torch_dtype,
                attn_implementation=attn,
                trust_remote_code=trust_remote_code,
            )
        # Tie as from_pretrained would: the meta-device construction leaves lm_head a separate parameter.
        model.tie_weights()
        read_generation_files(model, name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    else:
        model = auto.from_pretrained(
            name_or_path,
            **({"config": config, "output_loading_info": True} if reward_head is not None else {}),
            revision=revision,
            dtype=torch_dtype,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
            **NO_HUB_KERNELS,
        )
        if reward_head is not None:
            model, info = model
            _check_backbone_loaded(model, info["missing_keys"], name_or_path)
    if reward_head is not None:  # what auto_class_name reads, before save_pretrained writes it
        model.config.architectures = [type(model).__name__]
    spec = composite_spec(config) if reward_head is None else None
    if spec is not None and type(model).__name__ != spec.architecture:
        raise ValueError(
            f"{name_or_path}: transformers built {type(model).__name__} for {spec.architecture}'s config; install "
            "the transformers docs/compatibility.md lists"
        )
    name_conversions_from_folder(model, name_or_path, revision=revision)
    model.config.use_cache = False
    text_config(model.config).use_cache = False
    model.train()
    return model


def meta_model(config: PretrainedConfig, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model of ``config`` built on the meta device (a composite with its own class): its modules and shapes,
    no memory and nothing read; for what must be known of the model before it loads."""
    import copy

    config = copy.deepcopy(config)
    with torch.device("meta"):
        return auto_class(config).from_config(config, trust_remote_code=trust_remote_code)  # type: ignore[no-any-return]


def read_generation_files(
    model: torch.nn.Module, name_or_path: str, *, revision: str | None, trust_remote_code: bool
) -> None:
    """What ``from_pretrained`` reads beside config.json and the weights, read into a model built from its config.

    A model built with ``from_config`` (the ranks other than 0 under ``fsdp_cpu_ram_efficient_loading``) derives its
    ``generation_config`` from config.json: the end-of-turn ids of generation_config.json (Gemma's
    ``<end_of_turn>``, Qwen's ``<|im_end|>``, Llama 3's three ids) and its sampling defaults would be rank 0's
    only, so GRPO's ranks would stop generating at different tokens. This is the call ``from_pretrained`` makes
    (transformers' ``adjust_generation_fn``): generation_config.json, else the fields config.json holds, and the
    folder's custom ``generate`` under ``trust_remote_code``; every rank's model then generates as rank 0's.
    """
    adjust = getattr(model, "adjust_generation_fn", None)
    can_generate = getattr(model, "can_generate", None)
    if adjust is None or not callable(can_generate) or not can_generate():  # a reward model: nothing to read
        return
    adjust(
        generation_config=None,
        from_auto_class=True,
        from_pipeline=None,
        pretrained_model_name_or_path=name_or_path,
        cache_dir=None,
        force_download=False,
        proxies=None,
        local_files_only=False,
        token=None,
        revision=revision,
        subfolder="",
        trust_remote_code=trust_remote_code,
    )


def _check_backbone_loaded(model: torch.nn.Module, missing: Any, name_or_path: str) -> None:
    """A reward model loaded from a checkpoint may lack only its score head: any other missing weight would train
    from random values (a backbone under another prefix than the checkpoint's)."""
    lost = sorted(k for k in missing if not k.startswith("score."))
    if lost:
        raise ValueError(
            f"{type(model).__name__} from {name_or_path}: {len(lost)} backbone weights are not in the checkpoint "
            f"(e.g. {lost[:3]}), so they would start random; the checkpoint's names do not match the class's "
            f"({getattr(model, 'base_model_prefix', '')!r} prefix): load a checkpoint of this family's causal LM or reward model"
        )


def auto_class_name(config: Any) -> str:
    """The transformers auto class that loads a model of ``config``: ``AutoModelForSequenceClassification`` for a
    reward model (its architectures name a ``*ForSequenceClassification``), ``AutoModelForImageTextToText`` for a
    composite checkpoint (:func:`~hf_fsdp2.composite.composite_spec`), else ``AutoModelForCausalLM``."""
    architectures = getattr(config, "architectures", None) or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        if carries_score_head(config):  # its class built here and registered with the auto class
            score_head_class(config)
        return "AutoModelForSequenceClassification"
    return str(auto_class(config).__name__)


def text_config(config: Any) -> Any:
    """The language model's config: a composite's ``text_config``, else ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def decoder_layer_classes(model: torch.nn.Module, override: list[str] | None = None) -> tuple[str, ...]:
    """Class names of the language model's decoder layers: what activation checkpointing, compile, float8, QLoRA
    and Muon see, one FSDP2 unit each (:func:`fsdp_unit_classes` adds a composite's tower and projector).

    A composite's ``_no_split_modules`` is the union over its sub-models (the tower's blocks too): its text decoder
    layer comes from :data:`~hf_fsdp2.composite.COMPOSITES` instead.

    Args:
        model: the loaded model.
        override: explicit class names (config ``fsdp_layer_cls_to_wrap``); checked to exist.

    Returns:
        Class names present in the model.

    Raises:
        ValueError: no decoder-layer class found, or an override that names no module of the model.
    """
    present = {type(m).__name__ for m in model.modules()}
    if override:
        missing = [n for n in override if n not in present]
        if missing:
            raise ValueError(
                f"fsdp_layer_cls_to_wrap names {missing}, which no module of {type(model).__name__} is; "
                f"module classes in the model: {sorted(present)}"
            )
        return tuple(override)
    spec = composite_spec(getattr(model, "config", None))
    names = [spec.text_layer] if spec is not None else list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules; set fsdp_layer_cls_to_wrap to the class "
            "name of its decoder layer (e.g. LlamaDecoderLayer)"
        )
    found = tuple(n for n in names if n in present)
    if not found:
        raise ValueError(
            f"fsdp_layer_cls_to_wrap={names} matches no module of {type(model).__name__}; "
            f"module classes in the model include {sorted(present)[:20]}"
        )
    return found


def fsdp_unit_classes(model: torch.nn.Module, layer_cls: tuple[str, ...]) -> tuple[str, ...]:
    """The classes FSDP2 makes one unit each: the decoder layers ``layer_cls``, and a composite's vision tower and
    projector (one unit each: on text rows they never run, so their units are never gathered, and their parameters
    are not left in the root unit, which is gathered every step and kept gathered); the tower's blocks too where
    that lowers the peak of unsharded parameters (:func:`hf_fsdp2.vision.grain.block_unit`).

    Raises:
        ValueError: a unit class of the composite table that no module of the model is.
    """
    spec = composite_spec(getattr(model, "config", None))
    if spec is None:
        return layer_cls
    present = {type(m).__name__ for m in model.modules()}
    parts = spec.fsdp_units()[1:]
    missing = [n for n in parts if n not in present]
    if missing:
        raise ValueError(
            f"{spec.architecture}: the FSDP2 unit classes {missing} of hf_fsdp2's composite table are not in the "
            "loaded model (another transformers layout); install the transformers docs/compatibility.md lists"
        )
    block = block_unit(model, spec, layer_cls)
    parts = (*parts, block) if block is not None else parts
    return (*layer_cls, *(n for n in parts if n not in layer_cls))


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts of an unsharded model."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def embedding_rows(config: PretrainedConfig) -> int | None:
    """Rows of the model's input embedding, from its config (the text config of a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    return int(rows) if rows else None


def check_vocab(tokenizer_size: int, config: PretrainedConfig, *, resize: bool) -> str | None:
    """Refuse a tokenizer with more tokens than the model has embedding rows, before any work.

    A token id past the last row crashes the embedding with an IndexError mid-run when a batch uses it,
    and when none does, the export pairs a tokenizer and a model that do not match.

    Args:
        tokenizer_size: ``len(tokenizer)`` (added tokens included).
        config: the model config.
        resize: ``resize_token_embeddings``: grow the model instead of refusing.

    Returns:
        A note for the log when the model will be resized, else None.

    Raises:
        ValueError: the tokenizer is larger than the embedding and ``resize`` is off.
    """
    rows = embedding_rows(config)
    if rows is None or tokenizer_size <= rows:
        return None
    if not resize:
        raise ValueError(
            f"the tokenizer has {tokenizer_size} tokens but the model's embedding has {rows} rows (vocab_size): "
            f"ids {rows}..{tokenizer_size - 1} would index past it. Use the model's own tokenizer, or set "
            "resize_token_embeddings=true to grow the embedding (the new rows start untrained)"
        )
    return (
        f"resizing the token embeddings from {rows} to {tokenizer_size} rows (resize_token_embeddings=true)"
    )


def resize_embeddings(model: torch.nn.Module, tokenizer_size: int) -> None:
    """Grow the input embedding (and an untied output head) to ``tokenizer_size`` rows, as transformers does.

    New rows are initialised from the mean and covariance of the old ones (transformers' default), and
    ``config.vocab_size`` follows, so the export's config matches its weights.
    """
    model.resize_token_embeddings(tokenizer_size)  # type: ignore[operator]


_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "resid_dropout")


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of ``model`` to 0: ``nn.Dropout`` modules (LoRA's included) and the float rates that
    attention modules read in their forward (``attention_dropout`` ...), so its log-probs do not depend on
    the train/eval mode (DPO's policy and reference). Returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, float) and not isinstance(value, bool):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed
