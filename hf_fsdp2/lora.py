"""LoRA through PEFT under FSDP2: wrapping, memory report, adapter export, gather-free merged export, offline merge.

The frozen base keeps its loaded dtype (bf16 with ``torch_dtype: bfloat16``); the trainable adapter
parameters are fp32 master copies (PEFT's ``autocast_adapter_dtype`` and accelerate's fp32 upcast of
trainable parameters under mixed precision). Both live in the same FSDP2 unit: under
``mixed_precision=bf16`` the policy casts every parameter to bf16 for the all-gather and the compute,
so the unit's all-gather is uniform, and only the adapter has gradients (reduced in fp32).

Why the adapter export gathers every rank's slice: FSDP2 shards each adapter matrix on dim 0 across
ranks like any other parameter. Saving ``model.state_dict()`` (or a FULL_STATE_DICT taken on one rank
without a collective) keeps only rank 0's rows, and a resume from it silently reverts the rest
(accelerate PR #4206, peft PR #3251). Here every rank takes part in ``full_tensor()`` for each adapter
tensor (small: r x (in + out) per module), and rank 0 writes them.

The merged export never gathers the base: a LoRA linear's ``W`` ([out, in]) and ``B`` ([out, r]) are
both sharded on dim 0 in the same row chunks, so this rank's rows of ``W + scale * B @ A`` are its
``W`` rows plus ``scale * B_rows @ A`` with only the small ``A`` ([r, in]) gathered. The merged rows go
into a sharded twin of the plain base architecture (same mesh, same per-layer units), which the
export module writes with its gather-free, verified consolidated export.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_fsdp2.export.errors import ExportVerificationError, VerifyReport

logger = logging.getLogger("hf_fsdp2")

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
MERGED_DIR_NAME = "merged"


class LoraError(RuntimeError):
    """A LoRA setting or adapter that cannot be used; the message says why and what to do."""


@dataclass
class LoraSettings:
    """The LoRA knobs of the recipe (see ``config.PeftArgs``)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"
    modules_to_save: list[str] | None = None
    use_rslora: bool = False


