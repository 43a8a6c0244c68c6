"""Tensor parallel: the family's own plan (transformers' ``config.base_model_tp_plan``) applied to a loaded model
with torch's DTensor styles, on the ``tp`` dimension of the run's mesh, before ``fully_shard`` (torchtitan's
``parallelize_llama`` order: float8 -> tp -> ac -> compile -> fsdp), with sequence parallel between the split modules and the
vocabulary split over the embedding and the output head (torchtitan's layout; the styles and what each communicates:
:mod:`hf_fsdp2.parallel.sequence_parallel`).

What each plan style becomes:

- ``colwise`` (q/k/v, gate/up): torch's ``ColwiseParallel``: the weight's output rows split over the tp ranks, the
  input the whole sequence as a replicated DTensor (gathered once per block), the output this rank's heads /
  intermediate columns (a plain local tensor, so the attention and the activation run on local heads unchanged: the
  HF reshapes use ``-1`` heads, and ``num_key_value_groups`` is a ratio that the split keeps).
- ``rowwise`` (o, down): the weight's input columns split, the partial output reduce-scattered to this rank's
  positions.
- ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``): the weight replicated, the input
  marked as sharded over its heads dim, so the weight's gradient is partial over the tp ranks and FSDP2 sums it
  (it redistributes a gradient to its parameter's placements before the reduce-scatter).

Beyond the plan: the attention and MLP blocks gather their input (``PrepareModuleInput``), the decoder layers' norms
and the final norm compute on this rank's positions (``SequenceParallel``), the first layer's input is cut to them,
the embedding and the head are split over the vocabulary (the chunked loss computes on this rank's vocabulary rows:
loss parallel; the plain loss gathers the logits). FSDP2 then shards every parameter over the data dimensions of one
mesh (2-D: data x tp), so gradient clipping, the checkpoint and the export see one kind of tensor.

Not every model can run: transformers' styles for fused tensors (``packed_colwise``, ``colwise_gather_output``,
``moe_tp_experts``) have no torch equivalent, MoE experts are not split, and a decoder layer must be blocks (the plan's
projections) and norms (:func:`tp_plan_for` refuses anything else by name).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from hf_fsdp2.parallel.sequence_parallel import (
    Float8GatherSequence,
    Float8RowwiseToSequence,
    GatherSequence,
    Replicated,
    RowwiseToSequence,
    SequenceLayout,
    SequenceNorm,
    SplitSequence,
    VocabHead,
    tensorwise_float8,
)

# Plan styles this version applies, and what each becomes (see the module docstring).
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


class TensorParallelError(ValueError):
    """A model or setting tensor parallel cannot run; the message names the reason and the fix."""


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """The layout of one model: module name -> style, in the order they are applied.

    Attributes:
        family: the model type, for the log.
        styles: the family plan's modules (wildcards expanded) -> ``colwise`` / ``rowwise`` /
            ``replicated_with_grad_allreduce``, and the modules sequence parallel adds: ``vocab_embedding``,
            ``split_sequence`` (the first decoder layer), ``gather_sequence`` (attention and MLP blocks),
            ``sequence_norm`` (the decoder layers' norms and the final norm), ``vocab_head``.
        tied: the head's weight is the embedding's (one parameter, split once).
    """

    family: str
    styles: dict[str, str]
    tied: bool = False

    def describe(self, tp: int) -> str:
        counts: dict[str, int] = {}
        for style in self.styles.values():
            counts[style] = counts.get(style, 0) + 1
        split = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return (
            f"tensor parallel {tp} ({self.family}'s base_model_tp_plan through torch DTensor styles, sequence "
            f"parallel between them): {split}; embedding and output head split over the vocabulary"
            f"{' (tied: one weight)' if self.tied else ''}: loss parallel under the chunked loss (each rank its "
            f"vocabulary rows, 1/{tp} of the head's memory and GEMMs), the logits gathered under the plain loss; per "
            "decoder layer 2 all-gathers + 2 reduce-scatters forward and backward"
        )


def tp_plan_for(model: nn.Module) -> TensorParallelPlan:
    """The model's tensor-parallel layout: transformers' ``config.base_model_tp_plan`` with its wildcards expanded to
    this model's module names (under ``base_model_prefix``), and the sequence-parallel modules around it.

    Raises:
        TensorParallelError: the family has no plan, the plan has a style this version cannot apply (MoE experts), a
            plan entry matches no module, a ``replicated_with_grad_allreduce`` module does not normalise per head, or a
            decoder layer or the base model holds a parameter that is neither a split block nor a norm.
    """
    config = getattr(model, "config", None)
    family = str(getattr(config, "model_type", type(model).__name__))
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise TensorParallelError(
            f"tp_size>1: {type(model).__name__} (model_type {family!r}) has no tensor-parallel plan (transformers' "
            "config.base_model_tp_plan is empty for it), so there is nothing to split; use tp_size=1 (FSDP2 or HSDP "
            "shards it over the data ranks)"
        )
    unsupported = sorted({s for s in plan.values() if s not in STYLES})
    if unsupported:
        raise TensorParallelError(
            f"tp_size>1: {family}'s base_model_tp_plan uses {unsupported}, transformers' own styles for fused "
            f"expert tensors (and others) that have no torch DTensor equivalent; this version applies {list(STYLES)} "
            "only, so MoE families are not split; use tp_size=1 for this model"
        )
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [n for n, _ in model.named_modules()]
    if prefix and not any(n.startswith(prefix + ".") for n in names):
        prefix = ""  # the model is its own base model
    # transformers 5.25 moved MoE experts out of the TP plan (into base_model_ep_plan): the plan above no longer names
    # them, and its dense-MLP entries match nothing in an all-MoE model. Experts stay refused by name either way.
    experts = [n for n in names if n.endswith(".experts")]
    if experts:
        raise TensorParallelError(
            f"tp_size>1: {family} is a mixture-of-experts model ({len(experts)} expert blocks, e.g. {experts[0]}); "
            "this version splits attention and dense MLPs only, not experts, so MoE families are not split; use "
            "tp_size=1 for this model"
        )
    split: dict[str, str] = {}
    for pattern, style in plan.items():
        full = f"{prefix}.{pattern}" if prefix else pattern
        hits = [n for n in names if fnmatch.fnmatchcase(n, full)]
        if not hits:
            raise TensorParallelError(
                f"tp_size>1: {family}'s base_model_tp_plan entry {pattern!r} matches no module of "
                f"{type(model).__name__} (looked for {full!r}); a wrapped model (LoRA) or renamed modules cannot be "
                "split; use tp_size=1"
            )
        split.update(dict.fromkeys(hits, style))
    head_dim = _head_dim(config)
    for name, style in split.items():
        if style == "replicated_with_grad_allreduce":
            weight = getattr(model.get_submodule(name), "weight", None)
            if weight is None or weight.ndim != 1 or weight.shape[0] != head_dim:
                raise TensorParallelError(
                    f"tp_size>1: {name} ({style}) does not normalise each head on its own (weight "
                    f"{tuple(weight.shape) if weight is not None else None}, head_dim {head_dim}); this version "
                    "splits such norms over heads only; use tp_size=1"
                )
    return _with_sequence_parallel(model, family, prefix, split)


def _with_sequence_parallel(
    model: nn.Module, family: str, prefix: str, split: dict[str, str]
) -> TensorParallelPlan:
    """The plan's modules with sequence parallel around them, in the order they are applied (see the module
    docstring), after checking that each decoder layer is made of split blocks and norms only."""
    names = {module: name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise TensorParallelError(
            f"tp_size>1: {type(model).__name__}'s embedding ({type(embed).__name__}) and output head "
            f"({type(head).__name__}) must be nn.Embedding and a bias-free nn.Linear to split them over the "
            "vocabulary; use tp_size=1"
        )
    blocks = sorted(
        {name.rsplit(".", 1)[0] for name, style in split.items() if style in ("colwise", "rowwise")}
    )
    layers = sorted({block.rsplit(".", 1)[0] for block in blocks}, key=_natural)
    styles = {names[embed]: "vocab_embedding", layers[0]: "split_sequence"}
    hidden = int(embed.weight.shape[1])
    for layer in layers:
        for child, module in model.get_submodule(layer).named_children():
            name = f"{layer}.{child}"
            if name in blocks:
                outputs = [n for n in split if n.startswith(name + ".") and split[n] == "rowwise"]
                if len(outputs) != 1:
                    raise TensorParallelError(
                        f"tp_size>1: {name} has {len(outputs)} row-parallel projections in {family}'s plan; sequence "
                        "parallel needs one output projection per block; use tp_size=1"
                    )
                styles[name] = "gather_sequence"
                styles.update({n: s for n, s in split.items() if n.startswith(name + ".")})
            elif any(True for _ in module.parameters()):
                styles[name] = _norm_style(name, module, hidden, family)
    base = model.get_submodule(prefix) if prefix else model
    container = layers[0].rsplit(".", 1)[0]
    for child, module in base.named_children():
        name = f"{prefix}.{child}" if prefix else child
        if module is not embed and name != container and any(True for _ in module.parameters()):
            styles[name] = _norm_style(name, module, hidden, family)
    styles[names[head]] = "vocab_head"
    return TensorParallelPlan(family=family, styles=styles, tied=head.weight is embed.weight)


def _norm_style(name: str, module: nn.Module, hidden: int, family: str) -> str:
    """``sequence_norm`` for a norm over the hidden size (parameters ``[hidden]`` only); else refused by name."""
    shapes = [tuple(p.shape) for p in module.parameters()]
    if shapes and all(shape == (hidden,) for shape in shapes) and not list(module.children()):
        return "sequence_norm"
    raise TensorParallelError(
        f"tp_size>1: {name} ({type(module).__name__}, parameters {shapes}) in {family} is neither a block the "
        "plan splits nor a norm over the hidden size, so sequence parallel has no style for it; use tp_size=1"
    )


def _natural(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


def _head_dim(config: Any) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> str:
    """Split ``model`` over ``tp_mesh`` by ``plan`` and replicate its other parameters over it, in place (every rank
    of the mesh, no communication: each takes its part of the weights it loaded).

    Returns:
        The line for the log (what is split, what is replicated, where the head is).
    """
    done: dict[int, nn.Parameter] = {}
    layout = SequenceLayout(tp_mesh)
    styles: dict[str, ParallelStyle] = {}
    for name, style in plan.styles.items():
        styles[name] = _style(style, model, name, plan, layout, done)
    # src_data_rank=None: every rank slices its own copy (no broadcast of rank 0's weights).
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    if plan.tied:  # the embedding's split weight is the head's too (one parameter: FSDP2 shards it once)
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
        head.register_parameter("weight", embed.weight)
    for name, module in model.named_modules():
        if name in plan.styles:
            continue
        if any(p is not None and not isinstance(p, DTensor) for p in module._parameters.values()):
            Replicated(done)._apply(module, tp_mesh)
    return plan.describe(tp_mesh.size())


def float8_collectives(mesh: DeviceMesh) -> bool:
    """Whether activations and their gradients may cross ``mesh``'s ranks as float8 (NCCL); gloo has no float8 type,
    so on CPU they travel in the compute dtype and the float8 linears cast them themselves."""
    return mesh.device_type != "cpu"


def _style(
    style: str,
    model: nn.Module,
    name: str,
    plan: TensorParallelPlan,
    layout: SequenceLayout,
    done: dict[int, nn.Parameter],
) -> ParallelStyle:
    """The style of one module; torchao's float8 styles for tensorwise float8 linears (FP8 converts before TP)."""
    module = model.get_submodule(name)
    float8_wire = float8_collectives(layout.mesh)
    if style == "colwise":
        if tensorwise_float8(module):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

            return Float8ColwiseParallel()
        return ColwiseParallel()
    if style == "rowwise":
        if float8_wire and tensorwise_float8(module):
            return Float8RowwiseToSequence(layout, done)
        return RowwiseToSequence(layout, done)
    if style == "gather_sequence":
        # The block's column-parallel projections take its input: all tensorwise float8, it is gathered as float8.
        inputs = [
            model.get_submodule(n)
            for n, s in plan.styles.items()
            if s == "colwise" and n.startswith(name + ".")
        ]
        if float8_wire and inputs and all(tensorwise_float8(m) for m in inputs):
            return Float8GatherSequence(layout, inputs[0].linear_mm_config)
        return GatherSequence(layout)
    if style == "replicated_with_grad_allreduce":
        return Replicated(done, heads=True)
    if style == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "split_sequence":
        return SplitSequence(layout)
    if style == "sequence_norm":
        return SequenceNorm(layout, done)
    assert style == "vocab_head", style
    return VocabHead(layout, done)


