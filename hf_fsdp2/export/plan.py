"""The export plan: what every rank writes (names, global shapes, dtypes, files), decided without communication.

Below both the writer (:mod:`.writer`) and the verification (:mod:`.verify`), which read the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate
from transformers import PretrainedConfig

from hf_fsdp2.dtypes import dtype_named
from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.export.files import file_names, is_supported, nbytes, plan_files
from hf_fsdp2.export.naming import CheckpointLayout, checkpoint_layout, split_local_experts, tied_targets
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


@dataclass(kw_only=True)
class ExportPlan:
    """Everything every rank agrees on before writing: names, global shapes, dtypes, files.

    ``sources`` holds this rank's own data: checkpoint name -> its (sharded) tensor as trained; fused
    expert tensors are in ``expert_sources`` (module name -> sharded tensor) and become their checkpoint
    tensors only when written (:meth:`local_experts`).
    """

    sources: dict[str, torch.Tensor]
    expert_sources: dict[str, torch.Tensor]
    layout: CheckpointLayout
    module_names: dict[str, str]  # checkpoint name -> module name
    shapes: dict[str, tuple[int, ...]]  # checkpoint name -> global shape
    dtypes: dict[str, torch.dtype]  # checkpoint name -> export dtype
    files: list[list[str]]
    names: list[str]
    weights_dtype: torch.dtype  # the dtype config.json states
    model: torch.nn.Module

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(self.shapes[k], self.dtypes[k]) for k in self.shapes)

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


def make_plan(model: torch.nn.Module, dtype: str, max_shard_bytes: int) -> ExportPlan:
    """This rank's tensors to write and the layout of the files (no communication).

    Raises:
        ExportError: nothing to export, a dtype safetensors cannot hold, or a checkpoint format the export
            cannot write shard by shard.
        ValueError: an unknown ``dtype``.
    """
    # FP8 runs: the master weights without torchao's float8-cast wrapper (the export is never float8).
    raw = {
        k: without_float8_wrapper(v)
        for k, v in get_model_state_dict(model).items()
        if isinstance(v, torch.Tensor)
    }
    skip = tied_targets(model)
    raw = {k: v for k, v in raw.items() if k not in skip}
    if not raw:
        raise ExportError("nothing to export: the model has no tensors")
    torch_dtype = resolve_dtype(dtype)
    module_shapes = {k: tuple(v.shape) for k, v in raw.items()}  # DTensor.shape is the global shape
    layout = checkpoint_layout(model, module_shapes)
    shapes = layout.shapes(module_shapes)
    module_of = layout.module_of()
    sources = {layout.renames[k]: v for k, v in raw.items() if k in layout.renames}
    expert_sources = {k: v for k, v in raw.items() if k in layout.splits}
    dtypes = {}
    for key in shapes:
        trained = raw[module_of[key]]
        dtypes[key] = (
            torch_dtype if torch_dtype is not None and trained.is_floating_point() else trained.dtype
        )
    unsupported = sorted({str(d) for d in dtypes.values() if not is_supported(d)})
    if unsupported:
        raise ExportError(f"tensors of dtype {unsupported} cannot be written as safetensors here")
    sizes = {k: nbytes(shapes[k], dtypes[k]) for k in shapes}
    files = plan_files(sizes, max_shard_bytes)
    floating = [d for d in dtypes.values() if d.is_floating_point]
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
    )


def export_config(
    config: PretrainedConfig, weights_dtype: torch.dtype, architecture: str
) -> PretrainedConfig:
    """The config.json an export writes: the live config with the weights' dtype, the KV cache on for
    inference, and the architecture that loads it."""
    out = config.__class__.from_dict(config.to_dict())
    out.dtype = weights_dtype
    out.use_cache = True
    out.architectures = [architecture]
    return out
