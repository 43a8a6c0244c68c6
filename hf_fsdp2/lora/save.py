"""The end-of-training LoRA export: the adapter gathered, staged, verified with plain PEFT in a fresh
process, then published; the merged model through the export module.

Why the adapter export gathers every rank's slice: FSDP2 shards each adapter matrix on dim 0 across
ranks like any other parameter. Saving ``model.state_dict()`` (or a FULL_STATE_DICT taken on one rank
without a collective) keeps only rank 0's rows, and a resume from it silently reverts the rest
(accelerate PR #4206, peft PR #3251). Here every rank takes part in ``full_tensor()`` for each adapter
tensor (small: r x (in + out) per module), and rank 0 writes them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_fsdp2.export.errors import ExportVerificationError, VerifyReport
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.lora.adapter import ADAPTER_WEIGHTS_NAME, MERGED_DIR_NAME, reshard
from hf_fsdp2.lora.merge import build_merged_twin
from hf_fsdp2.parallel.expert_shard import ExpertMeshes

logger = logging.getLogger("hf_fsdp2")


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
        out[name] = full.detach().float().cpu().clone()
    return out


def head_request(model: torch.nn.Module) -> dict[str, Any]:
    """The reload's auto class: a reward model's base loaded with ``AutoModelForSequenceClassification``, one label
    and the run's padding id (PEFT's adapter folder holds the trained score head); a composite checkpoint's with
    ``AutoModelForImageTextToText`` (the adapter loads on the composite, as a user loads it); empty for a causal LM."""
    from hf_fsdp2.model import auto_class_name
    from hf_fsdp2.score_head import carries_score_head, modeling_source, score_head_class

    config: Any = model.config
    name = auto_class_name(config)
    if name != "AutoModelForSequenceClassification":
        return {} if name == "AutoModelForCausalLM" else {"auto_class": name}
    request = {"auto_class": name, "head": {"num_labels": 1, "pad_token_id": config.pad_token_id}}
    if carries_score_head(
        config
    ):  # no transformers class: the reload runs the modeling file the folder ships
        request.update(modeling=modeling_source(config), modeling_class=score_head_class(config).__name__)
    return request


def verify_adapter(
    model: torch.nn.Module,
    adapter_dir: str | Path,
    base_model: str,
    adapter: dict[str, torch.Tensor],
    *,
    compute_dtype: torch.dtype,
    atol: float | None = None,
    base_dtype: torch.dtype | None = None,
) -> VerifyReport:
    """Reload base + adapter with plain PEFT in a fresh process (hf_fsdp2/export/reload_scripts/reload_adapter.py)
    and check it against the live model.

    Exact: every adapter tensor of the reloaded PeftModel, by name, equals the live (gathered) adapter bit
    for bit, and none is missing or extra. Probe: logits of the reload, computed in ``compute_dtype`` as
    the live model computes, within :func:`hf_fsdp2.export.probe_limit` of the live logits (its floor, or
    a margin over the reload's own rounding noise, measured again in float32 for bf16/fp16). Every rank
    must call it (collective forward); rank 0 runs the reload.

    Args:
        model: the live (sharded) PEFT model.
        adapter_dir: the (staged) adapter folder.
        base_model: the base model's hub id or folder (as trained from).
        adapter: the gathered adapter state dict that was written (PEFT's names, fp32).
        compute_dtype: dtype the live model computes in (the reload uses it too).
        atol: largest accepted probe difference; None = the default limit.
        base_dtype: the dtype the live base was loaded in (then cast to ``compute_dtype``); None = compute_dtype.

    Returns:
        The report.

    Raises:
        ExportVerificationError: a check failed (nothing has been published).
    """
    from hf_fsdp2 import collectives
    from hf_fsdp2.export import reload_scripts
    from hf_fsdp2.export.probe import live_logits, probe_ids, probe_limit, reference_dtype
    from hf_fsdp2.export.verify import digest, reload_in_subprocess
    from hf_fsdp2.model import embedding_rows

    ids = probe_ids(int(embedding_rows(model.config) or 0))  # type: ignore[arg-type]  # a composite's text config
    live = live_logits(model, ids)  # every rank
    report = VerifyReport(reload_dtype=str(compute_dtype).removeprefix("torch."), reload_devices=["cpu"])
    report.logit_scale = float(live.abs().max())
    # The floor until the reload has measured its own rounding noise (rank 0 then raises the limit).
    report.atol = atol if atol is not None else probe_limit(compute_dtype, report.logit_scale)
    reference = reference_dtype(compute_dtype) if atol is None else None
    found: dict[str, Any] = {}
    if collectives.rank() == 0:
        request = {
            "base": str(base_model),
            "adapter": str(adapter_dir),
            "compute_dtype": report.reload_dtype,
            "base_dtype": str(base_dtype).removeprefix("torch.") if base_dtype is not None else None,
            "reference_dtype": str(reference).removeprefix("torch.") if reference is not None else None,
            "ids": ids,
            "digests": {_peft_key(k): digest(v.float()) for k, v in adapter.items()},
            **nf4_request(model),
            **head_request(model),
        }
        found = reload_in_subprocess(request, Path(adapter_dir) / ".offload", script=reload_scripts.ADAPTER)
        problems = [found["error"]] if "error" in found else []
        if not problems:
            if found["mismatched"] or found["extra"]:
                problems.append(
                    f"the reloaded adapter differs from the trained one: {(found['mismatched'] + found['extra'])[:3]}"
                )
            if found["hf_fsdp2"]:
                problems.append("the reload imported hf_fsdp2; it must load with plain PEFT")
            if atol is None:
                report.atol = probe_limit(compute_dtype, report.logit_scale, found["noise"])
            diff = float((found["logits"] - live).abs().max())
            found["max_diff"] = diff
            if not diff <= report.atol:
                problems.append(f"probe logits differ by {diff:.4g} > limit {report.atol:.3g}")
            if found.get("dequantised_logits") is not None:
                deq = float((found["dequantised_logits"] - live).abs().max())
                found["max_diff"] = max(diff, deq)
                logger.info(
                    "adapter reloaded with plain PEFT on the 4-bit base (torchao NF4, quantised as the run did) and on "
                    "the dequantised base: probe logits max |diff| %.3g and %.3g (limit %.3g)",
                    diff,
                    deq,
                    report.atol,
                )
                if not deq <= report.atol:
                    problems.append(
                        f"on the dequantised base, probe logits differ by {deq:.4g} > limit {report.atol:.3g}"
                    )
        found = {
            "problems": problems,
            "max_diff": found.get("max_diff", float("nan")),
            "compared": found.get("compared", 0),
            "atol": report.atol,
            "noise": found.get("noise", float("nan")),
        }
    # The other ranks wait here through rank 0's reload, over the host (gloo) group (host_wait_timeout).
    found = collectives.broadcast_object(found)
    report.problems = found["problems"]
    report.atol, report.logit_noise = found["atol"], found["noise"]
    report.max_logit_diff = found["max_diff"]
    report.reloaded_tensors = report.tensors = int(found["compared"])
    if not report.ok:
        raise ExportVerificationError(
            f"the adapter in {adapter_dir} does not reproduce the live LoRA model: "
            + "; ".join(report.problems)
        )
    return report


def nf4_request(model: torch.nn.Module) -> dict[str, Any]:
    """What the reload needs to quantise the base as the run did: each 4-bit linear module by its name in the base
    model with its scale block, the dtype it was quantised from, the block size, whether DoRA is on; {} without."""
    from hf_fsdp2.lora.quantize import NF4_BLOCK_SIZE, is_nf4

    modules: dict[str, int] = {}
    source = None
    dora = False
    for name, module in model.named_modules():
        dora = dora or hasattr(module, "lora_magnitude_vector") and bool(module.lora_magnitude_vector)
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight is None or not is_nf4(weight):
            continue
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        base_name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        modules[base_name] = int(local.scaler_block_size)  # type: ignore[union-attr,attr-defined]
        source = str(local.dtype).removeprefix("torch.")
    if not modules:
        return {}
    return {"nf4": modules, "nf4_dtype": source, "nf4_block": NF4_BLOCK_SIZE, "dora": dora}


def _peft_key(name: str) -> str:
    """A gathered adapter name as ``PeftModel.state_dict()`` of a reloaded model spells it."""
    return name if name.startswith("base_model.model.") else f"base_model.model.{name}"


ADAPTER_STAGE_NAME = ".adapter-incomplete"


@dataclass
class LoraExport:
    """What :func:`export_lora` wrote."""

    adapter_dir: Path
    adapter_report: VerifyReport | None
    merged_dir: Path | None = None
    merged_report: VerifyReport | None = None


def _publish_verified(stage: Path, out: Path, report: Any) -> None:
    """Rank 0: the record of the verification (push checks it), then the adapter's files, its weights last."""
    from hf_fsdp2.export.folder import write_record
    from hf_fsdp2.export.writer import publish

    write_record(stage, verified=report.summary() if report is not None else None)
    publish(stage, out, ADAPTER_WEIGHTS_NAME, stale=None)


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
    base_dtype: torch.dtype | None = None,
    source: ExportSource | None = None,
    experts: ExpertMeshes | None = None,
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
        base_dtype: the dtype the live model's frozen base was loaded in, when it computes in another one (an
            offline export upcasts a bf16 run's base to fp32): the reload loads it so too. None: compute_dtype.
        source: the base checkpoint (``model_name_or_path`` and its revision): the merged export carries from its
            files what did not train (a composite's vision tower and projector) and what the class does not load, as
            a full export does. None: ``base_model`` at its default revision.
        experts: the run's expert-parallel meshes (None: no expert parallel): the merged twin's experts are split
            as the run's.

    Returns:
        The folders and their verification reports (None when not verified).

    Raises:
        ExportVerificationError / ExportError / LoraError: a check failed; nothing of it was published.
    """
    import shutil

    from hf_fsdp2 import collectives
    from hf_fsdp2.export import ExportError, export_model
    from hf_fsdp2.export.finite import check_finite
    from hf_fsdp2.export.reload_process import shared_reload_process
    from hf_fsdp2.score_head import write_modeling_file

    out = Path(out_dir)
    stage = out / ADAPTER_STAGE_NAME
    adapter = gather_adapter_state_dict(model)  # every rank

    def write() -> None:  # rank 0 writes; its failure is raised on every rank (no rank left waiting)
        if is_main_process:
            check_finite(adapter, what="the LoRA adapter")
            if stage.exists():
                shutil.rmtree(stage)
            stage.mkdir(parents=True)
            # With state_dict given, PEFT only renames and writes: nothing reads the sharded parameters.
            model.save_pretrained(str(stage), state_dict=adapter, safe_serialization=True)  # type: ignore[operator]
            if tokenizer is not None:
                tokenizer.save_pretrained(str(stage))
            if model_card is not None:
                (stage / "README.md").write_text(model_card)
            # A score head transformers lacks: the class that loads the base with it, beside the adapter.
            write_modeling_file(model.get_base_model().config, stage)  # type: ignore[operator]

    # The adapter's reload and the merged model's share one interpreter (export/reload_process.py).
    with shared_reload_process() if verify and merge else contextlib.nullcontext():
        collectives.run_on_all("writing the adapter", write, ExportError)  # the files are on disk after it
        report = None
        if verify:
            report = verify_adapter(
                model,
                stage,
                base_model,
                adapter,
                compute_dtype=compute_dtype,
                atol=verify_atol,
                base_dtype=base_dtype,
            )
            logger.info("adapter %s", report.summary())
        collectives.run_on_all(
            "publishing the adapter",
            lambda: _publish_verified(stage, out, report) if is_main_process else None,
            ExportError,
        )
        result = LoraExport(adapter_dir=out, adapter_report=report)
        if not merge:
            return result
        # every rank
        twin = build_merged_twin(model, layer_cls_names=layer_cls_names, mp_policy=mp_policy, experts=experts)
        merged_dir = out / MERGED_DIR_NAME
        merged = export_model(
            twin,
            merged_dir,
            config=twin.config,
            tokenizer=tokenizer,
            generation_config=getattr(twin, "generation_config", None),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            verify=verify,
            verify_atol=verify_atol,
            compute_dtype=compute_dtype,
            source=source if source is not None else ExportSource(base_model),
        )
        result.merged_dir, result.merged_report = merged_dir, merged.verify
        del twin
        return result
