"""Composite checkpoints: one folder holding a vision tower, a projector and a language model (Gemma 3 from 4B up,
Qwen3.5, Llama 4, Mistral Small 3.x). The table :data:`COMPOSITES` says, per architecture class, where each part
lives in the loaded module tree and which classes make its FSDP2 units; :func:`composite_spec` is the one place that
decides, from the config alone (every rank alike, before any work), whether a model is a composite this toolkit
trains, and refuses by name an image-text-to-text architecture it does not.

Text fine-tuning trains the language model; the tower and the projector are frozen by default (LLaMA-Factory's
``freeze_vision_tower`` / ``freeze_multi_modal_projector``): on text rows they never run, so they take no gradient,
no optimizer state and (one FSDP2 unit each) no all-gather, and the export carries their bytes from the source files.
On image records (:mod:`hf_fsdp2.vision`, docs/vlm.md) they run, and train when those keys are false.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class CompositeSpec:
    """Where a composite's parts live in its loaded module tree (dotted module paths) and its FSDP2 units.

    Attributes:
        architecture: the class name in ``config.architectures`` (and transformers' class).
        language_model: the language model's module (its decoder layers, embeddings and final norm).
        tower: the vision tower's module(s).
        projector: the multi-modal projector's module(s) (inside the tower for Qwen: its merger).
        text_layer: the language model's decoder-layer class: one FSDP2 unit each, what activation checkpointing,
            compile, float8, QLoRA and Muon see ("": the text config's model class's, for a composite whose language
            model is any causal LM: LLaVA, Idefics3; :func:`composite_spec` fills it in).
        tower_unit: the tower's class: one FSDP2 unit (frozen on text rows: never gathered; "": each encoder layer of
            the vision config's model is a unit, filled in likewise: LLaVA's tower).
        projector_unit: the projector's class: one FSDP2 unit (None: it lies inside the tower's unit).
    """

    architecture: str
    language_model: str
    tower: tuple[str, ...]
    projector: tuple[str, ...]
    text_layer: str
    tower_unit: str
    projector_unit: str | None

    def fsdp_units(self) -> tuple[str, ...]:
        """The classes FSDP2 wraps one unit each: the language model's decoder layers, the tower, the projector."""
        return (self.text_layer, self.tower_unit, *([self.projector_unit] if self.projector_unit else []))


COMPOSITES: dict[str, CompositeSpec] = {
    spec.architecture: spec
    for spec in (
        CompositeSpec(
            architecture="Gemma3ForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.vision_tower",),
            projector=("model.multi_modal_projector",),
            text_layer="Gemma3DecoderLayer",
            tower_unit="SiglipVisionModel",
            projector_unit="Gemma3MultiModalProjector",
        ),
        CompositeSpec(
            architecture="Qwen3_5ForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.visual",),
            projector=("model.visual.merger",),
            text_layer="Qwen3_5DecoderLayer",
            tower_unit="Qwen3_5VisionModel",
            projector_unit=None,
        ),
        CompositeSpec(
            architecture="Qwen3_5MoeForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.visual",),
            projector=("model.visual.merger",),
            text_layer="Qwen3_5MoeDecoderLayer",
            tower_unit="Qwen3_5MoeVisionModel",
            projector_unit=None,
        ),
        CompositeSpec(
            architecture="Llama4ForConditionalGeneration",
            language_model="language_model",
            tower=("vision_model",),
            projector=("multi_modal_projector",),
            text_layer="Llama4TextDecoderLayer",
            tower_unit="Llama4VisionModel",
            projector_unit="Llama4MultiModalProjector",
        ),
        CompositeSpec(
            architecture="Qwen2_5_VLForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.visual",),
            projector=("model.visual.merger",),
            text_layer="Qwen2_5_VLDecoderLayer",
            tower_unit="Qwen2_5_VisionTransformerPretrainedModel",
            projector_unit=None,
        ),
        CompositeSpec(
            architecture="Qwen3VLForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.visual",),
            # The merger and the DeepStack mergers (which feed image features to early decoder layers) project.
            projector=("model.visual.merger", "model.visual.deepstack_merger_list"),
            text_layer="Qwen3VLTextDecoderLayer",
            tower_unit="Qwen3VLVisionModel",
            projector_unit=None,
        ),
        CompositeSpec(
            architecture="Idefics3ForConditionalGeneration",
            language_model="model.text_model",
            tower=("model.vision_model",),
            projector=("model.connector",),
            text_layer="",
            tower_unit="Idefics3VisionTransformer",
            projector_unit="Idefics3Connector",
        ),
        CompositeSpec(
            architecture="LlavaForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.vision_tower",),
            projector=("model.multi_modal_projector",),
            text_layer="",
            tower_unit="",
            projector_unit="LlavaMultiModalProjector",
        ),
        CompositeSpec(
            architecture="Mistral3ForConditionalGeneration",
            language_model="model.language_model",
            tower=("model.vision_tower",),
            projector=("model.multi_modal_projector",),
            text_layer="MistralDecoderLayer",
            tower_unit="PixtralVisionModel",
            projector_unit="Mistral3MultiModalProjector",
        ),
    )
}
"""The composites this toolkit fine-tunes, by architecture class (the paths checked against the loaded model by
:func:`partition`: a transformers release that moves a part fails there, by name, not silently)."""


