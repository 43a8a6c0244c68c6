"""The consolidated HF folder: written by every rank (no rank gathers the model), verified, published.

``config.json``, ``generation_config.json``, tokenizer files (chat template included), ``README.md``
(model card) and ``model.safetensors`` or ``model-0000x-of-0000y.safetensors`` +
``model.safetensors.index.json`` that ``AutoModelForCausalLM.from_pretrained(dir)`` loads without
hf_fsdp2.

How no rank ever holds the whole model (every rank takes part in :func:`export_model`):

1. each rank takes its own shards of the parameters (``get_model_state_dict``, no all-gather), casts
   them to the export dtype and renames them to the names the checkpoint format uses;
2. ``torch.distributed.checkpoint.save`` with ``HuggingFaceStorageWriter(save_distributed=True)``:
   each rank writes its shards as safetensors part files, tagged with their offsets;
3. each rank assembles some of the final ``model-*.safetensors`` files from the part files on disk
   (file ``i`` by rank ``i % world``), copying one shard's bytes at a time;
4. verification (:func:`verify_export`): file headers (keys, shapes, dtypes), every rank reads its
   own shards back and compares them bit for bit, and a fresh Python process loads the folder with
   plain transformers and computes logits on a probe batch that must match the live model's.

Files are written to ``<out>/.export-incomplete`` and moved into place only once all of them are
complete and verified, the index (or the single weights file) last, so a crash or a failed
verification never leaves a folder that looks loadable but is not. A shared file system is assumed
across nodes, as for checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.generation import GenerationConfig

logger = logging.getLogger("hf_fsdp2")

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
STAGE_NAME = ".export-incomplete"
PARTS_NAME = ".parts"
MODEL_CARD_NAME = "README.md"

# safetensors dtype codes and element sizes.
_ST_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_SIZES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_COPY_BYTES = 16 * 2**20  # bytes copied at a time when assembling a file
PART_BYTES = 256 * 2**20  # per rank and DCP save: bounds the writer's host memory (see _write_weights)
RELOAD_RAM_BYTES = 2 * 2**30  # weights the verification's reload keeps in RAM; the rest stream from disk
# Module-name fragments of wrappers that state_dict() hides (activation checkpointing, compile, FSDP1).
_WRAPPER_FRAGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

T = TypeVar("T")


class ExportError(RuntimeError):
    """An export that cannot be written; the message says why and what to do."""


class ExportVerificationError(ExportError):
    """The written folder does not reproduce the live model (keys, shapes, dtypes, values or logits)."""


@dataclass
class VerifyReport:
    """What :func:`verify_export` checked, and what it found wrong (empty ``problems`` = verified)."""

    tensors: int = 0
    bytes_compared: int = 0
    max_logit_diff: float = float("nan")
    atol: float = 0.0
    reload_dtype: str = ""
    reload_devices: list[str] = field(default_factory=list)  # ["cpu"], or ["cpu", "disk"] when streamed
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if not self.ok:
            return "FAILED: " + "; ".join(self.problems)
        return (
            f"verified: {self.tensors} tensors bit-exact ({self.bytes_compared / 1e6:.1f} MB read back by the "
            f"ranks that own them); reloaded with transformers in {self.reload_dtype} (weights on "
            f"{'+'.join(self.reload_devices)}), probe logits max |diff| "
            f"{self.max_logit_diff:.3g} <= atol {self.atol:.3g}"
        )


@dataclass
class ExportResult:
    """The published folder: its weight files, their total size and dtype, and the verification."""

    out_dir: Path
    files: list[str]
    total_bytes: int
    dtype: str
    seconds: float
    verify: VerifyReport | None


# ---------------------------------------------------------------------------------------------------
# Rank helpers: every phase ends with all ranks agreeing, so one rank's failure never hangs the others
# ---------------------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _agree(phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails on any rank, raise ExportError on every rank.

    Collective: every rank calls it with the same ``phase``.
    """
    result: Any = None
    error: str | None = None
    try:
        result = fn()
    except ExportVerificationError:
        raise  # raised on every rank by verify_export itself
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = f"{type(err).__name__}: {err}"
        logger.debug("export phase %s failed on rank %d", phase, _rank(), exc_info=True)
    errors: list[str | None] = [error]
    if dist.is_initialized():
        errors = [None] * _world()
        dist.all_gather_object(errors, error)  # every rank
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ExportError(f"export failed while {phase} (rank {rank}): {message}")
    return result  # type: ignore[no-any-return]


@contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP warns on every single-process save/load; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


# ---------------------------------------------------------------------------------------------------
# What is written: names, tied weights, dtype, the split into files
# ---------------------------------------------------------------------------------------------------


def clean_name(name: str) -> str:
    """A parameter name without the wrapper fragments that ``state_dict()`` hides."""
    for fragment in _WRAPPER_FRAGMENTS:
        name = name.replace(fragment, "")
    return name


