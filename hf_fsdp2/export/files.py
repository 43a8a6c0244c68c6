"""Safetensors files on disk: dtype codes, headers, the per-rank part files and the final files built from them.

Nothing here talks to other ranks; the writer and the verification call these on each rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_fsdp2.export.errors import ExportError

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
    # Only carried from a source checkpoint byte for byte (an FP8 checkpoint's tensors); nothing is cast to them.
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
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
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_COPY_BYTES = 16 * 2**20  # bytes copied at a time when assembling a file
# Part files of this writer (not DCP's) carry this in their metadata, like DCP's own: offsets per tensor.
SHARDING_INFO = "DCP_SHARDING_INFO"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def dtype_of_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code.

    Raises:
        ExportError: a code this torch has no dtype for here.
    """
    found = next((d for d, c in _ST_CODES.items() if c == code), None)
    if found is None:
        raise ExportError(
            f"safetensors dtype {code} is not one the export handles ({', '.join(sorted(_ST_SIZES))})"
        )
    return found


def is_supported(dtype: torch.dtype) -> bool:
    """Whether safetensors files hold tensors of ``dtype`` here."""
    return dtype in _ST_CODES


def code_of(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype."""
    return _ST_CODES[dtype]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` in a safetensors file."""
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


def read_header(path: Path) -> tuple[dict[str, Any], int]:
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


@dataclass(kw_only=True)
class Chunk:
    path: Path
    start: int  # absolute byte offset of the chunk's data in its part file
    offsets: list[int]
    shape: list[int]
    dtype: str


def index_parts(parts_dir: Path) -> dict[str, list[Chunk]]:
    """Every chunk of every tensor in the part files that DCP's HuggingFaceStorageWriter wrote."""
    chunks: dict[str, list[Chunk]] = {}
    for path in sorted(parts_dir.glob("*.safetensors")):
        header, data_start = read_header(path)
        meta = header.get("__metadata__", {})
        info = json.loads(meta.get(SHARDING_INFO, "{}"))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            offsets = info.get(key, {}).get("saved_offsets", [0] * len(entry["shape"]))
            chunks.setdefault(key, []).append(
                Chunk(
                    path=path,
                    start=data_start + entry["data_offsets"][0],
                    offsets=offsets,
                    shape=entry["shape"],
                    dtype=entry["dtype"],
                )
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


def _write_tensor(name: str, shape: tuple[int, ...], code: str, chunks: list[Chunk], dst: Any) -> None:
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
    chunks: dict[str, list[Chunk]],
) -> None:
    """Write one final safetensors file from the part files' chunks (format metadata ``pt``)."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in keys:
        code = _ST_CODES[dtypes[k]]
        n = nbytes(shapes[k], dtypes[k])
        entries[k] = {"dtype": code, "shape": list(shapes[k]), "data_offsets": [offset, offset + n]}
        offset += n
    with open(path, "wb") as dst:
        dst.write(_header_bytes(entries))
        for k in keys:
            if k not in chunks:
                raise ExportError(f"{k} is in no part file; a rank did not write its shard")
            _write_tensor(k, shapes[k], _ST_CODES[dtypes[k]], chunks[k], dst)


def write_part_file(path: Path, tensors: dict[str, tuple[torch.Tensor, list[int]]]) -> None:
    """Write this rank's chunks of some tensors as a part file the assembler reads like DCP's.

    Args:
        path: the part file (under the parts folder).
        tensors: checkpoint name -> (this rank's chunk, its offsets in the full tensor).
    """
    from safetensors.torch import save_file

    info = {k: {"saved_offsets": offsets} for k, (_, offsets) in tensors.items()}
    save_file(
        {k: t.contiguous() for k, (t, _) in tensors.items()},
        str(path),
        metadata={SHARDING_INFO: json.dumps(info), "format": "pt"},
    )


def read_slice(
    path: Path, header: dict[str, Any], data_start: int, key: str, where: tuple[slice, ...]
) -> torch.Tensor:
    """The ``where`` part of tensor ``key`` from a safetensors file.

    Rows (FSDP2's dim-0 shards) are one byte range, read with a plain read, so the file's pages are
    not mapped into the process; other slices go through safetensors.
    """
    entry = header[key]
    shape, code = entry["shape"], entry["dtype"]
    dtype = dtype_of_code(code)
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
