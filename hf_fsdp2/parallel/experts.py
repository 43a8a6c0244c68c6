"""The routed experts of a mixture-of-experts model as transformers 5 builds them, read for expert parallel, and what
expert parallel refuses before the model loads.

transformers 5 keeps each MoE layer's routed experts in one module of a class decorated with its
``use_experts_implementation``: fused tensors whose dim 0 is the expert (``gate_up_proj [E, 2 x inter, hidden]``,
``down_proj [E, hidden, inter]``, gpt-oss's biases ``[E, ...]``), a forward ``(hidden_states [T, hidden],
top_k_index [T, k], top_k_weights [T, k]) -> [T, hidden]`` that the experts interface (``config._experts_implementation``:
``grouped_mm``, ``batched_mm``, ``eager``) dispatches. Expert parallel registers its own implementation in that
interface (:mod:`hf_fsdp2.parallel.expert_parallel`), so it works for every family built that way and for none other:
a family whose experts are a list of MLPs, or a module of its own forward (Llama 4's ``Llama4TextExperts``), is refused
by name. Routers and shared experts are left as they are: they run on each rank's own tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_fsdp2.config.plans import ConfigError, MeshPlan

# Every instance of a use_experts_implementation class carries this attribute (the decorator's __init__ sets it):
# the mark of the modules the experts interface dispatches.
INTERFACE_MARK = "_is_expert_parallel"


class ExpertParallelError(ConfigError):
    """A model or setting expert parallel cannot run; the message names the reason and the fix."""


@dataclass(frozen=True, kw_only=True)
class ExpertsLayout:
    """The routed experts of a model.

    Attributes:
        classes: the experts classes (``Qwen3MoeExperts``).
        modules: the module names of the experts, one per MoE layer.
        num_experts: routed experts per layer.
        tensors: the fused tensors of one experts module (``gate_up_proj``, ``down_proj``, biases).
    """

    classes: tuple[str, ...]
    modules: tuple[str, ...]
    num_experts: int
    tensors: tuple[str, ...]

    def describe(self, ep: int, efsdp: int) -> str:
        return (
            f"expert parallel {ep}: {len(self.modules)} MoE layers ({', '.join(self.classes)}: "
            f"{', '.join(self.tensors)}), {self.num_experts} routed experts each, {self.num_experts // ep} per rank "
            f"(ranks of one ep group exchange tokens by all-to-all), each rank's experts sharded over {efsdp} rank(s); "
            "routers and shared experts stay with FSDP2 on each rank's own tokens"
        )


def experts_count(module: nn.Module) -> int:
    """Routed experts of an experts module (its ``num_experts``: the global count, also under expert parallel)."""
    value: Any = module.num_experts
    return int(value)


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The modules the experts interface dispatches, by name (empty for a dense model or a family without it)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, INTERFACE_MARK)}


def _unwrappable(model: nn.Module, found: dict[str, nn.Module]) -> list[str]:
    """Modules that hold routed experts outside the experts interface: named ``experts`` (or ``*experts``, not
    ``shared_experts``: a dense MLP every token runs), not marked, and not a wrapper around a marked one (LoRA on the
    fused experts: PEFT's ``ParamWrapper`` takes the experts' name and holds them as its ``base_layer``)."""
    out = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        wraps = any(inner.startswith(f"{name}.") for inner in found)
        if last.endswith("experts") and not last.startswith("shared") and name not in found and not wraps:
            out.append(f"{name} ({type(module).__name__})")
    return out


def _forward_arity(module: nn.Module) -> int:
    """Arguments after ``self`` of the class's own forward (the one the interface decorator wraps)."""
    forward = getattr(type(module).forward, "__wrapped__", type(module).forward)
    params = list(inspect.signature(forward).parameters.values())[1:]
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])