def tied_targets(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are the very same tensor as an earlier one (tied embeddings).

    from_pretrained re-ties them from the config, so they are not written; the one kept is the
    source transformers declares (``all_tied_weights_keys``: target -> source), else the first.
    """
    declared: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(clean_name(name))
    drop: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        keep = [n for n in names if n not in declared] or names[:1]
        drop.update(n for n in names if n != keep[0])
    return drop


def checkpoint_names(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Map each module name to the name the model's checkpoint format uses (as ``save_pretrained`` does).

    Some architectures name weights differently on disk (GPT-NeoX: ``embed_out`` for ``lm_head``):
    transformers renames them on load and back on save. The renaming is computed on meta tensors.

    Args:
        model: the live model (its ``_weight_conversions`` from from_pretrained, else its class's).
        shapes: module name -> global shape of every tensor to write.

    Returns:
        module name -> checkpoint name (identity for most models).

    Raises:
        ExportError: the format needs a conversion other than a renaming (merged or split tensors),
            which a gather-free export does not do.
    """
    from transformers.core_model_loading import revert_weight_conversion

    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    by_id = {id(t): k for k, t in meta.items()}
    target: Any = model
    if getattr(model, "_weight_conversions", None) is None:
        # FSDP2's class is FSDP<Name>, which transformers' per-class lookup would miss.
        target = _meta_twin(model)
    reverted = revert_weight_conversion(target, dict(meta))
    names: dict[str, str] = {}
    for new_name, tensor in reverted.items():
        old = by_id.get(id(tensor))
        if old is None:
            raise ExportError(
                f"{type(model).__name__}'s checkpoint format needs a weight conversion that is not a renaming "
                f"(it produces {new_name!r}); the gather-free export writes tensors as they are sharded. "
                "Export with transformers' save_pretrained on a single process instead"
            )
        names[old] = new_name
    missing = set(shapes) - set(names)
    if missing:
        raise ExportError(f"the checkpoint-name mapping lost tensors {sorted(missing)[:5]}")
    return names


def _meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture built on the meta device from the model's config (no memory)."""
    from transformers import AutoModelForCausalLM

    config = getattr(model, "config", None)
    if config is None:
        return model
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError):  # remote code: transformers then goes by model_type
        return model