REWARD_CLASSES: dict[str, str] = {
    "Gemma3ForSequenceClassification": "Gemma3ForConditionalGeneration",
    "Qwen3_5ForSequenceClassification": "Qwen3_5ForConditionalGeneration",
}
"""transformers' sequence-classification classes that wrap a whole composite (its model under the same paths, a
``score`` head for the LM head): a reward model loaded from a composite folder is that composite's row. The other
composites have none (the reward-model recipe refuses them by name)."""


def _image_text_to_text_types() -> dict[str, str]:
    """transformers' image-text-to-text map: model_type -> the composite's class name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _resolved(spec: CompositeSpec, config: Any) -> CompositeSpec:
    """``spec`` with a text layer or tower unit it leaves to the config ("") filled in: the text model's decoder
    layer (its ``_no_split_modules``) and the vision model's class."""
    if spec.text_layer and spec.tower_unit:
        return spec
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    text_layer, tower_unit = spec.text_layer, spec.tower_unit
    if not text_layer:
        layers = list(getattr(MODEL_MAPPING[type(config.get_text_config())], "_no_split_modules", None) or [])
        if not layers:
            raise ConfigError(
                f"{spec.architecture} over {type(config.get_text_config()).__name__}: its language model declares no "
                "decoder-layer class (_no_split_modules), so its FSDP2 units are unknown; use a composite whose "
                "language model is a family of docs/models.md"
            )
        text_layer = layers[0]
    if not tower_unit:
        # The tower's encoder layers, one unit each: LLaVA reads a hidden state of its tower (vision_feature_layer),
        # which transformers records with hooks it looks up by the tower's class, and FSDP2 changes the class of a
        # module it makes a unit (FSDPSiglipVisionModel: no hidden states, the forward fails).
        blocks = list(getattr(MODEL_MAPPING[type(config.vision_config)], "_no_split_modules", None) or [])
        tower_unit = next((b for b in blocks if b.endswith("Layer")), "")
        if not tower_unit:
            raise ConfigError(
                f"{spec.architecture} over {type(config.vision_config).__name__}: its vision tower declares no layer "
                f"class ({blocks}) to shard it by; use a SigLIP or CLIP tower"
            )
    return dataclasses.replace(spec, text_layer=text_layer, tower_unit=tower_unit)