@contextlib.contextmanager
def tp_prepared_by_torch(accelerator: Any) -> Iterator[None]:
    """Within the block, ``accelerator.prepare`` does not run its own tensor-parallel preparation: accelerate 1.16's
    ``_prepare_tp`` imports ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5
    removed (ImportError), and all it would do, replicating the parameters the plan leaves whole, is done already
    (:func:`apply_tensor_parallel`). Accelerate still builds the mesh (``ParallelismConfig(tp_size=...)``) and runs
    its FSDP2 prepare over the mesh's data dimensions (``dp_shard_cp``), which sees the tp DTensors and shards them
    2-D. A write to the public ``tp_size`` field of the accelerator's ``ParallelismConfig``, restored after."""
    config = getattr(accelerator, "parallelism_config", None)
    size = getattr(config, "tp_size", 1) or 1
    if config is None or size <= 1:
        yield
        return
    config.tp_size = 1
    try:
        if getattr(
            config, "tp_enabled", True
        ):  # this accelerate decides otherwise: its _prepare_tp would run
            raise RuntimeError(
                "accelerate's ParallelismConfig.tp_enabled no longer follows tp_size (accelerate "
                f"{_accelerate_version()}): its own tensor-parallel prepare would run on the split model; install the "
                "accelerate docs/compatibility.md lists as tested (pip install 'accelerate==1.16.*') or use tp_size=1"
            )
        yield
    finally:
        config.tp_size = size


