"""The registry of training methods: the built-in ones by package (imported on first use) and those registered in this
process, and the one check of the layouts a method supports (:func:`check_capabilities`, which the loop, doctor and
``hf-fsdp2 plan`` call). Recipes, ``hf-fsdp2 train``, doctor, the memory plan and the model card ask the registry
instead of comparing recipe names; :mod:`hf_fsdp2.methods` imports these functions for recipes. Listing the names
imports nothing (``hf-fsdp2 train`` reads them before torch is imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hf_fsdp2.config import ConfigError

if TYPE_CHECKING:
    from hf_fsdp2.config import Config
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.run.method import Method

BUILTIN: dict[str, str] = {
    "sft": "hf_fsdp2.methods.sft",
    "cpt": "hf_fsdp2.methods.cpt",
    "dpo": "hf_fsdp2.methods.dpo",
    "kto": "hf_fsdp2.methods.kto",
    "rm": "hf_fsdp2.methods.rm",
    "grpo": "hf_fsdp2.methods.grpo",
}
"""Name -> the package that defines ``METHOD`` (imported on first use: listing the names imports nothing)."""

_REGISTERED: dict[str, Method] = {}


def method_names() -> list[str]:
    """Every method's name: the built-in ones, then those registered in this process."""
    return [*BUILTIN, *(name for name in _REGISTERED if name not in BUILTIN)]


def register(method: Method) -> Method:
    """Make ``method`` known by its name in this process (a method defined outside this package).

    Raises:
        ValueError: the name is a built-in method's, or another method registered under it.
    """
    if method.name in BUILTIN:
        raise ValueError(f"method {method.name!r} is built in ({BUILTIN[method.name]}); choose another name")
    known = _REGISTERED.get(method.name)
    if known is not None and known is not method:
        raise ValueError(f"another method is already registered as {method.name!r}; choose another name")
    _REGISTERED[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The method called ``name``.

    Raises:
        ConfigError: no such method, naming the known ones.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in BUILTIN:
        raise ConfigError(f"unknown recipe {name!r}: one of {', '.join(method_names())}")
    method: Method = importlib.import_module(BUILTIN[name]).METHOD
    return method


# Per capability: what the config asks, why a method without it refuses, and the fix.
_LAYOUTS = {
    "context_parallel": (
        "cp_size={cp}",
        "its step scores whole sequences per rank (rewards, generations, KL pairs)",
        "use cp_size=1 (activation_checkpointing and ce_chunk_tokens for long sequences)",
    ),
    "ring_attention": (
        "cp_backend=ring",
        "its step shards sequences the all-to-all way only",
        "use cp_backend=all_to_all (or auto)",
    ),
    "tensor_parallel": (
        "tp_size={tp}",
        "its step normalises the loss by counts over every rank, which would count each tensor-parallel group's "
        "batch tp_size times",
        "use tp_size=1 (FSDP2 or HSDP)",
    ),
    "float8": (
        "mixed_precision=fp8",
        "its reference, reward or score models and weight syncs are not verified with float8 linears",
        "use mixed_precision=bf16",
    ),
    "expert_parallel": (
        "ep_size>1",
        "its reference, reward or score models and its weight syncs are not verified with each MoE layer's experts "
        "split over ranks",
        "use ep_size=1 (FSDP2 shards the experts, the plan shows what they move)",
    ),
    "images": (
        "freeze_vision_tower=false or freeze_multi_modal_projector=false",
        "it reads no image records, and a composite's vision tower and projector run on image tokens only, so they "
        "would get no gradient and train nothing",
        "leave both true (the default: frozen, never gathered on text rows, exported byte-identical)",
    ),
}


def asked_layouts(cfg: Config, mesh: MeshPlan) -> list[str]:
    """The :class:`Capabilities` a run of ``cfg`` on ``mesh`` needs, in the order they are checked."""
    asked = []
    if mesh.cp > 1:
        asked.append("context_parallel")
        if mesh.cp_backend == "ring":
            asked.append("ring_attention")
    if mesh.tp > 1:
        asked.append("tensor_parallel")
    if mesh.ep > 1:
        asked.append("expert_parallel")
    if cfg.train.mixed_precision == "fp8":
        asked.append("float8")
    if not (cfg.model.freeze_vision_tower and cfg.model.freeze_multi_modal_projector):
        asked.append("images")
    return asked


def supporting(layout: str) -> list[str]:
    """The registered methods whose capabilities include ``layout`` (imports every method)."""
    return [name for name in method_names() if getattr(get_method(name).capabilities, layout)]


def check_capabilities(method: Method, cfg: Config, mesh: MeshPlan) -> None:
    """Refuse, before any work, a layout ``method`` does not support: what the run, doctor and ``hf-fsdp2 plan`` all
    call, every rank alike (a function of the config and the mesh's sizes).

    Raises:
        ConfigError: naming the setting, the method, why, the methods that run it (from the registry), and the fix.
    """
    for layout in asked_layouts(cfg, mesh):
        if getattr(method.capabilities, layout):
            continue
        setting, why, fix = _LAYOUTS[layout]
        names = supporting(layout)
        listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
        where = (
            f"{layout.replace('_', ' ')} runs with the {listed} recipe{'s' if len(names) > 1 else ''}"
            if names
            else f"no registered recipe supports {layout.replace('_', ' ')}"
        )
        raise ConfigError(
            f"{setting.format(cp=mesh.cp, tp=mesh.tp)} is not supported by the {method.name} recipe in this version: "
            f"{why}; {where}. {fix[0].upper()}{fix[1:]}"
        )
