"""A reward model's score head for a family whose transformers has no ``*ForSequenceClassification`` class.

transformers builds most of its sequence-classification models from one mixin, ``GenericForSequenceClassification``
(the family's base model under the family's ``base_model_prefix`` and a bias-free ``score`` linear read at each
row's last non-padding token): ``class LlamaForSequenceClassification(GenericForSequenceClassification,
LlamaPreTrainedModel): pass``. For a family without one (Granite, Cohere, DBRX, OLMoE, Ernie 4.5, ...), this
module builds the same class over the family's own base model and registers it with
``AutoModelForSequenceClassification`` in this process, so every loader here (training, the export's twin, the
offline export, ``hf-fsdp2 score``) goes through the same auto class as for Llama.

An export of such a model cannot name a transformers class, so it carries its class: ``config.json``'s
``auto_map`` points ``AutoModelForSequenceClassification`` at ``modeling_score_head.py``, written beside it (three
lines over transformers' own mixin, no hf_fsdp2 import). Plain transformers loads it with
``AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)``; the export's verification
reloads it exactly so, in a fresh process without hf_fsdp2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

MODELING_FILE = "modeling_score_head.py"
_AUTO = "AutoModelForSequenceClassification"
_BUILT: dict[str, type] = {}  # class name -> the class (also this module's attribute of that name)


def _pretrained_base(config: Any) -> tuple[type, type] | None:
    """(the family's base model class, its ``*PreTrainedModel`` class), or None where AutoModel has no base."""
    from transformers import AutoModel, PreTrainedModel

    base = AutoModel._model_mapping.get(type(config), None)  # type: ignore[attr-defined]
    if base is None:
        return None
    for parent in base.__mro__[1:]:
        if issubclass(parent, PreTrainedModel) and parent is not PreTrainedModel:
            return base, parent
    return None


def needs_score_head(config: Any) -> bool:
    """Whether ``config``'s family lacks a transformers ``*ForSequenceClassification`` class (this module builds it).

    Transformers' own table, not the auto class's live registry: a folder loaded with ``trust_remote_code`` registers
    its class there for the rest of the process, and the family still has no class of transformers' own."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


def score_head_class(config: Any) -> type:
    """The family's sequence-classification class: transformers' generic one over the family's base model, built
    once and registered with ``AutoModelForSequenceClassification`` (call only where :func:`needs_score_head`).

    Raises:
        ValueError: the family has no base model in transformers' ``AutoModel`` either (nothing to put a head on).
    """
    import transformers
    from transformers import AutoModelForSequenceClassification
    from transformers.modeling_layers import GenericForSequenceClassification

    found = _pretrained_base(config)
    if found is None:
        raise ValueError(
            f"model_type={config.model_type!r} ({type(config).__name__}) has neither a sequence-classification class "
            f"nor a base model class in transformers {transformers.__version__}, so it cannot carry a reward model's "
            "score head; train the reward model from a family that has one (Llama, Qwen2/3, Mistral, Gemma, ...)"
        )
    base, pretrained = found
    name = base.__name__.removesuffix("Model") + "ForSequenceClassification"
    cls = _BUILT.get(name)
    if cls is None:
        # The family's own prefix (model, transformer, ...): the causal LM checkpoint's keys load under it.
        prefix = getattr(pretrained, "base_model_prefix", "") or "model"
        attrs = {"base_model_prefix": prefix, "__module__": __name__}
        cls = type(name, (GenericForSequenceClassification, pretrained), attrs)
        _BUILT[name] = cls
        setattr(sys.modules[__name__], name, cls)
    AutoModelForSequenceClassification.register(type(config), cls, exist_ok=True)
    return cls


def auto_map(config: Any) -> dict[str, str]:
    """The ``auto_map`` entry of a config whose family gets its score head here (the written modeling file)."""
    return {_AUTO: f"{Path(MODELING_FILE).stem}.{score_head_class(config).__name__}"}


def modeling_source(config: Any) -> str:
    """The text of ``modeling_score_head.py``: the class of :func:`score_head_class`, over transformers only."""
    cls = score_head_class(config)
    pretrained = cls.__bases__[1]
    base = cls.__name__.removesuffix("ForSequenceClassification") + "Model"
    return (
        f'"""{cls.__name__}: a one-label reward model\'s score head over {base}, built\n'
        "from transformers' GenericForSequenceClassification as transformers builds LlamaForSequenceClassification\n"
        f"(this transformers has no {cls.__name__}). Written by hf_fsdp2; load the folder with\n"
        'AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)."""\n\n'
        "from transformers.modeling_layers import GenericForSequenceClassification\n"
        f"from {pretrained.__module__} import {pretrained.__name__}\n\n\n"
        f"class {cls.__name__}(GenericForSequenceClassification, {pretrained.__name__}):\n"
        f"    base_model_prefix = {getattr(cls, 'base_model_prefix', 'model')!r}\n"
    )


def carries_score_head(config: Any) -> bool:
    """Whether a saved config names this module's modeling file (an export that must carry it)."""
    entry = (getattr(config, "auto_map", None) or {}).get(_AUTO, "")
    return isinstance(entry, str) and entry.startswith(f"{Path(MODELING_FILE).stem}.")


def write_modeling_file(config: Any, folder: str | Path) -> bool:
    """Write ``modeling_score_head.py`` into ``folder`` when ``config`` names it; whether it did."""
    if not carries_score_head(config):
        return False
    (Path(folder) / MODELING_FILE).write_text(modeling_source(config))
    return True
