"""Which tensors an export writes and under which names: wrappers stripped, ties dropped, the names and
layout of the model's checkpoint format (as ``save_pretrained`` writes it).

Most architectures store each parameter under its module name, some under another name (GPT-NeoX:
``embed_out`` for ``lm_head``). Mixture-of-experts models in transformers 5 hold each layer's experts in
one fused tensor (``mlp.experts.gate_up_proj`` of shape ``[experts, 2 x inter, hidden]``) while the
checkpoint format has one tensor per expert and projection (``mlp.experts.3.gate_proj.weight``):
``save_pretrained`` applies a conversion that splits them. FSDP2 shards the fused tensor along the
expert dimension, so each rank holds whole experts; it applies transformers' own conversion to the
experts it holds and numbers them from its first expert. No rank gathers another rank's experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2.export.errors import ExportError

_EXPERT_INDEX = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")


def tied_targets(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are the very same tensor as an earlier one (tied embeddings).

    from_pretrained re-ties them from the config, so they are not written; the one kept is the
    source transformers declares (``all_tied_weights_keys``: target -> source), else the first.
    """
    declared: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    drop: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        keep = [n for n in names if n not in declared] or names[:1]
        drop.update(n for n in names if n != keep[0])
    return drop


@dataclass(frozen=True)
class ExpertSplit:
    """A fused expert tensor that the checkpoint format stores as one tensor per expert (and part).

    Attributes:
        source: the module name of the fused tensor (dim 0 = experts).
        targets: checkpoint name -> global shape, experts numbered from 0 over the whole tensor.
    """

    source: str
    targets: dict[str, tuple[int, ...]]


@dataclass
class CheckpointLayout:
    """How the model's tensors map onto the checkpoint format.

    Attributes:
        renames: module name -> checkpoint name, for tensors written as they are (most of them).
        splits: module name -> :class:`ExpertSplit`, for fused expert tensors.
    """

    renames: dict[str, str] = field(default_factory=dict)
    splits: dict[str, ExpertSplit] = field(default_factory=dict)

    def shapes(self, module_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> global shape of every tensor written, in module order."""
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in module_shapes.items():
            if name in self.splits:
                out.update(self.splits[name].targets)
            else:
                out[self.renames[name]] = shape
        return out

    def module_of(self) -> dict[str, str]:
        """Checkpoint name -> the module name it comes from."""
        out = {v: k for k, v in self.renames.items()}
        for name, split in self.splits.items():
            out.update(dict.fromkeys(split.targets, name))
        return out


def _conversion_target(model: torch.nn.Module) -> Any:
    """What transformers' conversion lookup should see: the model, or its meta twin when sharded.

    FSDP2's class is FSDP<Name>, which transformers' per-class lookup would miss.
    """
    if getattr(model, "_weight_conversions", None) is not None:
        return model
    return meta_twin(model)


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture built on the meta device from the model's config (no memory)."""
    import transformers

    from hf_fsdp2.model import auto_class_name

    config = getattr(model, "config", None)
    if config is None:
        return model
    try:
        with torch.device("meta"):
            return getattr(transformers, auto_class_name(config)).from_config(config)
    except (ValueError, KeyError, ImportError):  # remote code: transformers then goes by model_type
        return model


def _revert(target: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(target, dict(tensors)))


def checkpoint_layout(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> CheckpointLayout:
    """Map each module name to the checkpoint format's name(s), as ``save_pretrained`` would write them.

    Computed on meta tensors. A conversion is accepted when it is a renaming, or when it splits a fused
    tensor per expert along dim 0 such that converting any block of experts gives those experts' tensors
    (checked here by converting the first expert alone): every rank can then convert the experts it holds.

    Args:
        model: the live model (its ``_weight_conversions`` from from_pretrained, else its class's).
        shapes: module name -> global shape of every tensor to write.

    Returns:
        The layout.

    Raises:
        ExportError: a conversion the gather-free export cannot do per rank, naming the tensor; raised
            at start-up by the recipe, before any training.
    """
    target = _conversion_target(model)
    layout = CheckpointLayout()
    for name, shape in shapes.items():
        meta = torch.empty(shape, device="meta")
        out = _revert(target, {name: meta})
        if len(out) == 1 and next(iter(out.values())) is meta:
            layout.renames[name] = next(iter(out))
            continue
        targets = {k: tuple(v.shape) for k, v in out.items()}
        problem = _check_expert_split(target, name, shape, targets)
        if problem:
            raise ExportError(
                f"{type(model).__name__}'s checkpoint format stores {name} through a conversion the export cannot "
                f"apply shard by shard ({problem}); export with transformers' save_pretrained on one process"
            )
        layout.splits[name] = ExpertSplit(name, targets)
    written = layout.shapes(shapes)
    if len(written) != len(layout.renames) + sum(len(s.targets) for s in layout.splits.values()):
        raise ExportError(
            "two tensors of the model map onto one checkpoint name; the export cannot write both"
        )
    return layout


def _check_expert_split(
    target: Any, name: str, shape: tuple[int, ...], targets: dict[str, tuple[int, ...]]
) -> str:
    """'' when converting one expert's block gives exactly that expert's checkpoint tensors, else why not."""
    if not shape or shape[0] < 1:
        return "it has no expert dimension"
    by_expert: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, tshape in targets.items():
        match = _EXPERT_INDEX.match(key)
        if match is None:
            return f"it produces {key!r}, which is not numbered per expert"
        by_expert.setdefault(int(match.group(2)), {})[match.group(1) + "{}" + match.group(3)] = tshape
    if sorted(by_expert) != list(range(shape[0])):
        return f"{len(by_expert)} experts in the checkpoint names for {shape[0]} rows"
    one = _revert(target, {name: torch.empty((1, *shape[1:]), device="meta")})
    got = {}
    for key, value in one.items():
        match = _EXPERT_INDEX.match(key)
        if match is None or match.group(2) != "0":
            return f"converting one expert gives {key!r}"
        got[match.group(1) + "{}" + match.group(3)] = tuple(value.shape)
    if any(got != parts for parts in by_expert.values()):
        return "converting one expert does not give one expert's tensors"
    return ""


def split_local_experts(
    model: torch.nn.Module, name: str, local: torch.Tensor, first_expert: int
) -> dict[str, torch.Tensor]:
    """This rank's experts of fused tensor ``name`` in the checkpoint format, numbered globally.

    Args:
        model: the live model (for transformers' conversion rules).
        name: the fused tensor's module name.
        local: this rank's rows (whole experts) of it, in the export dtype.
        first_expert: the global index of the first row.

    Returns:
        Checkpoint name -> tensor, one per expert and part, for the experts held here.
    """
    if local.shape[0] == 0:
        return {}
    out = {}
    for key, value in _revert(_conversion_target(model), {name: local}).items():
        match = _EXPERT_INDEX.match(key)
        assert match is not None  # checkpoint_layout checked the names
        out[f"{match.group(1)}{int(match.group(2)) + first_expert}{match.group(3)}"] = value
    return out