def resolve_dtype(dtype: str, state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The torch dtype of ``export_dtype``; None for ``training`` (each tensor keeps its own dtype).

    Raises:
        ValueError: an unknown name.
    """
    if dtype == "training":
        return None
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES) + ['training']}")
    return EXPORT_DTYPES[dtype]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * _ST_SIZES[_ST_CODES[dtype]]


def plan_files(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split tensors, in order, into files of at most ``max_shard_bytes`` (a larger tensor gets its own).

    Args:
        sizes: tensor name -> bytes, in the order they are written.
        max_shard_bytes: largest file size.

    Returns:
        The tensor names of each file.
    """
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def file_names(count: int) -> list[str]:
    """``model.safetensors`` for one file, ``model-0000i-of-0000n.safetensors`` for more."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclass
class _Plan:
    """Everything every rank agrees on before writing: names, global shapes, dtypes, files."""

    sources: dict[str, torch.Tensor]  # checkpoint name -> this rank's (sharded) tensor, as trained
    module_names: dict[str, str]  # checkpoint name -> module name
    shapes: dict[str, tuple[int, ...]]  # checkpoint name -> global shape
    dtypes: dict[str, torch.dtype]  # checkpoint name -> export dtype
    files: list[list[str]]
    names: list[str]
    weights_dtype: torch.dtype  # the dtype config.json states

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(self.shapes[k], self.dtypes[k]) for k in self.shapes)

    def cast(self, key: str) -> torch.Tensor:
        """This rank's shard of ``key`` in the export dtype (a copy only when the dtype changes)."""
        return self.sources[key].detach().to(self.dtypes[key])


def _plan(model: torch.nn.Module, dtype: str, max_shard_bytes: int) -> _Plan:
    """This rank's tensors to write and the layout of the files (no communication)."""
    raw = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    skip = tied_targets(model)
    raw = {k: v for k, v in raw.items() if k not in skip}
    if not raw:
        raise ExportError("nothing to export: the model has no tensors")
    torch_dtype = resolve_dtype(dtype, raw)
    shapes = {k: tuple(v.shape) for k, v in raw.items()}  # DTensor.shape is the global shape
    names = checkpoint_names(model, shapes)
    sources = {names[k]: v for k, v in raw.items()}
    dtypes = {
        k: torch_dtype if torch_dtype is not None and v.is_floating_point() else v.dtype
        for k, v in sources.items()
    }
    unsupported = sorted({str(d) for d in dtypes.values() if d not in _ST_CODES})
    if unsupported:
        raise ExportError(f"tensors of dtype {unsupported} cannot be written as safetensors here")
    ckpt_shapes = {names[k]: s for k, s in shapes.items()}
    sizes = {k: _nbytes(ckpt_shapes[k], dtypes[k]) for k in sources}
    files = plan_files(sizes, max_shard_bytes)
    floating = [d for d in dtypes.values() if d.is_floating_point]
    weights_dtype = torch_dtype or (max(set(floating), key=floating.count) if floating else torch.float32)
    return _Plan(
        sources=sources,
        module_names={v: k for k, v in names.items()},
        shapes=ckpt_shapes,
        dtypes=dtypes,
        files=files,
        names=file_names(len(files)),
        weights_dtype=weights_dtype,
    )


# ---------------------------------------------------------------------------------------------------
# Writing: per-rank parts with DCP, then each rank assembles some of the final files
# ---------------------------------------------------------------------------------------------------


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the byte offset where its data starts."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ExportError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > 100 * 2**20:
            raise ExportError(f"{path} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(f"{path} has a corrupt safetensors header: {err}") from err
    return header, 8 + n


@dataclass
class _Chunk:
    path: Path
    start: int  # absolute byte offset of the chunk's data in its part file
    offsets: list[int]
    shape: list[int]
    dtype: str


def _index_parts(parts_dir: Path) -> dict[str, list[_Chunk]]:
    """Every chunk of every tensor in the part files that DCP's HuggingFaceStorageWriter wrote."""
    chunks: dict[str, list[_Chunk]] = {}
    for path in sorted(parts_dir.glob("*.safetensors")):
        header, data_start = _read_header(path)
        meta = header.get("__metadata__", {})
        info = json.loads(meta.get("DCP_SHARDING_INFO", "{}"))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            offsets = info.get(key, {}).get("saved_offsets", [0] * len(entry["shape"]))
            chunks.setdefault(key, []).append(
                _Chunk(path, data_start + entry["data_offsets"][0], offsets, entry["shape"], entry["dtype"])
            )
    return chunks


def _header_bytes(entries: dict[str, Any]) -> bytes:
    """A safetensors header, space-padded to a multiple of 8 bytes as safetensors itself writes it."""
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _copy_range(src: Path, start: int, length: int, dst: Any) -> None:
    with open(src, "rb") as fh:
        fh.seek(start)
        while length > 0:
            block = fh.read(min(length, _COPY_BYTES))
            if not block:
                raise ExportError(f"{src} is shorter than its header says")
            dst.write(block)
            length -= len(block)


def _write_tensor(name: str, shape: tuple[int, ...], code: str, chunks: list[_Chunk], dst: Any) -> None:
    """Write one full tensor's bytes from its chunks: streamed when the chunks are row blocks."""
    size = _ST_SIZES[code]
    numel = 1
    for s in shape:
        numel *= s
    have = 0
    for c in chunks:
        n = 1
        for s in c.shape:
            n *= s
        have += n
        if c.dtype != code:
            raise ExportError(f"{name}: a part file holds it as {c.dtype}, expected {code}")
    if have != numel:
        raise ExportError(
            f"{name}: the part files hold {have} of its {numel} elements; a rank did not write its shard"
        )
    rows = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
    row_blocks = all(list(c.shape[1:]) == list(shape[1:]) and not any(c.offsets[1:]) for c in rows)
    if row_blocks:  # FSDP2's dim-0 shards: each chunk is a contiguous byte range of the tensor
        expected_row = 0
        for c in rows:
            if c.offsets and c.offsets[0] != expected_row:
                raise ExportError(
                    f"{name}: shards do not tile the tensor (row {c.offsets[0]}, expected {expected_row})"
                )
            n = 1
            for s in c.shape:
                n *= s
            _copy_range(c.path, c.start, n * size, dst)
            expected_row += c.shape[0] if c.shape else 1
        return
    # Other placements (e.g. column shards of tensor parallelism): assemble this one tensor in memory.
    dtype = next(d for d, k in _ST_CODES.items() if k == code)
    full = torch.empty(shape, dtype=dtype)
    for c in rows:
        n = 1
        for s in c.shape:
            n *= s
        with open(c.path, "rb") as fh:
            fh.seek(c.start)
            data = bytearray(fh.read(n * size))
        part = (
            torch.frombuffer(data, dtype=dtype).reshape(c.shape) if n else torch.empty(c.shape, dtype=dtype)
        )
        full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape, strict=True))] = part
    dst.write(full.contiguous().view(torch.uint8).numpy().tobytes())


