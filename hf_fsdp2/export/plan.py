"""The export plan: what every rank writes (names, global shapes, dtypes, files), decided without communication.

Below both the writer (:mod:`.writer`) and the verification (:mod:`.verify`), which read the same plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate
from transformers import PretrainedConfig

from hf_fsdp2.composite import composite_spec
from hf_fsdp2.dtypes import dtype_name, dtype_named
from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.export.files import dtype_of_code, file_names, is_supported, nbytes, plan_files
from hf_fsdp2.export.naming import CheckpointLayout, checkpoint_layout, split_local_experts, tied_targets
from hf_fsdp2.export.source import ExportSource, SourceTensor, locate, weight_map
from hf_fsdp2.model import auto_class_name
from hf_fsdp2.parallel.float8 import without_float8_wrapper

EXPORT_DTYPES = ("bfloat16", "float32", "float16")


def resolve_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype of ``export_dtype``; None for ``training`` (each tensor keeps its own dtype).

    Raises:
        ValueError: an unknown name.
    """
    if dtype == "training":
        return None
    return dtype_named(dtype, "export_dtype", (*EXPORT_DTYPES, "training"))


def first_replica(tensor: DTensor) -> bool:
    """True on the ranks that write a DTensor's local shard: coordinate 0 of every replicated mesh dim."""
    coords = list(tensor.device_mesh.get_coordinate() or [])
    return all(c == 0 for c, p in zip(coords, tensor.placements, strict=False) if isinstance(p, Replicate))


