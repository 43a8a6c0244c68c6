"""Merging an adapter into its base without gathering the base, and offline merging of an adapter folder.

A LoRA linear's ``W`` ([out, in]) and ``B`` ([out, r]) are both sharded on dim 0 in the same row chunks,
so this rank's rows of ``W + scale * B @ A`` are its ``W`` rows plus ``scale * B_rows @ A`` with only the
small ``A`` ([r, in]) gathered. The merged rows go into a sharded twin of the plain base architecture
(same mesh, same per-layer units), which the export module writes with its gather-free, verified
consolidated export.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_fsdp2.compat import NO_HUB_KERNELS
from hf_fsdp2.export.plan import _row_offset as row_offset
from hf_fsdp2.lora.adapter import ADAPTER_CONFIG_NAME, LoraError, reshard
from hf_fsdp2.lora.experts import adapted_weight, is_param_wrapper, local_expert_delta
from hf_fsdp2.lora.quantize import is_nf4
from hf_fsdp2.parallel.expert_shard import ExpertMeshes


def _lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """``{plain base-model name of the adapted weight: LoraLayer}`` for every LoRA layer: ``<module>.weight`` for a
    linear, ``<module>.<parameter>`` for LoRA on a parameter (fused MoE experts, PEFT's ``ParamWrapper``)."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            out[adapted_weight(name, module)] = module
    return out


def _base_name(name: str) -> str:
    """A PEFT model name -> the plain base model's name (``base_model.model.`` and ``.base_layer`` dropped)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "")


def _check_mergeable(layer: Any, adapter: str, name: str = "") -> None:
    where = f" ({name})" if name else ""
    if getattr(layer, "fan_in_fan_out", False):
        raise LoraError(
            f"fan_in_fan_out LoRA layers (Conv1D models) are not merged here{where}; set merge_adapter=false"
        )
    if is_param_wrapper(layer):
        dims = layer.get_param().dim()
        if dims not in (2, 3):
            raise LoraError(
                f"LoRA on a {dims}-D parameter is not merged here{where}; set merge_adapter=false"
            )
        return
    if not isinstance(layer.get_base_layer(), torch.nn.Linear):
        raise LoraError(
            f"only LoRA on nn.Linear (or on a 2-D/3-D parameter) is merged here, not on "
            f"{type(layer.get_base_layer()).__name__}{where}; set merge_adapter=false (the adapter is still exported)"
        )


def check_mergeable(model: torch.nn.Module, adapter: str = "default") -> None:
    """Refuse, before training, an adapter that the merged export could not merge.

    Raises:
        LoraError: naming the first LoRA layer that cannot be merged, and the fix.
    """
    for name, layer in _lora_modules(model).items():
        _check_mergeable(layer, adapter, name)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # every rank, in module order


def merged_local_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """This rank's rows of every weight of the merged model, by plain base-model name; no base gather.

    For a LoRA linear: ``W_rows + scaling * B_rows @ A`` computed in fp32 (fp64 for fp64 weights) then cast to ``W``'s
    dtype, with ``A`` gathered (small). For LoRA on a fused MoE expert weight (sharded by whole experts on dim 0):
    each expert held here gets ``W_e + scaling * B_e @ A_e`` (:func:`~hf_fsdp2.lora.experts.local_expert_delta`), with
    the whole ``A`` and ``B`` gathered (``r x experts x (in + out)``, small beside the experts); on a 2-D parameter
    (a router weight) as for a linear. modules_to_save copies replace their originals. Every rank must call it.

    Args:
        model: the FSDP2-sharded (or plain) PEFT model.
        adapter: the adapter name.

    Returns:
        ``{base-model parameter name: local tensor}`` (this rank's shard; the full tensor in one process).
    """
    reshard(model)
    layers = _lora_modules(model)
    for layer in layers.values():
        _check_mergeable(layer, adapter)
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    offsets: dict[str, int] = {}
    for raw, param in params.items():
        name = raw
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        base = _base_name(name)
        local = _local(param)
        if is_nf4(
            local
        ):  # QLoRA: this rank's rows of the 4-bit weight, dequantised (its own scales are local)
            local = local.get_original_weight()  # type: ignore[attr-defined]
        out[base] = local.detach()
        offsets[base] = row_offset(param)
    for w_name, layer in layers.items():
        a = layer.lora_A[adapter].weight
        b = layer.lora_B[adapter].weight
        w_local = out[w_name]
        acc = torch.promote_types(w_local.dtype, torch.float32)  # fp32, or fp64 for fp64 weights
        if is_param_wrapper(layer) and w_local.dim() == 3:  # fused experts: this rank's whole experts
            delta = local_expert_delta(
                layer, adapter, _full(a), _full(b), offsets[w_name], w_local.shape[0], acc
            )
            out[w_name] = (w_local.to(acc) + delta).to(w_local.dtype)
            continue
        a_full = _full(a)
        b_local = _local(b)
        if b_local.shape[0] != w_local.shape[0]:
            raise LoraError(
                f"{w_name}: lora_B has {b_local.shape[0]} local rows but the weight has {w_local.shape[0]}; "
                "the adapter and the base must be sharded alike (dim 0)"
            )
        delta = (b_local.to(acc) @ a_full.to(acc)) * float(layer.scaling[adapter])
        merged = w_local.to(acc) + delta
        if getattr(layer, "use_dora", {}).get(adapter, False):
            # DoRA (PEFT's merge): each output row rescaled to its trained magnitude, m / ||W + s B A||_row. The rows
            # are whole on this rank (dim-0 shards), so are their norms; m is sharded in the same row chunks.
            m_local = _local(layer.lora_magnitude_vector[adapter].weight)
            if m_local.shape[0] != merged.shape[0]:
                raise LoraError(
                    f"{w_name}: the DoRA magnitude has {m_local.shape[0]} local rows, the weight {merged.shape[0]}"
                )
            merged = merged * (m_local.to(acc) / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
        out[w_name] = merged.to(w_local.dtype)
    return out


def build_merged_twin(
    model: Any,
    *,
    layer_cls_names: tuple[str, ...],
    mp_policy: Any | None,
    adapter: str = "default",
    experts: ExpertMeshes | None = None,
) -> Any:
    """A plain base-architecture model holding the merged weights, sharded like ``model``; no base gather.

    The twin is built on meta from the base config, sharded with ``fully_shard`` per decoder layer and at
    the root on the default mesh (the same row chunks as the live model), materialised, and filled with
    this rank's merged rows. It costs one more sharded copy of the model on each rank, never a full one.
    Every rank must call it.

    Args:
        model: the FSDP2-sharded PEFT model.
        layer_cls_names: decoder-layer class names (one FSDP unit each, as in training).
        mp_policy: the training run's ``MixedPrecisionPolicy`` (the twin computes like the live model).
        adapter: the adapter name.
        experts: the run's expert-parallel meshes (None: no expert parallel): the twin's experts are split over the
            same ``ep`` ranks and sharded on the same expert mesh, so each rank's merged rows are its own.

    Returns:
        The sharded twin (an HF ``PreTrainedModel``), ready for ``export.export_model``.
    """
    import transformers
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from hf_fsdp2.model import auto_class_name
    from hf_fsdp2.parallel.expert_parallel import apply_expert_parallel, expert_shards
    from hf_fsdp2.parallel.expert_shard import shard_expert_layers

    merged = merged_local_weights(model, adapter)  # every rank
    base = model.get_base_model()
    device = next(iter(merged.values())).device
    auto = getattr(transformers, auto_class_name(base.config))  # a reward model's twin has its score head
    config = base.config
    shards = expert_shards(base) if experts is not None else {}
    if shards:  # the live config names expert parallel: the twin starts from the implementation it wraps
        config = copy.deepcopy(config)
        config._experts_implementation = next(iter(shards.values())).implementation
    with torch.device("meta"):
        twin = auto.from_config(config, dtype=next(iter(merged.values())).dtype)
    # The checkpoint's names as the live model has them (derived from the folder on every rank): a model built from
    # its config gets the class's conversions minus every prefix change, and would name a composite's tower
    # (Gemma 3's vision_tower.vision_model.*) otherwise than its checkpoint.
    if getattr(base, "_weight_conversions", None) is not None:
        twin._weight_conversions = base._weight_conversions
    kwargs: dict[str, Any] = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    if dist.is_initialized():  # sharded like the live model; one process (offline export): a plain model
        if shards and experts is not None:  # the MoE layers first, their experts on the expert mesh
            apply_expert_parallel(twin, experts.ep)
            shard_expert_layers(twin, layer_cls_names, experts, mesh=None, fsdp_kwargs=kwargs, upcast=False)
        for module in twin.modules():
            if type(module).__name__ in layer_cls_names and not isinstance(module, FSDPModule):
                fully_shard(module, **kwargs)
        fully_shard(twin, **kwargs)
    twin.to_empty(device=device)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            src = merged.get(name)
            if src is None:
                raise LoraError(f"merged weights lack {name}: the twin and the trained model differ")
            dst = param.to_local() if isinstance(param, DTensor) else param
            if dst.shape != src.shape:
                raise LoraError(
                    f"{name}: local shard {tuple(dst.shape)} in the twin vs {tuple(src.shape)} trained"
                )
            dst.copy_(src.to(dst.dtype))
        # Buffers (rotary inv_freq, DeepSeek-V3's e_score_correction_bias) as the live model holds them, by their plain
        # names (a buffer of a module LoRA wraps lies under its .base_layer).
        twin_buffers = dict(twin.named_buffers())
        for name, buf in base.named_buffers():
            twin_buf = twin_buffers.get(_base_name(name))
            if twin_buf is not None:
                twin_buf.copy_(buf.to(twin_buf.device, twin_buf.dtype))
    twin.tie_weights()
    frozen_like_the_run(twin)
    generation = getattr(base, "generation_config", None) or getattr(twin, "generation_config", None)
    if generation is not None:  # a reward model (sequence classification) has none
        twin.generation_config = generation
    return twin


def frozen_like_the_run(model: torch.nn.Module) -> None:
    """The merged model's parameters marked as the run trained them: a composite's vision tower and projector frozen
    (they take no adapter: :func:`~hf_fsdp2.lora.build.composite_parts`), everything else trained (merged). The
    export carries what is frozen byte for byte from the base checkpoint's files, as a full export does, and writes
    the rest from the merged weights."""
    from hf_fsdp2.lora.build import composite_parts, under

    parts = composite_parts(model)
    for name, param in model.named_parameters():
        param.requires_grad_(not under(parts, name))


def _check_finite_weights(peft_model: Any, adapter_dir: Path, base_model: str) -> None:
    """Refuse NaN or inf in the adapter or its base before merging: either makes every logit NaN (the merge's
    own check would report a difference of nan)."""
    from hf_fsdp2.export.finite import NAMES_SHOWN, nonfinite_names
    from hf_fsdp2.lora.adapter import ADAPTER_WEIGHTS_NAME

    params = dict(peft_model.named_parameters())
    bad = nonfinite_names({k: v for k, v in params.items() if ".lora_" in k})
    if bad:
        raise LoraError(
            f"{adapter_dir / ADAPTER_WEIGHTS_NAME} holds NaN or inf in {len(bad)} tensor(s) (e.g. "
            f"{', '.join(bad[:NAMES_SHOWN])}): the adapter is damaged or its run diverged; restore it from a copy, or "
            "export an earlier checkpoint of the run (`hf-fsdp2 export CHECKPOINT OUT_DIR`)"
        )
    bad = nonfinite_names({k: v for k, v in params.items() if ".lora_" not in k})
    if bad:
        raise LoraError(
            f"the base model {base_model} holds NaN or inf in {len(bad)} tensor(s) (e.g. {', '.join(bad[:NAMES_SHOWN])}); "
            "give the base the adapter was trained on with --base-model"
        )


def merge_adapter_offline(
    adapter_dir: str | Path,
    out_dir: str | Path,
    *,
    base_model: str | Path | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    verify: bool = True,
) -> dict[str, Any]:
    """Merge a PEFT LoRA adapter into its base in this process and write a consolidated HF folder.

    The merge runs in fp32 (base loaded in fp32, ``W + scale * B @ A``), then the export module writes
    and verifies the folder (fresh-process reload, probe logits).

    Args:
        adapter_dir: the adapter folder (adapter_config.json + adapter_model.safetensors).
        out_dir: the output folder (new or empty unless ``overwrite``).
        base_model: the base model's hub id or folder; None = adapter_config.json's base_model_name_or_path.
        dtype: export dtype (``bfloat16``, ``float32``, ``float16``).
        max_shard_bytes: largest safetensors file.
        overwrite: write into a non-empty ``out_dir``.
        verify: check the folder against the merged model.

    Returns:
        ``{"out_dir", "base_model", "files", "merge_logit_diff"}``; the last is the largest probe-logit
        difference of the merged model against base + adapter unmerged (fp32).

    Raises:
        LoraError: not a PEFT LoRA adapter folder, or no base model known.
    """
    import transformers
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    from hf_fsdp2.export import check_export_dir, export_model
    from hf_fsdp2.export.folder import folder_problems, is_checkpoint
    from hf_fsdp2.export.source import ExportSource
    from hf_fsdp2.model import auto_class_name, embedding_rows

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG_NAME).is_file():
        hint = (
            f"; export it first (`hf-fsdp2 export {adapter_dir} OUT_DIR` writes a LoRA run's adapter folder)"
            if is_checkpoint(adapter_dir)
            else ""
        )
        raise LoraError(f"{adapter_dir} has no {ADAPTER_CONFIG_NAME}: not a PEFT adapter folder{hint}")
    # A damaged adapter_config.json or adapter_model.safetensors: the file named, before PEFT reads them.
    damaged = folder_problems(adapter_dir)
    if damaged:
        raise LoraError(
            f"the adapter is damaged: {damaged[0]}; restore it from a copy, or export the run's checkpoint again "
            "(`hf-fsdp2 export CHECKPOINT OUT_DIR`)"
        )
    cfg = json.loads((adapter_dir / ADAPTER_CONFIG_NAME).read_text())
    if cfg.get("peft_type") != "LORA":
        raise LoraError(f"{adapter_dir} holds a {cfg.get('peft_type')} adapter; only LoRA is merged here")
    base_model = base_model or cfg.get("base_model_name_or_path")
    if not base_model:
        raise LoraError(f"{adapter_dir}/{ADAPTER_CONFIG_NAME} names no base model; give --base-model")
    check_export_dir(out_dir, overwrite=overwrite)
    # The base's own auto class: a composite checkpoint's (vision tower + projector + language model) loads whole.
    auto = getattr(transformers, auto_class_name(AutoConfig.from_pretrained(str(base_model))))
    base = auto.from_pretrained(str(base_model), dtype=torch.float32, **NO_HUB_KERNELS)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    peft_model.eval()
    _check_finite_weights(peft_model, adapter_dir, str(base_model))
    from hf_fsdp2.export.probe import probe_ids

    ids = probe_ids(int(embedding_rows(base.config) or 0))  # a composite's vocabulary is its text config's
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    merged = peft_model.merge_and_unload()
    frozen_like_the_run(
        merged
    )  # PEFT froze the whole base: what merged is written, a composite's tower carried
    with torch.no_grad():
        got = merged(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    diff = float((got - unmerged).abs().max())
    if not diff <= 1e-3 * max(1.0, float(unmerged.abs().max())):
        raise LoraError(f"the merged model's logits differ from base + adapter by {diff:.4g}")
    tokenizer = None
    for source in (adapter_dir, Path(str(base_model))):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source))
            break
        except (OSError, ValueError):
            continue
    result = export_model(
        merged,
        out_dir,
        config=merged.config,
        tokenizer=tokenizer,
        generation_config=getattr(merged, "generation_config", None),
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        verify=verify,
        compute_dtype=torch.float32,
        source=ExportSource(str(base_model)),
    )
    return {
        "out_dir": str(result.out_dir),
        "base_model": str(base_model),
        "files": list(result.files),
        "merge_logit_diff": diff,
    }