def _accelerate_version() -> str:
    import accelerate

    return str(getattr(accelerate, "__version__", "?"))


def check_tp_settings(
    tp: int,
    *,
    use_peft: bool,
    load_in_4bit: bool,
    liger: bool,
    ram_efficient_loading: bool | None,
) -> dict[str, str]:
    """Refuse what does not compose with tensor parallel yet, before any work.

    Compile composes (regional and whole-model: the compiled layers' losses equal eager's, no recompile as lengths
    change; tests/distributed/test_compile_recompiles.py), with a deeper recursion limit for AOT autograd's tracing
    of DTensor shapes (:data:`hf_fsdp2.parallel.compiling.DTENSOR_COMPILE_RECURSION_LIMIT`).

    Args:
        tp: ``tp_size``.
        use_peft / load_in_4bit / liger: the run's LoRA, QLoRA and Liger settings.
        ram_efficient_loading: the recipe's value (None: unset).

    Returns:
        The unset keys tensor parallel turns off -> the line for the log (empty without TP). The caller sets
        ``fsdp_cpu_ram_efficient_loading`` to false whenever ``tp > 1``.

    Raises:
        ConfigError: LoRA / QLoRA, Liger kernels or ``fsdp_cpu_ram_efficient_loading=true`` with ``tp_size>1``.
    """
    from hf_fsdp2.config import ConfigError

    if tp <= 1:
        return {}
    if use_peft or load_in_4bit:
        raise ConfigError(
            f"tp_size={tp} with use_peft / load_in_4bit is not supported: LoRA wraps the linear layers the plan "
            "splits (torch's ColwiseParallel / RowwiseParallel split nn.Linear only); use tp_size=1 for LoRA runs"
        )
    if liger:
        raise ConfigError(
            f"tp_size={tp} with use_liger_kernel=true is not supported: Liger's kernels compute on plain tensors, "
            "and the tensor-parallel modules hold DTensors; set use_liger_kernel=false"
        )
    if ram_efficient_loading:
        raise ConfigError(
            f"tp_size={tp} with fsdp_cpu_ram_efficient_loading=true is not supported: Accelerate broadcasts rank 0's "
            "state dict, which holds only rank 0's tensor-parallel part of each split weight once the plan is "
            "applied; set fsdp_cpu_ram_efficient_loading=false (every rank loads the checkpoint, then keeps its part)"
        )
    off: dict[str, str] = {}
    if ram_efficient_loading is None:
        off["fsdp_cpu_ram_efficient_loading"] = (
            f"fsdp_cpu_ram_efficient_loading=false (tp_size={tp}: each rank loads the checkpoint and keeps its part "
            "of the split weights; Accelerate's rank-0 broadcast would carry rank 0's part only)"
        )
    return off
