"""Verification of an exported folder against the live model, before it is published.

It separates rounding from mistakes without a tolerance to tune per model. Every check but the last is
exact:

1. headers: every expected tensor is in a file, with its global shape and the export dtype; no extra
   tensor; the index maps each tensor to the file that holds it; file sizes add up; with a source checkpoint,
   every one of its tensors is in a file under its name (or is a tied copy);
2. bytes: each rank reads back the slices it owns and compares them bit for bit with its shards cast
   to the export dtype (no rank reads the model); the tensors carried from the source checkpoint (a
   composite's frozen tower and projector, what the class does not load) have the source's sha256 (file
   ``i`` by rank ``i % world``), and each rank's shards of the frozen ones equal the source's values;
3. reload: rank 0 loads the folder in a fresh Python process with plain transformers (the auto class a
   user would: ``AutoModelForImageTextToText`` for a composite), which must build the live model's class. Its loading
   report must have no missing, unexpected or mismatched keys; every reloaded tensor, by name, must
   equal the live model's shards bit for bit (each rank sends a digest of its own slices; fused MoE
   experts come back through transformers' own merge); config.json must equal the live config (but
   for ``dtype``, ``use_cache`` and ``architectures``, which the export sets); tied embeddings tied;
4. probe: logits on a fixed batch from the reload must match the live model's, where the live model
   computes with its weights rounded to the export dtype (for the duration of the probe only) and
   both compute in the same dtype: the expected difference is kernel noise. The limit
   (:func:`probe_limit`) is the larger of a floor relative to the logit scale and a margin over the
   reload's own rounding noise, measured by computing the probe again in float32 (bf16/fp16 compute):
   the live model's kernels (a GPU's) round differently from the reload's (a CPU's) by about as much.
   The log says how far under it the difference stayed.

The reload keeps at most ``reload_ram_bytes`` of weights in memory; the rest stays on disk and streams
through the forward (accelerate's offload), so no process holds a large model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_fsdp2 import collectives
from hf_fsdp2.dtypes import dtype_name
from hf_fsdp2.export import reload_process, reload_scripts
from hf_fsdp2.export.errors import ExportError, ExportInterrupted, ExportVerificationError, VerifyReport
from hf_fsdp2.export.files import INDEX_NAME, code_of, read_header, read_slice
from hf_fsdp2.export.naming import tied_targets
from hf_fsdp2.export.plan import ExportPlan, export_config, first_replica, make_plan
from hf_fsdp2.export.probe import (
    compute_dtype_of,
    live_float8,
    live_logits,
    probe_ids,
    probe_limit,
    reference_dtype,
    rounded_weights,
)
from hf_fsdp2.export.source import ExportSource, byte_digest
from hf_fsdp2.model import auto_class_name, embedding_rows
from hf_fsdp2.score_head import carries_score_head

RELOAD_RAM_BYTES = 2 * 2**30  # weights the verification's reload keeps in RAM; the rest stream from disk
# Config keys an export sets itself (or that describe the file, not the model).
_CONFIG_KEYS_SET = {
    "dtype",
    "torch_dtype",
    "use_cache",
    "architectures",
    "transformers_version",
    "_name_or_path",
}


# ---------------------------------------------------------------------------------------------------
# 1-2. Headers and bytes
# ---------------------------------------------------------------------------------------------------


def local_slices(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of ``tensor`` and where it sits in the full tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, s) for s in tensor.shape)
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()  # the chunk DCP writes for this rank (one per placement)
    if len(chunks) != 1:
        raise ExportError(f"a DTensor with {len(chunks)} local chunks cannot be read back here")
    offsets = chunks[0].offsets
    return local, tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))


def check_headers(plan: ExportPlan, folder: Path) -> list[str]:
    """Key set, shapes and dtypes of every file against the plan (headers only; cheap)."""
    problems: list[str] = []
    found: dict[str, tuple[list[int], str, str]] = {}
    for name in plan.names:
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        try:
            header, data_start = read_header(path)
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
    carried = plan.carried
    if carried is not None:  # the whole source checkpoint: each of its tensors in a file, or a tied copy
        lost = [n for n in carried.source_names if n not in found and n not in carried.tied]
        lost = [n for n in lost if n not in carried.left_out]
        if lost:
            problems.append(
                f"{len(lost)} tensors of {carried.source.name_or_path} are in no file of the export (e.g. {lost[:5]})"
            )
    for k in sorted(set(found) & set(plan.shapes)):
        shape, code, _ = found[k]
        if tuple(shape) != plan.shapes[k] or code != code_of(plan.dtypes[k]):
            problems.append(
                f"{k}: file says {code}{shape}, the model has {code_of(plan.dtypes[k])}{list(plan.shapes[k])}"
            )
    return problems


def _file_of(plan: ExportPlan) -> dict[str, str]:
    return {k: name for name, keys in zip(plan.names, plan.files, strict=True) for k in keys}


def readback(plan: ExportPlan, folder: Path) -> tuple[int, int, list[str]]:
    """Every rank: read its own slices back from the final files, one tensor at a time, and compare
    them bit for bit with its shards in the export dtype (no rank reads more than it owns).

    The file's slice is a host tensor and the shard lives where the model does (a GPU): each shard is
    copied to the host before the comparison, one at a time, so the extra host memory is one shard."""
    problems: list[str] = []
    count = 0
    headers: dict[str, tuple[dict[str, Any], int]] = {}
    file_of = _file_of(plan)

    def compare(key: str, shard: torch.Tensor, where: tuple[slice, ...]) -> None:
        nonlocal count
        name = file_of[key]
        if name not in headers:
            headers[name] = read_header(folder / name)
        header, data_start = headers[name]
        got = read_slice(folder / name, header, data_start, key, where)
        want = shard.to(got.device)  # the device shard on the host (a no-op for a host shard)
        count += want.numel() * want.element_size()
        if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else "?"
            problems.append(
                f"{key}: the bytes on disk differ from the model's (max |diff| {diff}) on rank {collectives.rank()}"
            )

    for key in plan.sources:
        want, where = local_slices(plan.cast(key))
        if want.numel():
            compare(key, want, where)
    for module_name in plan.expert_sources:
        for key, want in plan.local_experts(module_name).items():
            compare(key, want, tuple(slice(0, s) for s in want.shape))
    carried_bytes, carried_problems = check_carried(plan, folder)
    return len(plan.shapes), count + carried_bytes, problems + carried_problems


def check_carried(plan: ExportPlan, folder: Path) -> tuple[int, list[str]]:
    """Every rank, for the tensors carried from the source checkpoint: the sha256 of each one's bytes in the export
    against the source's (file ``i`` by rank ``i % world``); and this rank's shards of the carried tensors the model
    holds (the frozen tower and projector) against the source's values: the export holds what the model computed
    with, not only what the source held under that name.

    Returns:
        Bytes compared, and the problems found.
    """
    carried = plan.carried
    if carried is None or not carried.tensors:
        return 0, []
    problems: list[str] = []
    count = 0
    world, rank = collectives.world(), collectives.rank()
    for i, (name, keys) in enumerate(zip(plan.names, plan.files, strict=True)):
        if i % world != rank:
            continue
        header, data_start = read_header(folder / name)
        for key in keys:
            source = carried.tensors.get(key)
            if source is None:
                continue
            begin, end = header[key]["data_offsets"]
            count += source.nbytes
            if end - begin != source.nbytes or byte_digest(
                folder / name, data_start + begin, end - begin
            ) != byte_digest(source.path, source.start, source.nbytes):
                problems.append(f"{key}: its bytes in {name} differ from {source.path}'s")
    if carried.frozen:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(plan.model)
        for key, module_name in carried.frozen.items():
            value = state.get(module_name)
            source = carried.tensors[key]
            if not isinstance(value, torch.Tensor) or (
                isinstance(value, DTensor) and not first_replica(value)
            ):
                continue
            if tuple(value.shape) != source.shape:
                problems.append(
                    f"{key}: the model holds {list(value.shape)}, the source {list(source.shape)}"
                )
                continue
            local, where = local_slices(value)
            if not local.numel():
                continue
            entry = {"dtype": source.dtype, "shape": list(source.shape), "data_offsets": [0, source.nbytes]}
            got = read_slice(source.path, {key: entry}, source.start, key, where).to(local.dtype)
            count += got.numel() * got.element_size()
            want = local.detach().to(got.device)
            if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                problems.append(
                    f"{key}: the model's values (it did not train) differ from {source.path}'s on rank {rank}"
                )
    return count, problems


# ---------------------------------------------------------------------------------------------------
# 3. The reload, in a fresh interpreter: plain transformers, no hf_fsdp2, as a user would load the folder
# ---------------------------------------------------------------------------------------------------
# The reload's script: hf_fsdp2/export/reload_scripts/reload_export.py.


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, on the host)."""
    return hashlib.sha256(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def live_boxes(
    model: torch.nn.Module, load_dtypes: dict[str, torch.dtype], names: set[str]
) -> dict[str, list[tuple[list[int], list[int], str]]]:
    """This rank's slices of the named tensors, as the reload should hold them: module name ->
    [(offsets, sizes, digest)], each slice cast to its reload dtype (replicas: the first one only)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: dict[str, list[tuple[list[int], list[int], str]]] = {}
    for name, value in get_model_state_dict(model).items():
        if name not in names or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor) and not first_replica(value):
            continue
        local, where = local_slices(value)
        if local.numel() == 0:
            continue
        box = ([sl.start for sl in where], [sl.stop - sl.start for sl in where])
        out.setdefault(name, []).append((*box, digest(local.to(load_dtypes[name]))))
    return out


def reload_in_subprocess(
    request: dict[str, Any], offload: Path, script: Path = reload_scripts.EXPORT
) -> dict[str, Any]:
    """Run the file ``script`` (default: hf_fsdp2/export/reload_scripts/reload_export.py) on ``request`` in a
    separate CPU interpreter that never imports hf_fsdp2 (export/reload_process.py: a new one, or the one shared
    inside ``shared_reload_process``); its findings,
    or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="hf_fsdp2-verify-") as tmp:
        req, out = Path(tmp) / "request.pt", Path(tmp) / "out.pt"
        torch.save({**request, "offload": str(offload)}, req)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")
        try:
            error = reload_process.run_reload(script, req, out, env)
        except reload_process.ReloadInterrupted as err:  # the verifier was stopped, not the model found wrong
            return {"error": f"{err} before it reached a finding", "interrupted": err.signal_name}
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        if error is not None or not out.is_file():
            return {"error": f"from_pretrained in a fresh process failed: {error or 'no findings written'}"}
        return dict(torch.load(out))


