"""``hf-fsdp2 doctor``'s recipe checks, each without training or reading weights: the memory plan against the devices
(with the cheapest fix), the disk for ``save_total_limit`` checkpoints and the export, the output folder (writable,
not another run's, not locked by a live run), the hub target, the dataset (readable, its format, the chat template
it needs) and the decoder-layer class against the model's ``_no_split_modules``. The parallel layouts are checked in
:mod:`hf_fsdp2.doctor.layouts`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.parallel.launch_config import Finding

RECORDS_READ = 50  # records of each source the data check tokenizes


def memory_findings(
    cfg: Config, model_config: Any, *, method: Any, world: int, budget: int | None, device: str
) -> tuple[list[Finding], Any]:
    """The plan's peak per rank against ``budget`` bytes per device (the cheapest settings that fit when it does
    not); also returns the plan (its parameter counts size the disk check)."""
    from hf_fsdp2.plan import (
        DEFAULT_HEADROOM,
        PlanError,
        PlanSettings,
        human_bytes,
        plan_memory,
        recommend,
    )

    try:
        settings = PlanSettings.from_config(cfg, world_size=world, device_type=device, method=method)
        plan = plan_memory(model_config, settings)
    except (PlanError, ConfigError, ValueError) as err:
        return [
            Finding(
                level="error",
                check="memory plan",
                value="not computed",
                message=str(err).splitlines()[0],
                fix="hf-fsdp2 plan says more",
            )
        ], None
    peak = human_bytes(plan.peak)
    if budget is None:
        return [
            Finding(
                level="ok",
                check="memory plan",
                value=f"peak {peak} per rank at world size {world}",
                message="no GPU here to compare with",
                fix="hf-fsdp2 plan --gpu_memory 80GB gives the fit",
            )
        ], plan
    limit = (1 - DEFAULT_HEADROOM) * budget
    if plan.peak <= limit:
        return [
            Finding(
                level="ok",
                check="memory plan",
                value=f"peak {peak} of {human_bytes(budget)} per GPU",
                message="fits",
            )
        ], plan
    tried = recommend(
        model_config,
        settings,
        budget,
        DEFAULT_HEADROOM,
        context_parallel=bool(method is not None and method.capabilities.context_parallel),
        expert_parallel=True,
    )
    fitting = [c for c in tried if c.fits]
    fix = (
        "set "
        + ", ".join(f"{k}: {v}" for k, v in fitting[0].changes.items())
        + f" (peak {human_bytes(fitting[0].plan.peak)})"
        if fitting
        else "nothing on the ladder fits: more GPUs (world size), LoRA (use_peft: true) or a smaller max_length"
    )
    return [
        Finding(
            level="error",
            check="memory plan",
            value=f"peak {peak} of {human_bytes(budget)} per GPU",
            message=f"does not fit with {int(DEFAULT_HEADROOM * 100)}% headroom",
            fix=fix,
        )
    ], plan


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_findings(cfg: Config, plan: Any) -> list[Finding]:
    """Free space at ``output_dir`` against ``save_total_limit`` + 1 checkpoints (weights and AdamW state of the
    trained parameters, in fp32) and the export (every parameter in ``export_dtype``)."""
    from hf_fsdp2.plan import human_bytes

    t, e = cfg.train, cfg.export
    if plan is None:
        return []
    trained = plan.trainable_params if cfg.peft.use_peft else plan.total_params
    kept = 0 if t.save_steps == 0 else (t.save_total_limit or 10) + 1  # one more while the next is written
    checkpoint = trained * 4 * 3  # fp32 weights + AdamW's two moments
    export = (
        plan.total_params * (4 if e.export_dtype == "float32" else 2)
        if not cfg.peft.use_peft
        else trained * 4
    )
    need = kept * checkpoint + export
    where = _existing(Path(t.output_dir or "."))
    free = shutil.disk_usage(where).free
    value = f"{human_bytes(free)} free at {where}, need ~{human_bytes(need)}"
    limit = "all" if not t.save_total_limit else str(t.save_total_limit)
    what = f"{kept} checkpoint(s) of ~{human_bytes(checkpoint)} (save_total_limit {limit}, + 1 in flight) and the export"
    if kept == 0:
        what = "the export (save_steps: 0, no checkpoints)"
    if free < need:
        return [
            Finding(
                level="error",
                check="disk",
                value=value,
                message=what,
                fix="free space, another output_dir, or a lower save_total_limit",
            )
        ]
    if free < 1.2 * need:
        return [
            Finding(
                level="warning",
                check="disk",
                value=value,
                message=what + ": under 20% to spare",
                fix="free space or lower save_total_limit",
            )
        ]
    return [Finding(level="ok", check="disk", value=value, message=what)]


def output_findings(cfg: Config) -> list[Finding]:
    """The output folder: writable, not another run's (unless resuming or overwriting), not locked by a live run."""
    import os

    from hf_fsdp2.checkpoint.run_dir import check_output_dir, lock_holder

    t = cfg.train
    out = Path(t.output_dir or "")
    where = _existing(out)
    if not os.access(where, os.W_OK):
        return [
            Finding(
                level="error",
                check="output_dir",
                value=str(out),
                message=f"{where} is not writable",
                fix="choose a writable output_dir",
            )
        ]
    try:
        check_output_dir(out, overwrite=t.overwrite_output_dir, resume=t.resume_from_checkpoint is not None)
    except ConfigError as err:
        return [Finding(level="error", check="output_dir", value=str(out), message=str(err).splitlines()[0])]
    holder, alive = lock_holder(out)
    if holder and alive:
        return [
            Finding(
                level="error",
                check="output_dir",
                value=str(out),
                message=f"locked by a live run (pid {holder.get('pid')} on "
                f"{holder.get('host')}, started {holder.get('started')})",
                fix="wait for it or choose another",
            )
        ]
    if holder:
        return [
            Finding(
                level="warning",
                check="output_dir",
                value=str(out),
                message=f"a lock left by pid {holder.get('pid')} on "
                f"{holder.get('host')}, which is gone (or on another host): the run takes it over",
                fix="delete it if that run is dead",
            )
        ]
    return [
        Finding(
            level="ok",
            check="output_dir",
            value=str(out),
            message="writable, no other run's files, not locked",
        )
    ]