def assemble_file(
    path: Path,
    keys: list[str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    chunks: dict[str, list[_Chunk]],
) -> None:
    """Write one final safetensors file from the part files' chunks (format metadata ``pt``)."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in keys:
        code = _ST_CODES[dtypes[k]]
        n = _nbytes(shapes[k], dtypes[k])
        entries[k] = {"dtype": code, "shape": list(shapes[k]), "data_offsets": [offset, offset + n]}
        offset += n
    with open(path, "wb") as dst:
        dst.write(_header_bytes(entries))
        for k in keys:
            if k not in chunks:
                raise ExportError(f"{k} is in no part file; a rank did not write its shard")
            _write_tensor(k, shapes[k], _ST_CODES[dtypes[k]], chunks[k], dst)


def _write_weights(plan: _Plan, stage: Path) -> None:
    """Every rank: write its shards as part files (DCP), then assemble files i with i % world == rank.

    The shards go out in groups of about ``PART_BYTES`` per rank, one ``dcp.save`` each: DCP's
    safetensors writer builds each part file in memory, and a group is cast to the export dtype only
    when it is written, so the extra host memory of a rank stays near 2 x PART_BYTES whatever the
    model size (a single larger tensor shard is its own group).
    """
    parts = stage / PARTS_NAME
    sizes = {k: _nbytes(plan.shapes[k], plan.dtypes[k]) for k in plan.shapes}
    for index, keys in enumerate(plan_files(sizes, PART_BYTES * _world()), start=1):

        def cast(keys: list[str] = keys) -> dict[str, torch.Tensor]:
            return {k: plan.cast(k) for k in keys}

        group = _agree(f"casting part {index}", cast)
        writer = HuggingFaceStorageWriter(
            path=str(parts), fqn_to_index_mapping=dict.fromkeys(keys, index), save_distributed=True
        )

        def save(group: dict[str, torch.Tensor] = group, writer: HuggingFaceStorageWriter = writer) -> None:
            with _single_process_dcp():  # collective: every rank writes its own shards of the group
                dcp.save(group, storage_writer=writer, no_dist=not dist.is_initialized())

        _agree(f"writing part {index} of each rank's shards", save)
        del group

    def assemble() -> None:
        chunks = _index_parts(parts)
        for i, (name, keys) in enumerate(zip(plan.names, plan.files, strict=True)):
            if i % _world() == _rank():
                assemble_file(stage / name, keys, plan.shapes, plan.dtypes, chunks)

    _agree("assembling the safetensors files", assemble)


def _write_metadata(
    plan: _Plan,
    stage: Path,
    *,
    config: PretrainedConfig,
    architecture: str,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    model_card: str | None,
) -> None:
    """Rank 0: index, config (dtype and inference defaults), generation config, tokenizer, card."""
    shutil.rmtree(stage / PARTS_NAME, ignore_errors=True)
    if len(plan.files) > 1:
        weight_map = {k: name for name, keys in zip(plan.names, plan.files, strict=True) for k in keys}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = config.__class__.from_dict(config.to_dict())
    config.dtype = plan.weights_dtype
    config.use_cache = True
    config.architectures = [architecture]
    config.save_pretrained(stage)
    gen = generation_config or GenerationConfig.from_model_config(config)
    gen.save_pretrained(stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    if model_card is not None:
        (stage / MODEL_CARD_NAME).write_text(model_card)


def _publish(stage: Path, out: Path, names: list[str]) -> None:
    """Rank 0: move the staged files into ``out``; the file from_pretrained opens first goes last."""
    first = INDEX_NAME if len(names) > 1 else WEIGHTS_NAME
    # The old entry points go first, so the folder never points at a mix of old and new shards.
    for old in (out / INDEX_NAME, out / WEIGHTS_NAME):
        if old.exists():
            old.unlink()
    for old in out.glob("model*.safetensors"):
        if old.name not in names:
            old.unlink()
    for item in sorted(stage.iterdir(), key=lambda p: p.name == first):
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    stage.rmdir()


def check_export_dir(out_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse to export into a folder that holds anything, unless asked to overwrite.

    Raises:
        ExportError: the path is a file, or a non-empty folder and ``overwrite`` is off.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder; choose another OUT_DIR")
    if out.is_dir() and any(p.name != STAGE_NAME for p in out.iterdir()) and not overwrite:
        found = sorted(p.name for p in out.iterdir())[:5]
        raise ExportError(
            f"{out} is not empty ({', '.join(found)}, ...); choose an empty or new OUT_DIR, or pass --overwrite "
            "to replace the export files in it"
        )


def export_model(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    dtype: str,
    max_shard_bytes: int,
    model_card: str | None = None,
    verify: bool = True,
    verify_atol: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> ExportResult:
    """Write, verify and publish the consolidated HF folder of a (sharded) model; no rank gathers it.

    Every rank must call it (collective); a failure on any rank raises on every rank.

    Args:
        model: the FSDP2-sharded model (or a plain one in a single process).
        out_dir: the folder; export files already there are replaced, other files are kept.
        config: model config; config.json states the export dtype and ``use_cache: true``.
        tokenizer: saved alongside (chat template included) when given.
        generation_config: saved as generation_config.json (derived from the config when None).
        dtype: ``bfloat16``, ``float32``, ``float16`` or ``training`` (the dtype the weights have).
        max_shard_bytes: largest safetensors file (a single larger tensor gets its own file).
        model_card: README.md text (see ``hf_fsdp2.hub.render_model_card``), or None for none.
        verify: check the folder before publishing it (see :func:`verify_export`).
        verify_atol: largest probe-logit difference accepted; None picks one for the dtypes.
        compute_dtype: dtype the live model computes in (bf16 under mixed precision); None = its weights'.

    Returns:
        The published folder's description (the same on every rank).

    Raises:
        ExportError: writing failed (the previous export, if any, is left as it was).
        ExportVerificationError: the written folder does not reproduce the model; nothing is published.
        ValueError: an unknown dtype.
    """
    start = time.perf_counter()
    out = Path(out_dir)
    stage = out / STAGE_NAME
    plan = _agree("planning the files", lambda: _plan(model, dtype, max_shard_bytes))

    def prepare() -> None:
        if _rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            if stage.exists():
                shutil.rmtree(stage)
            stage.mkdir()

    _agree("preparing the staging folder", prepare)
    _write_weights(plan, stage)
    architecture = type(model).__name__.removeprefix("FSDP")

    def metadata() -> None:
        if _rank() == 0:
            _write_metadata(
                plan,
                stage,
                config=config,
                architecture=architecture,
                tokenizer=tokenizer,
                generation_config=generation_config,
                model_card=model_card,
            )

    _agree("writing config, tokenizer and index", metadata)
    report = None
    if verify:
        try:
            report = verify_export(model, stage, plan=plan, atol=verify_atol, compute_dtype=compute_dtype)
        except ExportVerificationError as err:
            raise ExportVerificationError(
                f"{err}. Nothing was published: {out} is as it was; the rejected files are kept in {stage}"
            ) from None
        logger.info("export %s", report.summary())
    _agree("publishing", lambda: _publish(stage, out, plan.names) if _rank() == 0 else None)
    seconds = time.perf_counter() - start
    logger.info(
        "exported %d file(s), %.1f MB in %s, to %s in %.1fs",
        len(plan.names),
        plan.total_bytes / 1e6,
        str(plan.weights_dtype).removeprefix("torch."),
        out,
        seconds,
    )
    return ExportResult(
        out_dir=out,
        files=plan.names,
        total_bytes=plan.total_bytes,
        dtype=str(plan.weights_dtype).removeprefix("torch."),
        seconds=seconds,
        verify=report,
    )


# ---------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------

# Runs in a fresh interpreter: plain transformers, no hf_fsdp2, as a user would load the folder.
_RELOAD = r"""
import sys, torch
from transformers import AutoModelForCausalLM
folder, dtype, probe, out, ram, offload = sys.argv[1:7]
kwargs = dict(device_map="auto", max_memory={"cpu": int(ram)}, offload_folder=offload)
model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), output_loading_info=True, **kwargs)
model.eval()
ids = torch.load(probe)
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
head, emb = model.get_output_embeddings(), model.get_input_embeddings()
torch.save({
    "logits": logits,
    "problems": {k: sorted(str(x) for x in v) for k, v in info.items() if v},
    "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
    "tied": head is not None and head.weight is emb.weight,
    "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules),
    "devices": sorted(set(map(str, (getattr(model, "hf_device_map", None) or {"": "cpu"}).values()))),
}, out)
"""


def default_atol(export_dtype: torch.dtype, compute_dtype: torch.dtype, logit_scale: float) -> float:
    """Probe-logit tolerance, relative to the largest live logit (``logit_scale``, at least 1).

    The reload computes in ``compute_dtype`` on CPU. When the export dtype is at least as precise,
    reloaded and live weights are bit-identical and only kernels differ (another device, another
    summation order): 0.1% of the logit scale in fp32, 2% in bf16/fp16. When the export rounds the
    weights the model computed with (a bf16 export of an fp32 run), that rounding shows too: 5%.
    Measured on SmolLM2-135M (logits up to ~35): bf16 rounding of fp32 weights moves logits by 0.55;
    doubling rope_theta by 2.4. The bytes themselves are compared exactly elsewhere.
    """
    scale = max(1.0, logit_scale)
    if export_dtype == compute_dtype or export_dtype == torch.float32:
        return (1e-3 if compute_dtype == torch.float32 else 2e-2) * scale
    return 5e-2 * scale


def _probe_ids(vocab_size: int) -> torch.Tensor:
    """A fixed probe batch: 2 x 16 token ids drawn with a fixed seed (the same on every rank)."""
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1234))


def _live_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The live model's logits on ``ids`` (every rank: FSDP2's forward gathers one layer at a time)."""
    was_training = model.training
    model.eval()
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with torch.no_grad():
            out = model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device))
        logits = out.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits.detach().float().cpu()
    finally:
        model.train(was_training)


