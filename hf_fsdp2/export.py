"""The consolidated HF folder written at the end of training.

``config.json``, ``generation_config.json``, tokenizer files, ``*.safetensors`` (sharded by
``max_shard_size`` with ``model.safetensors.index.json`` when more than one file) that
``AutoModelForCausalLM.from_pretrained(dir)`` loads without hf_fsdp2.

Files are written to a staging folder inside the output dir and moved into place only once all of
them are complete, the index (or the single weights file) last, so a crash mid-export never leaves
a folder that looks loadable but is not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.generation import GenerationConfig

logger = logging.getLogger("hf_fsdp2")

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict on rank 0's CPU; other ranks get an empty dict.

    Every rank must call it: each sharded parameter is all-gathered one at a time and offloaded to
    host memory on rank 0 only.
    """
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _tied_keys(state_dict: dict[str, torch.Tensor], config: PretrainedConfig) -> set[str]:
    """Keys that from_pretrained re-ties to another key, and which are therefore not written."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    tied = set()
    for key in state_dict:
        if key.endswith("lm_head.weight"):
            tied.add(key)
    return tied


def shard_state_dict(
    state_dict: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Split a state dict into shards of at most ``max_shard_bytes`` (a larger single tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def write_hf_folder(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    dtype: str,
    max_shard_bytes: int,
) -> list[str]:
    """Write an HF model folder from a full state dict (one process).

    Args:
        state_dict: full, unsharded tensors keyed by HF names.
        out_dir: the folder; existing model files in it are replaced.
        config: model config; its ``dtype`` is set to the export dtype.
        tokenizer: saved alongside (chat template included) when given.
        generation_config: saved as generation_config.json (a default one is derived when None).
        dtype: ``bfloat16``, ``float32`` or ``float16``.
        max_shard_bytes: largest safetensors file.

    Returns:
        The weight file names written.

    Raises:
        ValueError: unknown dtype or an empty state dict.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_dtype={dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
    if not state_dict:
        raise ValueError("nothing to export: the state dict is empty (called on a rank other than 0?)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = out / ".export-incomplete"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    torch_dtype = EXPORT_DTYPES[dtype]
    skip = _tied_keys(state_dict, config)
    tensors = {
        k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous()
        for k, v in state_dict.items()
        if k not in skip
    }
    shards = shard_state_dict(tensors, max_shard_bytes)
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(stage / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    config = config.__class__.from_dict(config.to_dict())
    config.dtype = torch_dtype
    config.use_cache = True
    config.save_pretrained(stage)
    gen = generation_config or GenerationConfig.from_model_config(config)
    gen.save_pretrained(stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    # Remove model files of an earlier export that this one does not overwrite.
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_NAME]:
        if old.exists() and old.name not in names:
            old.unlink()
    # Publish: everything but the file from_pretrained opens first, then that file.
    first = INDEX_NAME if len(shards) > 1 else WEIGHTS_NAME
    for item in sorted(stage.iterdir(), key=lambda p: p.name == first):
        os.replace(item, out / item.name)
    stage.rmdir()
    return names


def export_model(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    dtype: str,
    max_shard_bytes: int,
    is_main_process: bool,
) -> list[str]:
    """Export a (sharded) model: gather on rank 0's CPU, rank 0 writes, all ranks wait.

    All ranks must call it. Returns the weight file names on rank 0, an empty list elsewhere.
    """
    state_dict = gather_full_state_dict(model)  # collective: every rank takes part
    names: list[str] = []
    if is_main_process:
        names = write_hf_folder(
            state_dict,
            out_dir,
            config=config,
            tokenizer=tokenizer,
            generation_config=generation_config,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
        )
        logger.info("exported %s (%s) to %s", ", ".join(names), dtype, out_dir)
    del state_dict
    if dist.is_initialized():
        dist.barrier()  # every rank: nobody reads the folder before rank 0 has published it
    return names
