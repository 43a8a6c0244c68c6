"""The checkpoint a run started from, as the export reads it: its tensor names, where each tensor's bytes lie, and
the files beside the weights (processor, chat templates).

An export carries from it, byte for byte, what the run did not train (a composite's frozen vision tower and
projector) and what the model class does not load (Qwen3.5's ``mtp.*``), so that the export holds every tensor of
the checkpoint under its original name. Everything here reads safetensors headers and copies bytes, with no
collective: every rank reads the same files and reaches the same answer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.export.files import INDEX_NAME, WEIGHTS_NAME, dtype_of_code, read_header

# Files of a checkpoint that the tokenizer does not write and that do not change what the weights compute: the
# processor (image and video), the chat templates a processor keeps apart from the tokenizer's. Copied as they are.
SIDE_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
SIDE_FOLDERS = ("additional_chat_templates",)
_HASH_BYTES = 16 * 2**20  # bytes hashed at a time


@dataclass(frozen=True)
class ExportSource:
    """The model folder (or hub id and revision) a run loaded: what ``model_name_or_path`` names."""

    name_or_path: str
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.name_or_path).expanduser().is_dir()

    def file(self, name: str, *, download: bool = True) -> Path | None:
        """A file of the checkpoint on this host (for a hub id: from the hub cache, downloaded into it unless
        ``download`` is off), or None if the checkpoint has none (or, not downloading, the cache lacks it)."""
        from transformers.utils.hub import cached_file

        if self.is_local:
            path = Path(self.name_or_path).expanduser() / name
            return path if path.is_file() else None
        found = cached_file(
            self.name_or_path,
            name,
            revision=self.revision,
            local_files_only=not download,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
        return Path(found) if found else None

    def folder(self, name: str) -> Path | None:
        """A sub-folder of the checkpoint on this host: the local folder's, or the hub cache snapshot's when it holds
        it (a hub id's sub-folders are not listed: the config's snapshot folder is looked in)."""
        local = Path(self.name_or_path).expanduser()
        if not local.is_dir():
            config = self.file("config.json")
            if config is None:
                return None
            local = config.parent
        path = local / name
        return path if path.is_dir() else None


@dataclass(frozen=True, kw_only=True)
class SourceTensor:
    """Where one tensor of the checkpoint lies: its file, the absolute byte offset of its data, its size, its
    safetensors dtype code and shape."""

    path: Path
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def weight_map(source: ExportSource) -> dict[str, str] | None:
    """Every tensor name of the checkpoint -> the safetensors file that holds it, in the checkpoint's order; None when
    it has no safetensors weights (``pytorch_model.bin``: its names cannot be read without unpickling it).

    Raises:
        ExportError: an index that cannot be read.
    """
    index = source.file(INDEX_NAME)
    if index is not None:
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ExportError(f"{index} cannot be read as a safetensors index ({err})") from err
    # One file: its header. A hub checkpoint's, when this host's cache lacks it (ranks on another node than the one
    # that loaded it), over HTTP range requests: its names need no download of the weights.
    single = source.file(WEIGHTS_NAME, download=False)
    if single is not None:
        header, _ = read_header(single)
        return dict.fromkeys((k for k in header if k != "__metadata__"), WEIGHTS_NAME)
    if source.is_local:
        return None
    from huggingface_hub import get_safetensors_metadata

    try:
        metadata = get_safetensors_metadata(source.name_or_path, revision=source.revision)
    except Exception:  # noqa: BLE001 - offline, gated, or no safetensors: the names cannot be read
        return None
    return dict(metadata.weight_map)


def locate(source: ExportSource, names: list[str], files: dict[str, str]) -> dict[str, SourceTensor]:
    """Where the bytes of ``names`` lie in the checkpoint (only the files holding them are read, headers only).

    Raises:
        ExportError: a file of the index that is missing or does not hold the tensor the index says it does.
    """
    headers: dict[str, tuple[Path, dict, int]] = {}
    out: dict[str, SourceTensor] = {}
    for name in names:
        file = files[name]
        if file not in headers:
            path = source.file(file)
            if path is None:
                raise ExportError(
                    f"{source.name_or_path}: {file} (named by its index) is missing; the export carries {name} from "
                    "it. Download the checkpoint again"
                )
            headers[file] = (path, *read_header(path))
        path, header, data_start = headers[file]
        entry = header.get(name)
        if entry is None:
            raise ExportError(f"{path} does not hold {name}, which its index places there")
        begin, end = entry["data_offsets"]
        out[name] = SourceTensor(
            path=path,
            start=data_start + begin,
            nbytes=end - begin,
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
        )
    return out


def read_tensor(tensor: SourceTensor) -> torch.Tensor:
    """One tensor of the checkpoint, read from its file (a plain read: the file is not mapped)."""
    with open(tensor.path, "rb") as fh:
        fh.seek(tensor.start)
        data = bytearray(fh.read(tensor.nbytes))
    if len(data) != tensor.nbytes:
        raise ExportError(f"{tensor.path} is shorter than its header says")
    dtype = dtype_of_code(tensor.dtype)
    if not data:
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(tensor.shape)


def byte_digest(path: Path, start: int, length: int) -> str:
    """sha256 of ``length`` bytes of a file from ``start``, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        while length > 0:
            block = fh.read(min(length, _HASH_BYTES))
            if not block:
                raise ExportError(f"{path} is shorter than its header says")
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def copy_side_files(source: ExportSource, stage: Path) -> list[str]:
    """Copy the checkpoint's processor and chat-template files into ``stage`` (rank 0: they do not change what the
    weights compute); a file the tokenizer already wrote there (its own ``chat_template.jinja``) is kept.

    Returns:
        The names copied.
    """
    copied = []
    for name in SIDE_FILES:
        if (stage / name).exists():
            continue
        path = source.file(name)
        if path is not None:
            shutil.copyfile(path, stage / name)
            copied.append(name)
    for name in SIDE_FOLDERS:
        folder = source.folder(name)
        if folder is not None and not (stage / name).exists():
            shutil.copytree(folder, stage / name)
            copied.append(name + "/")
    return copied