def _reload_in_subprocess(
    folder: Path, dtype: torch.dtype, ids: torch.Tensor, ram_bytes: int, offload: Path
) -> dict[str, Any]:
    """Load ``folder`` with plain transformers in a fresh CPU process; return its logits and findings.

    Weights beyond ``ram_bytes`` stay on disk (accelerate's offload, under ``offload``), so the
    reload never holds a large model in memory; it only streams it through the probe's forward.
    """
    with tempfile.TemporaryDirectory(prefix="hf_fsdp2-verify-") as tmp:
        probe, out = Path(tmp) / "probe.pt", Path(tmp) / "out.pt"
        torch.save(ids, probe)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
        args = [
            str(folder),
            str(dtype).removeprefix("torch."),
            str(probe),
            str(out),
            str(ram_bytes),
            str(offload),
        ]
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _RELOAD, *args], capture_output=True, text=True, env=env, check=False
            )
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"from_pretrained in a fresh process failed: {' | '.join(tail)}"}
        return dict(torch.load(out))


def _local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of ``tensor`` and where it sits in the full tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, s) for s in tensor.shape)
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()  # the chunk DCP writes for this rank (one per placement)
    if len(chunks) != 1:
        raise ExportError(f"a DTensor with {len(chunks)} local chunks cannot be read back here")
    offsets = chunks[0].offsets
    return local, tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))