def _row_offset(tensor: torch.Tensor) -> int:
    """The global index of this rank's first row of a dim-0-sharded tensor (0 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 0
    chunks = tensor.__create_chunk_list__()
    return int(chunks[0].offsets[0]) if chunks else 0


@dataclass(frozen=True, kw_only=True)
class Carried:
    """What an export copies byte for byte from the checkpoint the run started from, and the names it must hold.

    Attributes:
        source: the checkpoint.
        tensors: checkpoint name -> where its bytes lie in the source, for every tensor carried.
        frozen: checkpoint name -> module name, for the carried tensors the model holds and did not train (a
            composite's frozen vision tower and projector): the live shards are compared with the source's bytes.
        unloaded: the carried tensors the model class does not load (its ``_keys_to_ignore_on_load_unexpected``:
            Qwen3.5's ``mtp.*``).
        left_out: source tensors a reward model replaces with its score head (the causal LM's head).
        source_names: every tensor name of the source, in its order.
        tied: checkpoint names the export leaves out as tied copies (from_pretrained ties them again).
    """

    source: ExportSource
    tensors: dict[str, SourceTensor]
    frozen: dict[str, str]
    unloaded: list[str]
    left_out: list[str]
    source_names: list[str]
    tied: frozenset[str]

    def summary(self, export_dtype: torch.dtype | None) -> str:
        """One line for the log: what is carried, from where, and in which dtype ("" when nothing is)."""
        dropped = (
            f"export: {self.left_out[:3]} of {self.source.name_or_path} left out (the causal LM's head, which the "
            "reward model's score head replaces)"
            if self.left_out
            else ""
        )
        if not self.tensors:
            return dropped
        codes: dict[str, int] = {}
        for t in self.tensors.values():
            codes[t.dtype] = codes.get(t.dtype, 0) + 1
        other = {c: n for c, n in codes.items() if export_dtype is None or dtype_of_code(c) != export_dtype}
        note = (
            f"; kept in the source's dtype ({', '.join(f'{n} in {c}' for c, n in sorted(other.items()))}) where "
            f"export_dtype is {dtype_name(export_dtype)}: transformers casts them on load"
            if other and export_dtype is not None
            else ""
        )
        parts = [f"{len(self.frozen)} that do not train"] if self.frozen else []
        parts += [f"{len(self.unloaded)} the model class does not load"] if self.unloaded else []
        return (
            f"export: {len(self.tensors)} of the {len(self.source_names)} tensors of {self.source.name_or_path} are "
            f"carried byte for byte from its files ({', '.join(parts)}: e.g. {(self.unloaded or list(self.frozen))[:2]})"
            f"{note}"
        ) + (f"; {dropped}" if dropped else "")


@dataclass(kw_only=True)
class ExportPlan:
    """Everything every rank agrees on before writing: names, global shapes, dtypes, files.

    ``sources`` holds this rank's own data: checkpoint name -> its (sharded) tensor as trained; fused
    expert tensors are in ``expert_sources`` (module name -> sharded tensor) and become their checkpoint
    tensors only when written (:meth:`local_experts`). Tensors in ``carried`` are copied from the source
    checkpoint's files; ``shapes``, ``dtypes`` and ``files`` cover both.
    """

    sources: dict[str, torch.Tensor]
    expert_sources: dict[str, torch.Tensor]
    layout: CheckpointLayout
    module_names: dict[str, str]  # checkpoint name -> module name, of the tensors written from the shards
    shapes: dict[str, tuple[int, ...]]  # checkpoint name -> global shape
    dtypes: dict[str, torch.dtype]  # checkpoint name -> export dtype
    files: list[list[str]]
    names: list[str]
    weights_dtype: torch.dtype  # the dtype config.json states
    model: torch.nn.Module
    carried: Carried | None = None  # None: no source checkpoint given (every tensor from the shards)

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(self.shapes[k], self.dtypes[k]) for k in self.shapes)

    @property
    def carried_tensors(self) -> dict[str, SourceTensor]:
        return self.carried.tensors if self.carried is not None else {}

    def cast(self, key: str) -> torch.Tensor:
        """This rank's shard of ``key`` in the export dtype (a copy only when the dtype changes)."""
        return self.sources[key].detach().to(self.dtypes[key])

    def local_experts(self, module_name: str) -> dict[str, torch.Tensor]:
        """This rank's experts of a fused tensor, per checkpoint name, in the export dtype (whole tensors)."""
        source = self.expert_sources[module_name]
        if isinstance(source, DTensor) and not first_replica(source):
            return {}  # another replica writes these experts
        local = source.to_local() if isinstance(source, DTensor) else source
        keys = self.layout.splits[module_name].targets
        dtype = self.dtypes[next(iter(keys))]
        return split_local_experts(self.model, module_name, local.detach().to(dtype), _row_offset(source))


def _checkpoint_names(layout: CheckpointLayout, module_names: set[str]) -> list[str]:
    out: list[str] = []
    for name in module_names:
        if name in layout.splits:
            out.extend(layout.splits[name].targets)
        elif name in layout.renames:
            out.append(layout.renames[name])
    return out


def _ignored_on_load(model: torch.nn.Module) -> re.Pattern[str] | None:
    """The model class's ``_keys_to_ignore_on_load_unexpected`` as one pattern: checkpoint tensors it knowingly
    does not load (Qwen3.5's and Qwen3-Next's ``mtp.*``, DeepSeek-V3's next-token layer), searched as
    transformers searches them."""
    patterns = sorted(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def plan_carried(
    model: torch.nn.Module,
    layout: CheckpointLayout,
    *,
    frozen: set[str],
    tied: dict[str, tuple[int, ...]],
    source: ExportSource,
) -> Carried | None:
    """Which tensors an export copies from ``source`` and the check that, with those it writes from the shards, the
    export holds every tensor of the source under its name (no communication; every rank reads the same files).

    Args:
        model: the live model (sharded or not): its config, class and ``_keys_to_ignore_on_load_unexpected``.
        layout: module name -> checkpoint name(s) of every tensor written (tied copies excluded).
        frozen: module names of the parameters that do not train: carried from the source's bytes.
        tied: module name -> shape of the tied copies the export leaves out.
        source: the checkpoint the model was loaded from.

    Returns:
        The plan, or None when the source has no safetensors weights (a text model: the export writes every
        tensor from the shards as before, and no name can be checked).

    Raises:
        ExportError: a tensor of the source the export would lack (named, with why), a frozen tensor the source does
            not hold, or a composite whose source has no safetensors weights.
    """
    files = weight_map(source)
    config = getattr(model, "config", None)
    if files is None:
        if config is not None and composite_spec(config) is not None:
            raise ExportError(
                f"{source.name_or_path} has no safetensors weights (model.safetensors or its index): the export of a "
                "composite copies the parts that do not train from them byte for byte. Convert the checkpoint to "
                "safetensors first (load it and save_pretrained it with transformers)"
            )
        return None
    tied_names = set(_checkpoint_names(checkpoint_layout(model, tied), set(tied))) if tied else set()
    written = set(_checkpoint_names(layout, set(layout.renames) | set(layout.splits)))
    frozen_names = {n: m for m in frozen for n in _checkpoint_names(layout, {m})}
    absent = sorted(n for n in frozen_names if n not in files)
    if absent:
        raise ExportError(
            f"{len(absent)} tensors that do not train are not in {source.name_or_path} under the names the export "
            f"would carry them from (e.g. {absent[:3]}): the model's names and its checkpoint's differ. Load the "
            "model from the checkpoint it was saved as (its config.json and weights together)"
        )
    pattern = _ignored_on_load(model)
    unloaded: list[str] = []
    lost: list[str] = []
    for name in files:
        if name in written or name in tied_names:
            continue
        (unloaded if pattern is not None and pattern.search(name) else lost).append(name)
    reward = config is not None and auto_class_name(config) == "AutoModelForSequenceClassification"
    if lost and not reward:
        raise ExportError(
            f"the export would lack {len(lost)} of the {len(files)} tensors of {source.name_or_path} (e.g. "
            f"{lost[:5]}): the model as loaded holds no tensor under those names and its class does not declare "
            "them ignorable. The checkpoint's names and the model's differ (another layout of this family, or "
            "a class that loads only part of it); load it with the class its config.json names"
        )
    carried = [n for n in files if n in frozen_names or n in unloaded]
    return Carried(
        source=source,
        tensors=locate(source, carried, files),
        frozen={n: frozen_names[n] for n in carried if n in frozen_names},
        unloaded=unloaded,
        left_out=lost,
        source_names=list(files),
        tied=frozenset(tied_names),
    )


def make_plan(
    model: torch.nn.Module, dtype: str, max_shard_bytes: int, *, source: ExportSource | None = None
) -> ExportPlan:
    """This rank's tensors to write and the layout of the files (no communication).

    Args:
        model: the (sharded) model.
        dtype: the export dtype (:func:`resolve_dtype`).
        max_shard_bytes: largest file.
        source: the checkpoint the model was loaded from: the parameters that do not train and the tensors the
            class does not load are carried from its files byte for byte, and the export must hold every one of
            its tensors (:func:`plan_carried`); None: every tensor from the shards, no such check.

    Raises:
        ExportError: nothing to export, a dtype safetensors cannot hold, a checkpoint format the export
            cannot write shard by shard, or (``source``) a tensor of the source the export would lack.
        ValueError: an unknown ``dtype``.
    """
    # FP8 runs: the master weights without torchao's float8-cast wrapper (the export is never float8).
    everything = {
        k: without_float8_wrapper(v)
        for k, v in get_model_state_dict(model).items()
        if isinstance(v, torch.Tensor)
    }
    skip = tied_targets(model)
    raw = {k: v for k, v in everything.items() if k not in skip}
    if not raw:
        raise ExportError("nothing to export: the model has no tensors")
    torch_dtype = resolve_dtype(dtype)
    module_shapes = {k: tuple(v.shape) for k, v in raw.items()}  # DTensor.shape is the global shape
    layout = checkpoint_layout(model, module_shapes)
    carried = None
    if source is not None:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad and n in raw}
        tied = {k: tuple(v.shape) for k, v in everything.items() if k in skip}
        carried = plan_carried(model, layout, frozen=frozen, tied=tied, source=source)
    frozen_modules = set(carried.frozen.values()) if carried is not None else set()
    trained = {k: v for k, v in module_shapes.items() if k not in frozen_modules}
    shapes = layout.shapes(trained)
    module_of = {k: m for k, m in layout.module_of().items() if k in shapes}
    sources = {layout.renames[k]: v for k, v in raw.items() if k in layout.renames and k in trained}
    expert_sources = {k: v for k, v in raw.items() if k in layout.splits and k in trained}
    dtypes = {}
    for key in shapes:
        value = raw[module_of[key]]
        dtypes[key] = torch_dtype if torch_dtype is not None and value.is_floating_point() else value.dtype
    unsupported = sorted({str(d) for d in dtypes.values() if not is_supported(d)})
    if unsupported:
        raise ExportError(f"tensors of dtype {unsupported} cannot be written as safetensors here")
    floating = [d for d in dtypes.values() if d.is_floating_point]
    for key, tensor in (carried.tensors if carried is not None else {}).items():
        shapes[key], dtypes[key] = tensor.shape, dtype_of_code(tensor.dtype)
    sizes = {k: nbytes(shapes[k], dtypes[k]) for k in shapes}
    files = plan_files(sizes, max_shard_bytes)
    # config.json states the dtype of what trained (a carried tower in fp32 does not make a bf16 export fp32).
    floating = floating or [d for d in dtypes.values() if d.is_floating_point]
    weights_dtype = torch_dtype or (max(set(floating), key=floating.count) if floating else torch.float32)
    return ExportPlan(
        sources=sources,
        expert_sources=expert_sources,
        layout=layout,
        module_names=module_of,
        shapes=shapes,
        dtypes=dtypes,
        files=files,
        names=file_names(len(files)),
        weights_dtype=weights_dtype,
        model=model,
        carried=carried,
    )


def check_whole_export(
    model: torch.nn.Module, source: ExportSource
) -> tuple[CheckpointLayout, Carried | None]:
    """At start-up, before any training: the export's layout (names, per-expert splits) and what it will carry from
    ``source``, on the unsharded model: a checkpoint tensor the export would lack is refused now, not after the run.

    Raises:
        ExportError: as :func:`checkpoint_layout` and :func:`plan_carried`.
    """
    state = model.state_dict()
    skip = tied_targets(model)
    shapes = {k: tuple(v.shape) for k, v in state.items() if k not in skip}
    layout = checkpoint_layout(model, shapes)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad and n in shapes}
    tied = {k: tuple(v.shape) for k, v in state.items() if k in skip}
    return layout, plan_carried(model, layout, frozen=frozen, tied=tied, source=source)


def export_config(
    config: PretrainedConfig, weights_dtype: torch.dtype, architecture: str
) -> PretrainedConfig:
    """The config.json an export writes: the live config with the weights' dtype, the KV cache on for
    inference, and the architecture that loads it."""
    out = config.__class__.from_dict(config.to_dict())
    out.dtype = weights_dtype
    out.use_cache = True
    # A composite's text and vision configs state the dtype too (from_pretrained(dtype=...) sets it on each), and
    # its language model reads use_cache from the text config.
    for key in getattr(out, "sub_configs", None) or {}:
        sub = getattr(out, key, None)
        if isinstance(sub, PretrainedConfig):
            sub.dtype = weights_dtype
            if "use_cache" in sub.to_dict():
                sub.use_cache = True
    out.architectures = [architecture]
    return out