def hub_findings(cfg: Config) -> list[Finding]:
    """The hub target when the run pushes: a valid repo id and a token, checked offline."""
    from hf_fsdp2.export.hub import HubError, check_can_push

    e = cfg.export
    if not (e.push_to_hub or e.push_checkpoints_to_branch):
        return []
    try:
        check_can_push(e.hub_model_id, e.hub_token)
    except HubError as err:
        return [
            Finding(level="error", check="hub", value=str(e.hub_model_id), message=str(err).splitlines()[0])
        ]
    return [
        Finding(level="ok", check="hub", value=str(e.hub_model_id), message="a valid repo id and a token")
    ]


def data_findings(cfg: Config, method: Any, tokenizer: Any) -> list[Finding]:
    """Each training source read (its first records) and tokenized as the method does (its ``preview_data``, SFT's
    by default): its format, or the error the run would stop on (a missing column or chat template, a bad record),
    named."""
    import datasets

    from hf_fsdp2.data.loading import load_source
    from hf_fsdp2.data.mixture import preview_sft

    d = cfg.data

    def load(source: Any) -> datasets.Dataset:
        raw = load_source(source, on_bad_record=d.on_bad_record)
        return raw.select(range(min(RECORDS_READ, len(raw))))

    preview = method.preview_data or preview_sft
    try:
        return [
            Finding(level="ok", check="data", value=source, message=what)
            for source, what in preview(cfg, tokenizer, load, RECORDS_READ)
        ]
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as err:
        return [
            Finding(
                level="error",
                check="data",
                value=d.dataset_name or "dataset_mixture",
                message=str(err).splitlines()[0],
            )
        ]


def wrap_findings(model_config: Any, settings: Mapping[str, Any], cfg: Config) -> list[Finding]:
    """The decoder-layer classes asked for (the recipe's ``fsdp_layer_cls_to_wrap``, the accelerate config's
    ``fsdp_transformer_layer_cls_to_wrap``) against the model's ``_no_split_modules`` and its modeling module; a
    composite checkpoint's class, units and frozen parts, and what the run refuses for it
    (:func:`~hf_fsdp2.composite.check_composite_run`)."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.composite import check_composite_run, model_class

    f, m = cfg.fsdp, cfg.model
    try:
        spec = check_composite_run(
            model_config,
            tp_size=f.tp_size or 1,
            cp_size=f.cp_size or 1,
        )
    except ConfigError as err:
        return [
            Finding(
                level="error",
                check="composite",
                value=str((getattr(model_config, "architectures", None) or ["?"])[0]),
                message=str(err),
            )
        ]
    try:
        if spec is not None:
            cls = model_class(model_config)
        else:
            cls = AutoModelForCausalLM._model_mapping[type(model_config)]  # type: ignore[attr-defined]
    except (KeyError, ValueError, AttributeError):
        return []
    module = sys.modules.get(cls.__module__)
    # A composite's _no_split_modules is the union over its sub-models: its decoder layer is the table's.
    units = [spec.text_layer] if spec is not None else list(getattr(cls, "_no_split_modules", None) or [])
    out = []
    if spec is not None:
        frozen = [
            part
            for part, on in (
                ("the vision tower", m.freeze_vision_tower),
                ("the multi-modal projector", m.freeze_multi_modal_projector),
            )
            if on
        ]
        out.append(
            Finding(
                level="ok",
                check="composite",
                value=spec.architecture,
                message=f"loaded with its own class; FSDP2 units: each {spec.text_layer}, the {spec.tower_unit}"
                + (f", the {spec.projector_unit}" if spec.projector_unit else " (its projector inside)")
                + (f"; frozen: {' and '.join(frozen)} (never gathered on text rows)" if frozen else ""),
            )
        )
    asked = settings.get("fsdp_transformer_layer_cls_to_wrap")
    named = [
        c.strip() for c in (asked if isinstance(asked, list) else str(asked or "").split(",")) if c.strip()
    ]
    for key, names in (
        ("fsdp_layer_cls_to_wrap", list(cfg.fsdp.fsdp_layer_cls_to_wrap)),
        ("fsdp_transformer_layer_cls_to_wrap", named),
    ):
        unknown = [n for n in names if module is None or not hasattr(module, n)]
        if unknown:
            out.append(
                Finding(
                    level="error",
                    check=key,
                    value=", ".join(names),
                    message=f"{unknown} not in {cls.__name__}'s module",
                    fix=f"one of the model's decoder layers: {units}",
                )
            )
        elif names and not set(names) <= set(units):
            out.append(
                Finding(
                    level="warning",
                    check=key,
                    value=", ".join(names),
                    message=f"not the model's _no_split_modules {units}: the "
                    "units differ from transformers' own split",
                    fix=f"{units}",
                )
            )
        elif names:
            out.append(
                Finding(
                    level="ok", check=key, value=", ".join(names), message=f"{cls.__name__}'s decoder layer"
                )
            )
    if len(out) == (spec is not None):
        out.append(
            Finding(
                level="ok",
                check="wrap",
                value=", ".join(units) or "?",
                message=f"{cls.__name__}'s _no_split_modules: one unit each",
            )
        )
    return out