def _read_slice(
    path: Path, header: dict[str, Any], data_start: int, key: str, where: tuple[slice, ...]
) -> torch.Tensor:
    """The ``where`` part of tensor ``key`` from a safetensors file.

    Rows (FSDP2's dim-0 shards) are one byte range, read with a plain read, so the file's pages are
    not mapped into the process; other slices go through safetensors.
    """
    entry = header[key]
    shape, code = entry["shape"], entry["dtype"]
    dtype = next(d for d, c in _ST_CODES.items() if c == code)
    if shape and all(sl.start == 0 and sl.stop == n for sl, n in zip(where[1:], shape[1:], strict=True)):
        row = _ST_SIZES[code]
        for n in shape[1:]:
            row *= n
        start = data_start + entry["data_offsets"][0] + where[0].start * row
        with open(path, "rb") as fh:
            fh.seek(start)
            data = bytearray(fh.read((where[0].stop - where[0].start) * row))
        return torch.frombuffer(data, dtype=dtype).reshape([where[0].stop - where[0].start, *shape[1:]])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_slice(key)[where] if shape else f.get_tensor(key)


def _readback(plan: _Plan, folder: Path) -> tuple[int, int, list[str]]:
    """Every rank: read its own slices back from the final files, one tensor at a time, and compare
    them bit for bit with its shards in the export dtype (no rank reads more than it owns)."""
    problems: list[str] = []
    nbytes = 0
    for name, keys in zip(plan.names, plan.files, strict=True):
        header, data_start = _read_header(folder / name)
        for k in keys:
            want, where = _local_slices(plan.cast(k))
            if want.numel() == 0:
                continue
            got = _read_slice(folder / name, header, data_start, k, where)
            nbytes += want.numel() * want.element_size()
            if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else "?"
                problems.append(
                    f"{k}: the bytes on disk differ from the model's (max |diff| {diff}) on rank {_rank()}"
                )
    return len(plan.shapes), nbytes, problems


def _check_headers(plan: _Plan, folder: Path) -> list[str]:
    """Key set, shapes and dtypes of every file against the plan (headers only; cheap)."""
    problems: list[str] = []
    found: dict[str, tuple[list[int], str, str]] = {}
    for name in plan.names:
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        try:
            header, data_start = _read_header(path)
        except ExportError as err:
            problems.append(str(err))
            continue
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if path.stat().st_size != data_start + end:
            problems.append(f"{name} is {path.stat().st_size} bytes, its header says {data_start + end}")
        for k, v in header.items():
            if k != "__metadata__":
                found[k] = (v["shape"], v["dtype"], name)
    if len(plan.names) > 1:
        try:
            weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            problems.append(f"{INDEX_NAME} is missing or unreadable ({err})")
        else:
            wrong = sorted(k for k in found if weight_map.get(k) != found[k][2])
            if wrong or set(weight_map) != set(found):
                problems.append(
                    f"{INDEX_NAME} does not match the files (e.g. {(wrong or sorted(set(weight_map) ^ set(found)))[:3]})"
                )
    missing, extra = sorted(set(plan.shapes) - set(found)), sorted(set(found) - set(plan.shapes))
    if missing:
        problems.append(f"tensors missing from the files: {missing[:5]}")
    if extra:
        problems.append(f"unexpected tensors in the files: {extra[:5]}")
    for k in sorted(set(found) & set(plan.shapes)):
        shape, code, _ = found[k]
        if tuple(shape) != plan.shapes[k] or code != _ST_CODES[plan.dtypes[k]]:
            problems.append(
                f"{k}: file says {code}{shape}, the model has {_ST_CODES[plan.dtypes[k]]}{list(plan.shapes[k])}"
            )
    return problems