def composite_spec(config: Any) -> CompositeSpec | None:
    """The composite ``config`` describes (None: a causal LM, loaded with ``AutoModelForCausalLM`` as before).

    Decided from ``config.architectures`` and ``config.model_type`` alone: the same answer on every rank, before any
    weight is read.

    Raises:
        ConfigError: an image-text-to-text architecture not in :data:`COMPOSITES` (named, with the supported ones),
            or a composite with remote code (transformers applies no checkpoint conversions to custom code, so its
            names could not be kept).
    """
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    # A config built in code names no architecture: the class transformers' image-text-to-text map gives its type.
    named = [REWARD_CLASSES.get(a, a) for a in architectures] or [
        _image_text_to_text_types().get(str(model_type), "")
    ]
    spec = next((COMPOSITES[a] for a in named if a in COMPOSITES), None)
    if spec is not None:
        if getattr(config, "auto_map", None):
            raise ConfigError(
                f"{spec.architecture} with remote code (auto_map in config.json): transformers applies no checkpoint "
                "name conversions to custom code, so the export could not keep the checkpoint's names; use the "
                "architecture transformers ships (trust_remote_code: false, no auto_map)"
            )
        return _resolved(spec, config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if model_type in _image_text_to_text_types() and text is not config:
        name = architectures[0] if architectures else model_type
        raise ConfigError(
            f"{name} is a vision-language checkpoint (model_type {model_type!r}) this version does not fine-tune: it "
            f"trains the composites {', '.join(sorted(COMPOSITES))} (their language model on text, the tower and "
            "projector kept byte-identical); fine-tune the language model of a supported family, or its text-only "
            "checkpoint"
        )
    return None


def model_class(config: Any) -> Any:
    """The class a model of ``config`` is loaded with: the composite's own (``config.architectures``), else
    ``AutoModelForCausalLM``.

    Raises:
        ConfigError: as :func:`composite_spec`.
    """
    import transformers

    spec = composite_spec(config)
    if spec is None:
        return transformers.AutoModelForCausalLM
    return getattr(transformers, spec.architecture)


def auto_class(config: Any) -> Any:
    """The transformers auto class that builds (``from_config``) and loads (``from_pretrained``) a model of
    ``config``: ``AutoModelForImageTextToText`` for a composite (its map gives the composite's own class, where
    ``AutoModelForCausalLM`` gives Llama 4's and Qwen3.5's text class or, for Mistral 3, nothing), else
    ``AutoModelForCausalLM``.

    Raises:
        ConfigError: as :func:`composite_spec`.
    """
    import transformers

    if composite_spec(config) is None:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def check_composite_run(config: Any, *, tp_size: int, cp_size: int) -> CompositeSpec | None:
    """Refuse, before any work and on every rank alike (config and settings only), what a composite run cannot do
    in this version; returns the composite's spec (None: not a composite, nothing checked).

    Tensor and context parallel have plans for the language model's modules only. (``freeze_*: false`` needs image
    records, which the data decides: the SFT data builder refuses it on text data, and the methods that read no
    images refuse it by their capabilities.)

    Raises:
        ConfigError: as :func:`composite_spec`, or a setting above, naming it, why, and the fix.
    """
    spec = composite_spec(config)
    if spec is None:
        return None
    if tp_size > 1:
        raise ConfigError(
            f"tp_size={tp_size} on {spec.architecture}: tensor parallel splits modules by the family plan of "
            "transformers' config (base_model_tp_plan) under the base model's prefix, which on a composite does not "
            "name its language model's modules (model.language_model.*), and no plan covers the vision tower; set "
            "tp_size: 1 (FSDP2 or HSDP shards the composite over the data ranks)"
        )
    if cp_size > 1:
        raise ConfigError(
            f"cp_size={cp_size} on {spec.architecture}: context parallel runs every attention module of the model over "
            "the cp group, the vision tower's too, whose inputs are image patches, not the sequence the cp ranks "
            "split; set cp_size: 1 (activation_checkpointing and ce_chunk_tokens for long sequences)"
        )
    return spec


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "get_base_model", None)  # a PEFT model: the transformers model it wraps
    return base() if callable(base) else model


def _owners(paths: Iterable[str], name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in paths)


