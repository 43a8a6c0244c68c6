"""The checkpoint-name conversions a model was loaded with, derived from the folder's tensor names on every rank.

transformers 5 maps a checkpoint's tensor names onto the module names through conversions (prefix changes such as
Gemma 3's ``vision_tower.vision_model.*`` or Qwen3.5's ``model.language_model.*``, per-expert splits of fused MoE
tensors), and ``save_pretrained`` reverses them. ``from_pretrained`` keeps only the conversions that matched a key of
the folder (``model._weight_conversions``); a model built with ``from_config`` (the ranks other than 0 under
``fsdp_cpu_ram_efficient_loading``) gets the class's whole list minus every prefix change. The two disagree on the
names of a composite checkpoint, and the export, whose ranks each write their shard of a tensor under the name their
own model gives it, would write half a tensor under each name. So every rank, rank 0 included, derives the used
conversions the way ``from_pretrained`` does, from the same input: the folder's tensor names (index or headers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hf_fsdp2.config import ConfigError

# The files transformers reads weights from, in its order of preference: an index names every tensor.
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")


def _names_of_file(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:  # the header only
            return list(handle.keys())
    # A pickled state dict: mapped, onto the meta device, nothing read but its pickle.
    return list(torch.load(path, map_location="meta", mmap=True, weights_only=True))


def _local_names(folder: Path) -> list[str] | None:
    for name in _INDEXES:
        if (folder / name).is_file():
            return list(json.loads((folder / name).read_text())["weight_map"])
    for name in _SINGLE:
        if (folder / name).is_file():
            return _names_of_file(folder / name)
    return None


def _hub_names(repo: str, revision: str | None) -> list[str] | None:
    """A hub checkpoint's names: from the local cache (rank 0's download on this node), else the safetensors
    headers over HTTP (range requests: no weight is downloaded)."""
    from huggingface_hub import get_safetensors_metadata, try_to_load_from_cache

    for name in (*_INDEXES, *_SINGLE):
        cached = try_to_load_from_cache(repo, name, revision=revision)
        if isinstance(cached, str):
            path = Path(cached)
            return (
                list(json.loads(path.read_text())["weight_map"]) if name in _INDEXES else _names_of_file(path)
            )
    try:
        return list(get_safetensors_metadata(repo, revision=revision).weight_map)
    except Exception:  # noqa: BLE001 - offline, gated, no safetensors: the caller names the checkpoint
        return None


def checkpoint_tensor_names(name_or_path: str, *, revision: str | None = None) -> list[str]:
    """Every tensor name of a checkpoint, read from its index or file headers (no weight is read).

    Args:
        name_or_path: a local folder or a hub id.
        revision: hub revision.

    Raises:
        ConfigError: no safetensors or PyTorch weights found (names the files looked for).
    """
    folder = Path(name_or_path).expanduser()
    names = _local_names(folder) if folder.is_dir() else _hub_names(name_or_path, revision)
    if names is None:
        raise ConfigError(
            f"cannot read the tensor names of {name_or_path!r}: none of {', '.join(_INDEXES + _SINGLE)} found "
            "(locally or on the hub); every rank reads them to name the checkpoint's tensors alike. Give a folder "
            "with safetensors weights (or its index)"
        )
    return names


def used_conversions(model: torch.nn.Module, names: list[str]) -> list[Any]:
    """The conversions ``from_pretrained`` keeps for ``model`` loading a checkpoint with tensors ``names``: its
    class's conversions (as ``from_pretrained`` asks for them), each key renamed as it renames them, in its order,
    those that matched a key kept. The same list on a model built with ``from_config`` as after ``from_pretrained``.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    conversions = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    # Which keys exist decides how a base-model prefix is added or stripped; only the keys are read.
    module_keys = dict.fromkeys(model.state_dict(), True)
    prefix = getattr(model, "base_model_prefix", None)
    for key in sorted(names, key=dot_natural_key):  # from_pretrained's order (some conversions are stateful)
        rename_source_key(key, renamings, converters, prefix, module_keys)
    return [c for c in conversions if c.was_used()]


def name_conversions_from_folder(
    model: torch.nn.Module, name_or_path: str, *, revision: str | None = None
) -> None:
    """Set ``model._weight_conversions`` (what ``save_pretrained`` and the export reverse) from the checkpoint's
    tensor names, on every rank alike. Raises as :func:`checkpoint_tensor_names`."""
    model._weight_conversions = used_conversions(  # type: ignore[assignment]
        model, checkpoint_tensor_names(name_or_path, revision=revision)
    )