def verify_export(
    model: torch.nn.Module,
    folder: str | Path,
    *,
    plan: _Plan | None = None,
    dtype: str = "bfloat16",
    atol: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reload_ram_bytes: int = RELOAD_RAM_BYTES,
) -> VerifyReport:
    """Check an exported folder against the live model; raise on any mismatch.

    Every rank must call it (collective). Checks, in order of cost:

    1. headers: every expected tensor is in a file, with its global shape and the export dtype; no
       extra tensor; the index maps each tensor to the file that holds it; file sizes add up;
    2. values: each rank reads back, one tensor at a time, the slices of the files it owns and
       compares them bit for bit with its shards cast to the export dtype (no rank reads the model);
    3. reload: rank 0 loads the folder in a fresh Python process with plain transformers (no missing,
       unexpected or mismatched keys; the same tensor names and shapes as the live model; tied
       embeddings tied) and computes logits on a fixed probe batch, on CPU in ``compute_dtype``,
       which must be within ``atol`` of the live model's (computed by all ranks). That process keeps
       at most ``reload_ram_bytes`` of weights in memory; the rest stays on disk and streams through
       the forward (accelerate's offload, next to the folder), so no process holds a large model.

    Args:
        model: the live model the folder was exported from.
        folder: the exported (or staged) folder.
        plan: the export's plan (from :func:`export_model`); rebuilt from ``dtype`` when None.
        dtype: the export dtype, used when ``plan`` is None.
        atol: largest probe-logit difference accepted; None = :func:`default_atol`.
        compute_dtype: dtype the live model computes in; None = its weights' dtype.
        reload_ram_bytes: weights the reload keeps in memory.

    Returns:
        The report (``ok`` is true: a failed check raises).

    Raises:
        ExportVerificationError: naming every check that failed.
    """
    folder = Path(folder)
    if plan is None:
        plan = _plan(model, dtype, max_shard_bytes=2**62)
        index = folder / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            plan.names = sorted(set(weight_map.values()))
            plan.files = [[k for k, v in weight_map.items() if v == n] for n in plan.names]
    report = VerifyReport()
    report.problems = _check_headers(plan, folder)
    if report.ok:
        try:
            tensors, nbytes, problems = _readback(plan, folder)
        except Exception as err:
            tensors, nbytes, problems = 0, 0, [f"reading the files back failed: {type(err).__name__}: {err}"]
        gathered: list[Any] = [(tensors, nbytes, problems)]
        if dist.is_initialized():
            gathered = [None] * _world()
            dist.all_gather_object(gathered, (tensors, nbytes, problems))  # every rank
        report.tensors = gathered[0][0]
        report.bytes_compared = sum(g[1] for g in gathered)
        report.problems = [p for g in gathered for p in g[2]]
    # The probe runs on every rank (a collective forward) whatever the findings so far.
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise ExportVerificationError("verification needs model.config.vocab_size for its probe batch")
    ids = _probe_ids(vocab)
    live = _live_logits(model, ids)
    if compute_dtype is None:
        compute_dtype = next(
            (
                v.dtype
                for v in get_model_state_dict(model).values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            ),
            torch.float32,
        )
    report.reload_dtype = str(compute_dtype).removeprefix("torch.")
    report.atol = (
        atol if atol is not None else default_atol(plan.weights_dtype, compute_dtype, float(live.abs().max()))
    )
    reload_problems: list[str] = []
    max_diff = float("nan")
    devices: list[str] = []
    if _rank() == 0 and report.ok:
        offload = folder.parent / f"{folder.name}.verify-offload"
        found = _reload_in_subprocess(folder, compute_dtype, ids, reload_ram_bytes, offload)
        reload_problems, max_diff = _compare_reload(found, model, plan, live, report.atol)
        devices = list(found.get("devices", []))
    box: list[Any] = [(reload_problems, max_diff, devices)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)  # every rank: rank 0's findings
    report.problems += box[0][0]
    report.max_logit_diff = box[0][1]
    report.reload_devices = box[0][2]
    if not report.ok:
        raise ExportVerificationError(
            f"the export in {folder} does not reproduce the model: " + "; ".join(report.problems[:8])
        )
    return report


def _compare_reload(
    found: dict[str, Any], model: torch.nn.Module, plan: _Plan, live: torch.Tensor, atol: float
) -> tuple[list[str], float]:
    if "error" in found:
        return [found["error"]], float("nan")
    problems = [f"from_pretrained reported {k}: {v[:5]}" for k, v in found["problems"].items()]
    if found["hf_fsdp2"]:
        problems.append("the reload imported hf_fsdp2; it must load with plain transformers")
    expected = {
        clean_name(k): list(v.shape)
        for k, v in get_model_state_dict(model).items()
        if isinstance(v, torch.Tensor)
    }
    if found["shapes"] != expected:
        diff = sorted(
            k for k in set(found["shapes"]) | set(expected) if found["shapes"].get(k) != expected.get(k)
        )
        problems.append(f"the reloaded model's tensors differ from the live model's: {diff[:5]}")
    tied = bool(tied_targets(model))
    if found["tied"] != tied:
        problems.append(f"tied embeddings: live model {tied}, reloaded {found['tied']}")
    logits = found["logits"]
    if logits.shape != live.shape:
        problems.append(f"probe logits shape {list(logits.shape)} vs live {list(live.shape)}")
        return problems, float("nan")
    max_diff = float((logits - live).abs().max())
    if not max_diff <= atol:  # also catches NaN
        problems.append(
            f"probe logits differ from the live model's by up to {max_diff:.4g} > atol {atol:.3g}"
        )
    return problems, max_diff


# ---------------------------------------------------------------------------------------------------
# Offline: a sharded training checkpoint -> the same folder (one process)
# ---------------------------------------------------------------------------------------------------


def last_metrics(run_dir: Path, up_to_step: int | None = None) -> dict[str, Any] | None:
    """The last metrics.jsonl record of a run (at or before ``up_to_step``), or None."""
    from hf_fsdp2.metrics import METRICS_FILE, read_metrics

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    rows = [r for r in read_metrics(path) if up_to_step is None or r.get("step", 0) <= up_to_step]
    return rows[-1] if rows else None