def read_experts(model: nn.Module) -> ExpertsLayout:
    """The routed experts of ``model`` (built, or on the meta device).

    Raises:
        ExpertParallelError: a dense model, experts outside transformers' experts interface, experts whose tensors
            are not fused with the experts on dim 0, or experts with modules of their own.
    """
    family = (
        f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', '?')!r})"
    )
    found = find_experts(model)
    others = _unwrappable(model, found)
    if others:
        raise ExpertParallelError(
            f"ep_size>1: {family} holds experts that transformers' experts interface does not dispatch "
            f"({', '.join(others[:3])}): expert parallel runs through that interface (the use_experts_implementation "
            "classes: fused 3-D expert tensors, a forward of (hidden states, top-k indices, top-k weights)), so it "
            "cannot move this family's tokens; use ep_size=1 for this model"
        )
    if not found:
        raise ExpertParallelError(
            f"ep_size>1: {family} is not a mixture-of-experts model (no routed experts in any layer), so there is "
            "nothing to split; use ep_size=1 (FSDP2 or HSDP shard it)"
        )
    counts = {int(getattr(m, "num_experts", -1)) for m in found.values()}
    tensors: tuple[str, ...] = ()
    for name, module in found.items():
        if len(counts) != 1 or -1 in counts:
            raise ExpertParallelError(
                f"ep_size>1: {family}'s MoE layers differ in their number of experts ({sorted(counts)}), which "
                "expert parallel does not split; use ep_size=1 for this model"
            )
        own = dict(module.named_parameters(recurse=False))
        bad = [
            f"{k} {tuple(p.shape)}" for k, p in own.items() if p.dim() < 2 or p.size(0) != module.num_experts
        ]
        if bad or not own:
            raise ExpertParallelError(
                f"ep_size>1: {name} ({type(module).__name__}) holds {', '.join(bad) or 'no tensor'}, not tensors "
                f"fused over its {module.num_experts} experts on dim 0, which expert parallel splits; use ep_size=1 "
                "for this model"
            )
        inner = [n for n, _ in module.named_parameters() if "." in n]
        if inner:
            raise ExpertParallelError(
                f"ep_size>1: {name} ({type(module).__name__}) has parameters in modules of its own ({', '.join(inner)}), "
                "which expert parallel cannot place with one expert's rows; use ep_size=1 for this model"
            )
        if _forward_arity(module) != 3:
            raise ExpertParallelError(
                f"ep_size>1: {type(module).__name__}.forward does not take (hidden states, top-k indices, top-k "
                "weights), the experts interface's call that expert parallel replaces; use ep_size=1 for this model"
            )
        tensors = tuple(own)
    return ExpertsLayout(
        classes=tuple(sorted({type(m).__name__ for m in found.values()})),
        modules=tuple(found),
        num_experts=counts.pop(),
        tensors=tensors,
    )