def comparable_config(config: Any) -> dict[str, Any]:
    """A config as a dict, without the keys an export sets itself."""
    return {k: v for k, v in config.to_dict().items() if k not in _CONFIG_KEYS_SET}


# ---------------------------------------------------------------------------------------------------
# All of it
# ---------------------------------------------------------------------------------------------------


def verify_export(
    model: torch.nn.Module,
    folder: str | Path,
    *,
    plan: ExportPlan | None = None,
    dtype: str = "bfloat16",
    atol: float | None = None,
    compute_dtype: torch.dtype | None = None,
    reload_ram_bytes: int = RELOAD_RAM_BYTES,
    source: ExportSource | None = None,
) -> VerifyReport:
    """Check an exported folder against the live model (see the module docstring); raise on any mismatch.

    Every rank must call it (collective).

    Args:
        model: the live model the folder was exported from.
        folder: the exported (or staged) folder.
        plan: the export's plan (from ``plan.make_plan``); rebuilt from ``dtype`` and the folder's index
            when None (a folder exported earlier).
        dtype: the export dtype, used when ``plan`` is None.
        atol: largest probe-logit difference accepted; None = :func:`probe_limit`.
        compute_dtype: dtype the live model computes in; None = its weights' dtype.
        reload_ram_bytes: weights the reload keeps in memory.
        source: the checkpoint the model was loaded from, used when ``plan`` is None (the tensors carried from it
            are compared with its bytes, and every one of its tensors must be in the folder).

    Returns:
        The report (``ok`` is true: a failed check raises).

    Raises:
        ExportVerificationError: naming every check that failed.
        ExportInterrupted: a signal ended the reload before it reached a finding (on every rank).
    """
    folder = Path(folder)
    if plan is None:
        plan = make_plan(model, dtype, max_shard_bytes=2**62, source=source)
        index = folder / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            plan.names = sorted(set(weight_map.values()))
            plan.files = [[k for k, v in weight_map.items() if v == n] for n in plan.names]
    report = VerifyReport()
    report.problems = check_headers(plan, folder)
    if report.ok:
        try:
            tensors, nbytes, problems = readback(plan, folder)
        except Exception as err:
            tensors, nbytes, problems = 0, 0, [f"reading the files back failed: {type(err).__name__}: {err}"]
        gathered = collectives.gather_objects((tensors, nbytes, problems))
        report.tensors = gathered[0][0]
        if plan.carried is not None:
            report.carried, report.source = len(plan.carried.tensors), plan.carried.source.name_or_path
            report.source_tensors = len(plan.carried.source_names)
        report.bytes_compared = sum(g[1] for g in gathered)
        report.problems = [p for g in gathered for p in g[2]]
    compute = compute_dtype_of(model, compute_dtype)
    load_dtype = plan.weights_dtype
    # The tensors written from the shards (the carried ones are compared with the source's bytes instead).
    module_dtypes = {plan.module_names[k]: d for k, d in plan.dtypes.items() if k in plan.module_names}
    load_dtypes = {n: (load_dtype if d.is_floating_point else d) for n, d in module_dtypes.items()}
    boxes = collectives.gather_objects(live_boxes(model, load_dtypes, set(module_dtypes)))
    # The probe runs on every rank (a collective forward) whatever the findings so far.
    config: Any = getattr(model, "config", None)
    vocab = embedding_rows(config) if config is not None else None  # a composite's is in its text config
    if not vocab:
        raise ExportVerificationError(
            "verification needs the vocabulary size (config.vocab_size, or text_config.vocab_size) for its probe batch"
        )
    ids = probe_ids(vocab)
    with rounded_weights(model, module_dtypes):
        live = live_logits(model, ids)
    report.reload_dtype = dtype_name(compute)
    report.logit_scale = float(live.abs().max())
    # The floor until the reload has measured its own rounding noise (rank 0 then raises the limit).
    report.atol = atol if atol is not None else probe_limit(compute, report.logit_scale)
    reference = reference_dtype(compute) if atol is None else None
    found: dict[str, Any] = {}
    if collectives.rank() == 0 and report.ok:
        merged: dict[str, list[Any]] = {}
        for per_rank in boxes:
            for name, items in per_rank.items():
                merged.setdefault(name, []).extend(items)
        request = {
            "folder": str(folder),
            "load_dtype": dtype_name(load_dtype),
            "compute_dtype": dtype_name(compute),
            "reference_dtype": dtype_name(reference) if reference is not None else None,
            "ids": ids,
            "boxes": merged,
            "config": comparable_config(export_config(config, plan.weights_dtype, "")),
            "ignore": sorted(_CONFIG_KEYS_SET),
            "ram": reload_ram_bytes,
            "auto_class": auto_class_name(config),  # a composite's own; a reward model's with its score head
            "trust_remote_code": carries_score_head(config),  # ... from the folder's modeling_score_head.py
        }
        found = reload_in_subprocess(request, folder.parent / f"{folder.name}.verify-offload")
        if atol is None and "noise" in found:
            found["atol"] = probe_limit(
                compute, report.logit_scale, found["noise"], float8=live_float8(model)
            )
        found["reload_problems"], found["max_diff"] = _compare_reload(
            found, model, live, found.get("atol", report.atol)
        )
        found.pop("logits", None)
    # Every rank: rank 0's findings. The others wait here through rank 0's reload (a large model's can outlast
    # ddp_timeout), over the host (gloo) group and its host_wait_timeout, not under NCCL's watchdog.
    found = collectives.broadcast_object(found)
    if found.get("interrupted"):
        raise ExportInterrupted(
            f"the export was stopped by a signal: {found['interrupted']} ended its verification (from_pretrained of "
            f"{folder} in a fresh process) before it reached a finding; this says nothing against the exported files"
        )
    report.problems += found.get("reload_problems", [])
    report.atol = found.get("atol", report.atol)
    report.logit_noise = found.get("noise", float("nan"))
    report.max_logit_diff = found.get("max_diff", float("nan"))
    report.reload_devices = list(found.get("devices", []))
    report.reloaded_tensors = int(found.get("compared", 0))
    report.config_keys = int(found.get("config_keys", 0))
    if not report.ok:
        raise ExportVerificationError(
            f"the export in {folder} does not reproduce the model: " + "; ".join(report.problems[:8])
        )
    return report


def _compare_reload(
    found: dict[str, Any], model: torch.nn.Module, live: torch.Tensor, atol: float
) -> tuple[list[str], float]:
    if "error" in found:
        return [found["error"]], float("nan")
    problems = [f"from_pretrained reported {k}: {v[:5]}" for k, v in found["problems"].items()]
    if found["hf_fsdp2"]:
        problems.append("the reload imported hf_fsdp2; it must load with plain transformers")
    if found["mismatched"]:
        problems.append(
            f"{len(found['mismatched'])} reloaded tensor slices differ from the live model's "
            f"(e.g. {found['mismatched'][:3]})"
        )
    if found["config_diff"]:
        problems.append(f"config.json differs from the live config: {found['config_diff'][:3]}")
    want = type(model).__name__.removeprefix("FSDP")  # what the export wrote in config.json's architectures
    if found.get("architecture") != want:
        problems.append(f"the reload built {found.get('architecture')}, the live model is {want}")
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
            f"probe logits differ from the live model's by up to {max_diff:.4g} > limit {atol:.3g}"
        )
    return problems, max_diff