def partition(model: torch.nn.Module, spec: CompositeSpec) -> dict[str, list[str]]:
    """Every parameter of ``model`` (a PEFT model's: of the model it wraps) by the part it belongs to
    (``language_model``, ``tower``, ``projector``, ``head``); a projector inside the tower counts as the projector.

    Raises:
        ConfigError: a path of the table that is not a module of the model, or a parameter in no part (a layout
            this table does not know: named, never trained or exported silently).
    """
    model = _unwrapped(model)  # a PEFT model: the table's paths are the wrapped model's
    modules = dict(model.named_modules())
    missing = [p for p in (spec.language_model, *spec.tower, *spec.projector) if p not in modules]
    if missing:
        raise ConfigError(
            f"{spec.architecture}: the modules {missing} of hf_fsdp2's composite table are not in the loaded model "
            "(another transformers layout); install the transformers docs/compatibility.md lists"
        )
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:  # a reward model over the composite (REWARD_CLASSES): its score head
        head = getattr(model, "score", None)
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    parts: dict[str, list[str]] = {"language_model": [], "tower": [], "projector": [], "head": []}
    stray = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if _owners(spec.projector, name):
            parts["projector"].append(name)
        elif _owners(spec.tower, name):
            parts["tower"].append(name)
        elif _owners((spec.language_model,), name):
            parts["language_model"].append(name)
        elif id(param) in head_params:
            parts["head"].append(name)
        else:
            stray.append(name)
    if stray:
        raise ConfigError(
            f"{spec.architecture}: parameters {stray[:5]} are in no part of hf_fsdp2's composite table (language "
            "model, tower, projector, head); install the transformers docs/compatibility.md lists"
        )
    return parts


def freeze_parts(
    model: torch.nn.Module,
    spec: CompositeSpec,
    *,
    freeze_vision_tower: bool,
    freeze_multi_modal_projector: bool,
) -> list[str]:
    """Freeze the tower and / or the projector in place (``requires_grad_(False)``); returns the parameter names
    frozen. A projector inside the tower (Qwen's mergers) is the projector's: it trains when only the tower is
    frozen. Every rank calls it alike (the config decides)."""
    parts = partition(model, spec)  # the table matches this model, or a named error
    names = set(parts["tower"] * freeze_vision_tower + parts["projector"] * freeze_multi_modal_projector)
    frozen = []
    for name, param in _unwrapped(model).named_parameters():
        if name in names:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def describe_parts(model: torch.nn.Module, spec: CompositeSpec) -> str:
    """One line for the start-up log: each part's parameters (a tied head counted once, with the embedding) and
    whether it trains or is frozen."""
    parts = partition(model, spec)
    params = dict(_unwrapped(model).named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    out = []
    for part, label in (
        ("language_model", "language model"),
        ("head", "head"),
        ("tower", "vision tower"),
        ("projector", "multi-modal projector"),
    ):
        tensors = [params[n] for n in parts[part] if id(params[n]) not in seen]
        seen.update(id(t) for t in tensors)
        if not tensors and part == "head":
            continue  # tied to the embedding, or inside the language model (Llama 4)
        total = sum(t.numel() for t in tensors)
        trained = sum(t.numel() for t in tensors if t.requires_grad)
        state = (
            "trained" if trained == total else ("frozen" if trained == 0 else f"{trained / 1e6:.2f}M trained")
        )
        out.append(f"{label} {total / 1e6:.2f}M {state}")
    return f"composite {spec.architecture}: " + ", ".join(out)


def vision_parameters(model: torch.nn.Module, spec: CompositeSpec) -> int:
    """Parameters of the vision tower and the projector (each tensor once): what a text row never runs, so MFU's
    ``N`` leaves them out."""
    parts = partition(model, spec)
    params = dict(_unwrapped(model).named_parameters(remove_duplicate=False))
    tensors = {id(params[n]): params[n] for part in ("tower", "projector") for n in parts[part]}
    return sum(t.numel() for t in tensors.values())