def lora_config(settings: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` for a causal LM.

    Args:
        settings: rank, alpha, dropout, target modules (names or ``all-linear``), modules to save, rsLoRA.

    Returns:
        A ``peft.LoraConfig`` with ``task_type=CAUSAL_LM``.
    """
    from peft import LoraConfig

    targets: list[str] | str = settings.target_modules
    if isinstance(targets, list) and targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        use_rslora=settings.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, seed: int | None = None) -> torch.nn.Module:
    """Wrap a loaded (unsharded) causal LM with PEFT LoRA; the base is frozen, the adapter fp32.

    Call it after loading and before sharding (``prepare_fsdp2``), then build the optimizer on the
    result (``optim.param_groups`` keeps only trainable parameters).

    Args:
        model: the HF causal LM (on CPU, GPU or meta for rank-0-only loading).
        settings: the LoRA settings.
        seed: seeds the adapter's initialisation alone (a forked RNG), so that it depends on the seed and
            not on what ran before; every rank then starts from the same adapter. None = the global RNG.

    Returns:
        The ``PeftModelForCausalLM``.

    Raises:
        LoraError: a target module name that matches nothing in the model.
    """
    from peft import get_peft_model

    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            peft_model = get_peft_model(model, lora_config(settings), autocast_adapter_dtype=True)
    except ValueError as err:
        names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise LoraError(
            f"PEFT could not apply LoRA with lora_target_modules={settings.target_modules}: {err}; "
            f"the model's linear module names are {names} (or use all-linear)"
        ) from err
    for param in peft_model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.float()  # fp32 master copies of what trains (modules_to_save too)
    return peft_model


def memory_report(model: torch.nn.Module) -> dict[str, float]:
    """Trainable vs total parameters and the AdamW state size (global, unsharded sizes).

    Args:
        model: the (PEFT-wrapped) model, before or after sharding (DTensor sizes are global).

    Returns:
        ``total_params``, ``trainable_params``, ``trainable_fraction``, ``param_bytes`` (all
        parameters in their dtypes), ``trainable_bytes`` and ``optimizer_state_bytes`` (AdamW: two
        moments per trainable parameter in its dtype).
    """
    total = trainable = param_bytes = trainable_bytes = 0
    for p in model.parameters():
        n = p.numel()
        total += n
        param_bytes += n * p.element_size()
        if p.requires_grad:
            trainable += n
            trainable_bytes += n * p.element_size()
    return {
        "total_params": total,
        "trainable_params": trainable,
        "trainable_fraction": trainable / max(total, 1),
        "param_bytes": param_bytes,
        "trainable_bytes": trainable_bytes,
        "optimizer_state_bytes": 2 * trainable_bytes,
    }


def format_memory_report(report: dict[str, float], world_size: int) -> str:
    """One log line from :func:`memory_report`."""
    return (
        f"LoRA: {report['trainable_params'] / 1e6:.2f}M trainable of {report['total_params'] / 1e6:.1f}M parameters "
        f"({100 * report['trainable_fraction']:.2f}%); parameters {report['param_bytes'] / 2**20:.1f} MiB, "
        f"trainable fp32 {report['trainable_bytes'] / 2**20:.2f} MiB, AdamW state "
        f"{report['optimizer_state_bytes'] / 2**20:.2f} MiB in all, "
        f"{report['optimizer_state_bytes'] / world_size / 2**20:.2f} MiB per rank (sharded over {world_size})"
    )


def _clean(name: str) -> str:
    from hf_fsdp2.export import clean_name

    return clean_name(name)


def reshard(model: torch.nn.Module) -> None:
    """Return every FSDP2 unit to its sharded state (no communication).

    Units kept unsharded after a forward (the root and the tail group use ``reshard_after_forward=False``)
    expose full plain tensors as their parameters; readers of local shards need the sharded DTensors.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_adapter_name(name: str) -> bool:
    return ".lora_" in name or ".modules_to_save." in name


def gather_adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full adapter tensors (every rank's slice), as fp32 CPU tensors; only the adapter is gathered.

    Every rank must call it (collective: one ``full_tensor`` per adapter tensor, in the same order).

    Args:
        model: the FSDP2-sharded (or plain) PEFT model.

    Returns:
        ``{state-dict name: full tensor}`` for LoRA and modules_to_save tensors, on every rank.
    """
    reshard(model)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not _is_adapter_name(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param  # every rank
        out[_clean(name)] = full.detach().float().cpu().clone()
    return out


def save_adapter(model: Any, out_dir: str | Path, *, is_main_process: bool) -> dict[str, torch.Tensor]:
    """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors) to ``out_dir``.

    Every rank must call it (the adapter is gathered from all ranks); rank 0 writes.

    Args:
        model: the (sharded) PEFT model.
        out_dir: the folder (created).
        is_main_process: whether this rank writes.

    Returns:
        The gathered adapter state dict (PEFT's names, as ``PeftModel.state_dict()`` has them).
    """
    full = gather_adapter_state_dict(model)  # every rank
    if is_main_process:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        # With state_dict given, PEFT only renames and writes: nothing reads the sharded parameters.
        model.save_pretrained(str(out_dir), state_dict=full, safe_serialization=True)
    return full


# Runs in a fresh interpreter with plain transformers + peft, as a user would load the adapter.
_ADAPTER_RELOAD = r"""
import hashlib, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
request = torch.load(sys.argv[1])
out = sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(request["base"], dtype=getattr(torch, request["compute_dtype"]))
model = PeftModel.from_pretrained(model, request["adapter"])
state = {k: v for k, v in model.state_dict().items() if ".lora_" in k or ".modules_to_save." in k}
mismatched = []
for name, digest in request["digests"].items():
    got = state.get(name)
    if got is None:
        mismatched.append(f"{name}: not in the reloaded model")
    elif hashlib.sha256(got.detach().float().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() != digest:
        mismatched.append(f"{name}: differs")
extra = sorted(set(state) - set(request["digests"]))
# The adapter (PEFT keeps it in fp32) computes in the live model's dtype too; the base is loaded in it.
# Parameters only: a whole-model .to() would also round buffers computed at init (rotary frequencies).
for name, param in model.named_parameters():
    if ".lora_" in name or ".modules_to_save." in name:
        param.data = param.data.to(getattr(torch, request["compute_dtype"]))
model.eval()
ids = request["ids"]
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
torch.save({"logits": logits, "mismatched": mismatched, "extra": extra, "compared": len(request["digests"]),
            "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules)}, out)
"""


def verify_adapter(
    model: torch.nn.Module,
    adapter_dir: str | Path,
    base_model: str,
    adapter: dict[str, torch.Tensor],
    *,
    compute_dtype: torch.dtype,
    atol: float | None = None,
) -> VerifyReport:
    """Reload base + adapter with plain PEFT in a fresh process and check it against the live model.

    Exact: every adapter tensor of the reloaded PeftModel, by name, equals the live (gathered) adapter bit
    for bit, and none is missing or extra. Probe: logits of the reload, computed in ``compute_dtype`` as
    the live model computes, within :func:`hf_fsdp2.export.probe_limit` of the live logits. Every rank
    must call it (collective forward); rank 0 runs the reload.

    Args:
        model: the live (sharded) PEFT model.
        adapter_dir: the (staged) adapter folder.
        base_model: the base model's hub id or folder (as trained from).
        adapter: the gathered adapter state dict that was written (PEFT's names, fp32).
        compute_dtype: dtype the live model computes in (the reload uses it too).
        atol: largest accepted probe difference; None = the default limit.

    Returns:
        The report.

    Raises:
        ExportVerificationError: a check failed (nothing has been published).
    """
    from hf_fsdp2 import collectives
    from hf_fsdp2.export.verify import digest, live_logits, probe_ids, probe_limit, reload_in_subprocess

    ids = probe_ids(int(model.config.vocab_size))  # type: ignore[union-attr,arg-type]
    live = live_logits(model, ids)  # every rank
    report = VerifyReport(reload_dtype=str(compute_dtype).removeprefix("torch."), reload_devices=["cpu"])
    report.logit_scale = float(live.abs().max())
    report.atol = atol if atol is not None else probe_limit(compute_dtype, report.logit_scale)
    found: dict[str, Any] = {}
    if collectives.rank() == 0:
        request = {
            "base": str(base_model),
            "adapter": str(adapter_dir),
            "compute_dtype": report.reload_dtype,
            "ids": ids,
            "digests": {_peft_key(k): digest(v.float()) for k, v in adapter.items()},
        }
        found = reload_in_subprocess(request, Path(adapter_dir) / ".offload", script=_ADAPTER_RELOAD)
        problems = [found["error"]] if "error" in found else []
        if not problems:
            if found["mismatched"] or found["extra"]:
                problems.append(
                    f"the reloaded adapter differs from the trained one: {(found['mismatched'] + found['extra'])[:3]}"
                )
            if found["hf_fsdp2"]:
                problems.append("the reload imported hf_fsdp2; it must load with plain PEFT")
            diff = float((found["logits"] - live).abs().max())
            found["max_diff"] = diff
            if not diff <= report.atol:
                problems.append(f"probe logits differ by {diff:.4g} > limit {report.atol:.3g}")
        found = {"problems": problems, "max_diff": found.get("max_diff", float("nan")),
                 "compared": found.get("compared", 0)}  # fmt: skip
    found = collectives.broadcast_object(found)
    report.problems = found["problems"]
    report.max_logit_diff = found["max_diff"]
    report.reloaded_tensors = report.tensors = int(found["compared"])
    if not report.ok:
        raise ExportVerificationError(
            f"the adapter in {adapter_dir} does not reproduce the live LoRA model: " + "; ".join(report.problems)
        )
    return report


def _peft_key(name: str) -> str:
    """A gathered adapter name as ``PeftModel.state_dict()`` of a reloaded model spells it."""
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"


# ---------------------------------------------------------------------------------------------------
# Merging
# ---------------------------------------------------------------------------------------------------


def _lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """``{clean base-model prefix: LoraLayer}`` for every LoRA-wrapped linear, base-model relative names."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            out[_base_name(_clean(name))] = module
    return out


def _base_name(name: str) -> str:
    """A PEFT model name -> the plain base model's name (``base_model.model.`` and ``.base_layer`` dropped)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "")


def _check_mergeable(layer: Any, adapter: str, name: str = "") -> None:
    where = f" ({name})" if name else ""
    if getattr(layer, "use_dora", {}).get(adapter, False):
        raise LoraError(f"DoRA adapters are not merged here{where}; train without use_dora or set merge_adapter=false")
    if getattr(layer, "fan_in_fan_out", False):
        raise LoraError(f"fan_in_fan_out LoRA layers (Conv1D models) are not merged here{where}; set merge_adapter=false")
    if not isinstance(layer.get_base_layer(), torch.nn.Linear):
        raise LoraError(
            f"only LoRA on nn.Linear is merged here, not on {type(layer.get_base_layer()).__name__}{where} (fused "
            "MoE experts); set merge_adapter=false (the adapter is still exported), or list lora_target_modules "
            "without the experts"
        )


def check_mergeable(model: torch.nn.Module, adapter: str = "default") -> None:
    """Refuse, before training, an adapter that the merged export could not merge.

    Raises:
        LoraError: naming the first LoRA layer that cannot be merged, and the fix.
    """
    for name, layer in _lora_modules(model).items():
        _check_mergeable(layer, adapter, name)


def merged_local_weights(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """This rank's rows of every weight of the merged model, by plain base-model name; no base gather.

    For a LoRA linear: ``W_rows + scaling * B_rows @ A`` computed in fp32 (fp64 for fp64 weights) then cast to ``W``'s dtype,
    with ``A`` gathered (small). modules_to_save copies replace their originals. Every rank must call it.

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
    for raw, param in params.items():
        name = _clean(raw)
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        base = _base_name(name)
        local = param.to_local() if isinstance(param, DTensor) else param
        out[base] = local.detach()
    for prefix, layer in layers.items():
        w_name = f"{prefix}.weight"
        a = layer.lora_A[adapter].weight
        b = layer.lora_B[adapter].weight
        a_full = a.full_tensor() if isinstance(a, DTensor) else a  # every rank, in module order
        b_local = b.to_local() if isinstance(b, DTensor) else b
        w_local = out[w_name]
        if b_local.shape[0] != w_local.shape[0]:
            raise LoraError(
                f"{prefix}: lora_B has {b_local.shape[0]} local rows but the weight has {w_local.shape[0]}; "
                "the adapter and the base must be sharded alike (dim 0)"
            )
        acc = torch.promote_types(w_local.dtype, torch.float32)  # fp32, or fp64 for fp64 weights
        delta = (b_local.to(acc) @ a_full.to(acc)) * float(layer.scaling[adapter])
        out[w_name] = (w_local.to(acc) + delta).to(w_local.dtype)
    return out


def build_merged_twin(
    model: Any,
    *,
    layer_cls_names: tuple[str, ...],
    mp_policy: Any | None,
    adapter: str = "default",
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

    Returns:
        The sharded twin (an HF ``PreTrainedModel``), ready for ``export.export_model``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    merged = merged_local_weights(model, adapter)  # every rank
    base = model.get_base_model()
    device = next(iter(merged.values())).device
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(base.config, dtype=next(iter(merged.values())).dtype)
    kwargs: dict[str, Any] = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    if dist.is_initialized():  # sharded like the live model; one process (offline export): a plain model
        for module in twin.modules():
            if type(module).__name__ in layer_cls_names:
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
        # Buffers (rotary inv_freq) are not in the state dict; recompute them as from_pretrained does.
        for name, buf in base.named_buffers():
            twin_buf = twin.get_buffer(_clean(name)) if _clean(name) in dict(twin.named_buffers()) else None
            if twin_buf is not None:
                twin_buf.copy_(buf.to(twin_buf.device, twin_buf.dtype))
    twin.tie_weights()
    twin.generation_config = getattr(base, "generation_config", None) or twin.generation_config
    return twin


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
        LoraError: not a PEFT LoRA adapter folder, a DoRA adapter, or no base model known.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.export import check_export_dir, export_model

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG_NAME).is_file():
        raise LoraError(f"{adapter_dir} has no {ADAPTER_CONFIG_NAME}: not a PEFT adapter folder")
    cfg = json.loads((adapter_dir / ADAPTER_CONFIG_NAME).read_text())
    if cfg.get("peft_type") != "LORA":
        raise LoraError(f"{adapter_dir} holds a {cfg.get('peft_type')} adapter; only LoRA is merged here")
    if cfg.get("use_dora"):
        raise LoraError("DoRA adapters are not merged here")
    base_model = base_model or cfg.get("base_model_name_or_path")
    if not base_model:
        raise LoraError(f"{adapter_dir}/{ADAPTER_CONFIG_NAME} names no base model; give --base-model")
    check_export_dir(out_dir, overwrite=overwrite)
    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    peft_model.eval()
    from hf_fsdp2.export.verify import probe_ids

    ids = probe_ids(int(base.config.vocab_size))
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    merged = peft_model.merge_and_unload()
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
    )
    return {
        "out_dir": str(result.out_dir),
        "base_model": str(base_model),
        "files": list(result.files),
        "merge_logit_diff": diff,
    }


ADAPTER_STAGE_NAME = ".adapter-incomplete"


@dataclass
class LoraExport:
    """What :func:`export_lora` wrote."""

    adapter_dir: Path
    adapter_report: VerifyReport | None
    merged_dir: Path | None = None
    merged_report: VerifyReport | None = None


def _publish_adapter(stage: Path, out: Path) -> None:
    """Rank 0: move the verified adapter files into ``out``, the weights last (what PEFT opens)."""
    import os
    import shutil

    for item in sorted(stage.iterdir(), key=lambda p: p.name == ADAPTER_WEIGHTS_NAME):
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    stage.rmdir()


def export_lora(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    base_model: str,
    tokenizer: Any | None,
    merge: bool,
    layer_cls_names: tuple[str, ...],
    mp_policy: Any | None,
    dtype: str,
    max_shard_bytes: int,
    compute_dtype: torch.dtype,
    verify: bool = True,
    verify_atol: float | None = None,
    model_card: str | None = None,
    is_main_process: bool,
) -> LoraExport:
    """The end-of-training LoRA export: the adapter in ``out_dir`` and, with ``merge``, the merged model
    in ``out_dir/merged``. Each is written to a staging folder, verified, and only then published: a
    rejected adapter or merged model is never left looking finished. Every rank must call it.

    Args:
        model: the FSDP2-sharded PEFT model.
        out_dir: the run folder (the adapter is written in it, as TRL does with ``use_peft``).
        base_model: the base model's hub id or folder (recorded in adapter_config.json; the reload uses it).
        tokenizer: saved beside the adapter and in the merged folder.
        merge: also write the merged full model (gather-free) to ``out_dir/merged``.
        layer_cls_names: decoder-layer classes (the merged twin is sharded like training).
        mp_policy: the run's ``MixedPrecisionPolicy``.
        dtype: export dtype of the merged model (the adapter is saved in fp32).
        max_shard_bytes: largest merged safetensors file.
        compute_dtype: dtype the live model computes in.
        verify: run the reload checks.
        verify_atol: largest probe-logit difference accepted; None = the default limit.
        model_card: README.md text for the adapter folder (PEFT's own card otherwise).
        is_main_process: whether this rank writes the small files.

    Returns:
        The folders and their verification reports (None when not verified).

    Raises:
        ExportVerificationError / ExportError / LoraError: a check failed; nothing of it was published.
    """
    import shutil

    from hf_fsdp2 import collectives
    from hf_fsdp2.export import ExportError, export_model

    out = Path(out_dir)
    stage = out / ADAPTER_STAGE_NAME
    adapter = gather_adapter_state_dict(model)  # every rank

    def write() -> None:  # rank 0 writes; its failure is raised on every rank (no rank left waiting)
        if is_main_process:
            if stage.exists():
                shutil.rmtree(stage)
            stage.mkdir(parents=True)
            # With state_dict given, PEFT only renames and writes: nothing reads the sharded parameters.
            model.save_pretrained(str(stage), state_dict=adapter, safe_serialization=True)  # type: ignore[operator]
            if tokenizer is not None:
                tokenizer.save_pretrained(str(stage))
            if model_card is not None:
                (stage / "README.md").write_text(model_card)

    collectives.run_on_all("writing the adapter", write, ExportError)  # the files are on disk after it
    report = None
    if verify:
        report = verify_adapter(model, stage, base_model, adapter, compute_dtype=compute_dtype, atol=verify_atol)
        logger.info("adapter %s", report.summary())
    collectives.run_on_all(
        "publishing the adapter", lambda: _publish_adapter(stage, out) if is_main_process else None, ExportError
    )
    result = LoraExport(adapter_dir=out, adapter_report=report)
    if not merge:
        return result
    twin = build_merged_twin(model, layer_cls_names=layer_cls_names, mp_policy=mp_policy)  # every rank
    merged_dir = out / MERGED_DIR_NAME
    merged = export_model(
        twin,
        merged_dir,
        config=twin.config,
        tokenizer=tokenizer,
        generation_config=twin.generation_config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        verify=verify,
        verify_atol=verify_atol,
        compute_dtype=compute_dtype,
    )
    result.merged_dir, result.merged_report = merged_dir, merged.verify
    del twin
    return result