def check_expert_split(layout: ExpertsLayout, mesh: MeshPlan) -> None:
    """Refuse a split that does not give every rank whole experts.

    Raises:
        ExpertParallelError: ``ep_size`` not dividing the experts, or ``efsdp`` not dividing one rank's experts.
    """
    experts = layout.num_experts
    if experts % mesh.ep:
        raise ExpertParallelError(
            f"ep_size={mesh.ep} does not divide the model's {experts} routed experts: each rank of an ep group holds "
            f"whole experts; choose an ep_size that divides {experts}"
        )
    if (experts // mesh.ep) % mesh.efsdp:
        raise ExpertParallelError(
            f"ep_size={mesh.ep} leaves {experts // mesh.ep} experts per rank, which its efsdp = dp_shard x cp / ep = "
            f"{mesh.efsdp} ranks cannot shard by whole experts (the checkpoint and the export split the fused tensors "
            f"per expert); choose an ep_size for which {experts} / ep_size divides by dp_shard x cp / ep_size"
        )


def check_expert_parallel(model: nn.Module, mesh: MeshPlan) -> ExpertsLayout:
    """What expert parallel refuses for ``model``, before it loads: ``model`` is built from its config on the meta
    device (:func:`hf_fsdp2.model.meta_model`, every rank alike, nothing read), its experts read
    (:func:`read_experts`) and their split checked (:func:`check_expert_split`).

    Raises:
        ExpertParallelError: naming the model, the modules and the fix.
    """
    layout = read_experts(model)
    check_expert_split(layout, mesh)
    return layout


LOAD_ATTRIBUTE = "_hf_fsdp2_expert_load"  # each experts module's ExpertLoad


class ExpertLoad:
    """The tokens routed to each expert of one MoE layer, counted on this rank since the last read: a device tensor,
    never read on the host until the log asks (:func:`expert_load_metrics`)."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None

    def add(self, per_expert: torch.Tensor) -> None:
        per_expert = per_expert.detach()
        self.counts = per_expert.clone() if self.counts is None else self.counts + per_expert

    def take(self, num_experts: int, device: torch.device) -> torch.Tensor:
        """The counts since the last read (zeros when the layer did not run), and a fresh start."""
        counts = self.counts if self.counts is not None else torch.zeros(num_experts, dtype=torch.long)
        self.counts = None
        return counts.to(device)


def in_backward() -> bool:
    """Whether autograd is running a backward (a checkpointed layer's recomputation, whose forward was counted)."""
    return bool(torch._C._current_graph_task_id() != -1)


def counts_load() -> bool:
    """Whether the forward running now is a training forward whose routing the load counts: with gradients (not an
    evaluation, a rollout's generation or a reference pass) and not a checkpointed layer's recomputation."""
    return torch.is_grad_enabled() and not in_backward()


def expert_load(module: nn.Module) -> ExpertLoad:
    """The load counter of an experts module (made on first use)."""
    load = getattr(module, LOAD_ATTRIBUTE, None)
    if load is None:
        load = ExpertLoad()
        setattr(module, LOAD_ATTRIBUTE, load)
    return load


def count_expert_load(model: nn.Module, *, hooks: bool = True) -> int:
    """Count the tokens the router sends each expert of every MoE layer of ``model`` (a forward pre-hook on each
    experts module: a ``bincount`` of its top-k indices on the device; expert parallel counts in its own forward and
    passes ``hooks=False``). A checkpointed layer's recomputation is not counted again. Returns the layers counted."""
    modules = find_experts(model)
    for module in modules.values():
        load = expert_load(module)
        if not hooks:
            continue

        def count(mod: nn.Module, args: tuple[Any, ...], load: ExpertLoad = load) -> None:
            if len(args) >= 2 and isinstance(args[1], torch.Tensor) and counts_load():
                load.add(torch.bincount(args[1].reshape(-1), minlength=experts_count(mod)))

        module.register_forward_pre_hook(count)
    return len(modules)


def expert_load_metrics(model: nn.Module, device: torch.device) -> dict[str, float]:
    """The routed load of the experts since the last call, over every rank (collective: one all-reduce; every rank
    calls it at the same steps): ``moe_load_min`` / ``moe_load_max``, the least and most loaded expert of any layer
    as a multiple of a perfectly even load (1.0: every expert got ``tokens x top_k / experts``). Empty for a model
    without routed experts, or when no MoE layer ran. No token is ever dropped: every expert takes all it is sent
    (no capacity limit)."""
    from hf_fsdp2 import collectives

    modules = find_experts(model)
    if not modules:
        return {}
    counts = torch.stack([expert_load(m).take(experts_count(m), device).double() for m in modules.values()])
    counts = collectives.all_reduce_sum(counts)
    counts = counts[counts.sum(dim=1) > 0]  # the layers that ran
    if not counts.numel():
        return {}
    ratio = counts * counts.size(1) / counts.sum(dim=1, keepdim=True)
    return {"moe_load_min": float(ratio.min()), "moe_load_max": float(ratio.max())}