def load_checkpoint_model(checkpoint: str | Path) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """Build the run's model from its config and fill it with a checkpoint's weights (one process).

    The architecture, tokenizer and base files come from ``model_name_or_path`` in the checkpoint's
    ``hf_fsdp2_config.yaml``; the weights, in the dtype they were trained in, from its DCP shards.

    Returns:
        (model, the run's resolved config, the checkpoint's step).

    Raises:
        ExportError: an incomplete checkpoint, or one whose tensors do not fit the named model.
    """
    import yaml
    from accelerate.utils import set_module_tensor_to_device

    from hf_fsdp2.checkpoint import CONFIG_FILE, STATE_FILE
    from hf_fsdp2.model import load_model

    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise ExportError(
            f"{checkpoint}: no such checkpoint folder; give a <output_dir>/checkpoint-<step> folder"
        )
    missing = [n for n in (".metadata", STATE_FILE, CONFIG_FILE) if not (ckpt / n).is_file()]
    if missing:
        raise ExportError(
            f"{ckpt} is incomplete (no {', '.join(missing)}): its save was interrupted or it is not an hf_fsdp2 "
            "checkpoint; export an earlier checkpoint-<step> of the run"
        )
    cfg = yaml.safe_load((ckpt / CONFIG_FILE).read_text())
    step = int(json.loads((ckpt / STATE_FILE).read_text()).get("step", 0))
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    stored = {k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.")}
    model: Any = load_model(
        cfg["model_name_or_path"],
        dtype="float32",
        attn_implementation=cfg.get("attn_implementation") or "sdpa",
        revision=cfg.get("model_revision"),
        trust_remote_code=bool(cfg.get("trust_remote_code")),
        empty_weights=True,  # parameters on meta: the checkpoint fills them, nothing is read twice
    )
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(getattr(v, "size", ())) for k, v in stored.items()}
    absent = sorted(set(expected) - set(got))
    foreign = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if absent or foreign or wrong:
        details = []
        if absent:
            details.append(f"the model has {len(absent)} tensors the checkpoint lacks (e.g. {absent[:3]})")
        if foreign:
            details.append(f"the checkpoint has {len(foreign)} the model lacks (e.g. {foreign[:3]})")
        if wrong:
            details.append(
                f"shapes differ for {len(wrong)} (e.g. {wrong[0]}: model {expected[wrong[0]]}, checkpoint {got[wrong[0]]})"
            )
        raise ExportError(
            f"{ckpt} does not hold weights of {cfg['model_name_or_path']!r} (the model named in its {CONFIG_FILE}): "
            + "; ".join(details)
            + ". Is it a checkpoint of another run, or was that config edited?"
        )
    for name, param in list(model.named_parameters()):
        dtype = getattr(getattr(stored[name], "properties", None), "dtype", None) or torch.float32
        set_module_tensor_to_device(model, name, "cpu", value=torch.empty(param.shape, dtype=dtype))
    model.tie_weights()
    state = model.state_dict()
    with _single_process_dcp():
        dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    model.eval()
    return model, cfg, step


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    verify: bool = True,
    verify_atol: float | None = None,
) -> ExportResult:
    """``hf-fsdp2 export``: the consolidated folder of a sharded checkpoint, without training hardware.

    One process: the model is rebuilt from the run's config, filled from the checkpoint's shards, and
    written and verified as at the end of training (verification computes in the weights' dtype).

    Args:
        checkpoint: a ``checkpoint-<step>`` folder.
        out_dir: the export folder; must be empty unless ``overwrite``.
        dtype: export dtype; default the run's ``export_dtype``.
        max_shard_bytes: largest file; default the run's ``max_shard_size``.
        overwrite: replace the export files of a non-empty ``out_dir``.
        verify: verify before publishing.
        verify_atol: probe-logit tolerance (None: by dtype).

    Returns:
        The published folder's description.

    Raises:
        ExportError: a non-empty ``out_dir``, an incomplete or foreign checkpoint, or a failed write.
        ExportVerificationError: the written folder does not reproduce the checkpoint's model.
    """
    from transformers import GenerationConfig

    from hf_fsdp2.config import parse_size
    from hf_fsdp2.hub import render_model_card
    from hf_fsdp2.model import load_tokenizer

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExportError(
            "hf-fsdp2 export runs as one process (it needs no GPU and no process group); run it without "
            "torchrun / accelerate launch"
        )
    out = Path(out_dir).expanduser()
    check_export_dir(out, overwrite=overwrite)
    ckpt = Path(checkpoint).expanduser()
    if ckpt.resolve() == out.resolve() or ckpt.resolve() in out.resolve().parents:
        raise ExportError(f"OUT_DIR {out} is inside the checkpoint {ckpt}; choose a folder outside it")
    model: Any
    model, cfg, step = load_checkpoint_model(ckpt)
    name = cfg.get("tokenizer_name_or_path") or cfg["model_name_or_path"]
    tokenizer = load_tokenizer(
        name, revision=cfg.get("model_revision"), trust_remote_code=bool(cfg.get("trust_remote_code"))
    )
    try:
        generation_config = GenerationConfig.from_pretrained(
            cfg["model_name_or_path"], revision=cfg.get("model_revision") or "main"
        )
    except OSError:  # the base model has no generation_config.json: derive one, as transformers does
        generation_config = None
    card_cfg = dict(cfg)
    card_cfg["export_dtype"] = dtype or cfg.get("export_dtype", "bfloat16")
    world = json.loads((ckpt / "trainer_state.json").read_text()).get("world_size")
    card = render_model_card(card_cfg, metrics=last_metrics(ckpt.parent, step), world_size=world)
    return export_model(
        model,
        out,
        config=model.config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        dtype=card_cfg["export_dtype"],
        max_shard_bytes=max_shard_bytes or parse_size(str(cfg.get("max_shard_size", "5GB"))),
        model_card=card,
        verify=verify,
        verify_atol=verify_atol,
    )
