"""``hf-fsdp2 doctor``'s recipe checks, each without training or reading weights: the memory plan against the devices
(with the cheapest fix), the disk for ``save_total_limit`` checkpoints and the export, the output folder (writable,
not another run's, not locked by a live run), the hub target, the dataset (readable, its format, the chat template
it needs) and the decoder-layer class against the model's ``_no_split_modules``."""

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
            freeze_vision_tower=m.freeze_vision_tower,
            freeze_multi_modal_projector=m.freeze_multi_modal_projector,
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


def context_parallel_findings(cfg: Config, model_config: Any, *, method: Any, world: int) -> list[Finding]:
    """The context-parallel layout (``cp_size > 1``) checked as the run checks it before any work: the mesh against
    the world size and the heads (:func:`~hf_fsdp2.config.plans.check_mesh`, :func:`~hf_fsdp2.config.plans.split_heads`),
    the method (:func:`~hf_fsdp2.run.registry.check_capabilities`, as :func:`capability_findings` reports it), a MoE
    router loss (refused by the run's model build) and the attention kernel the all-to-all wraps. Nothing when the
    recipe asks for no context parallel.
    """
    from hf_fsdp2.config.plans import check_mesh, split_heads
    from hf_fsdp2.methods import method_names
    from hf_fsdp2.parallel.accelerator import launcher_mesh
    from hf_fsdp2.parallel.all_to_all import INNER_KERNELS
    from hf_fsdp2.run.registry import supporting
    from hf_fsdp2.train.loss import router_aux_coef

    f, m = cfg.fsdp, cfg.model
    asked = f.cp_size if f.cp_size is not None else launcher_mesh().get("cp_size")
    if not asked or asked == 1:
        return []
    supported = supporting("context_parallel")
    refusing = [n for n in method_names() if n not in supported]
    recipes = f"{', '.join(supported)} support it; {', '.join(refusing)} refuse it"
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    try:
        mesh = f.mesh_plan(world, launcher_mesh())
        check_mesh(mesh, heads=heads, kv_heads=kv_heads, max_length=cfg.data.max_length)
    except ConfigError as err:
        return [
            Finding(
                level="error",
                check="context parallel",
                value=f"cp_size {asked} at world size {world}",
                message=str(err).splitlines()[0],
            )
        ]
    unsupported = not method.capabilities.context_parallel or (
        mesh.cp_backend == "ring" and not method.capabilities.ring_attention
    )
    if unsupported:  # refused: capability_findings says so, with the reason
        return []
    out: list[Finding] = []
    coef = router_aux_coef(model_config)
    if coef:
        out.append(
            Finding(
                level="error",
                check="context parallel",
                value=f"cp_size {mesh.cp} with a MoE router loss (output_router_logits"
                f"=true, router_aux_loss_coef={coef:g})",
                message="the load-balancing loss is a product of per-expert "
                "fractions over a micro-batch's tokens; each context-parallel rank sees only its part of them",
                fix="set output_router_logits=false in the model config or cp_size=1",
            )
        )
    kernel = m.attn_implementation
    if mesh.cp_backend == "ring":  # the run's own start-up check; CUDA is the run's node's, not this one's
        from hf_fsdp2.attention_layout import method_rows
        from hf_fsdp2.parallel.ring import check_ring_settings

        packing, padding_free = method_rows(cfg.data, method.batch_rows)
        try:
            check_ring_settings(
                on_gpu=True,
                packing=packing,
                padding_free=padding_free,
                attn_implementation=kernel,
                model_config=model_config,
            )
        except ConfigError as err:
            out.append(
                Finding(
                    level="error",
                    check="context parallel",
                    value=f"cp_size {mesh.cp} with cp_backend ring",
                    message=str(err),
                )
            )
    elif kernel != "auto" and kernel not in INNER_KERNELS:
        out.append(
            Finding(
                level="error",
                check="context parallel",
                value=f"cp_size {mesh.cp} with attn_implementation {kernel}",
                message=f"the all-to-all wraps {', '.join(INNER_KERNELS)}",
                fix="set attn_implementation to sdpa (or flash_attention_2 on GPU)",
            )
        )
    if out:
        return out
    data_ranks = mesh.world // (mesh.cp * mesh.tp)
    # Per tensor-parallel rank, as check_mesh splits them.
    split = (
        split_heads(int(heads) // mesh.tp, int(kv_heads) // mesh.tp if kv_heads else None, mesh.cp)
        if heads and mesh.cp_backend != "ring"
        else None
    )
    part = -(-cfg.data.max_length // mesh.cp)
    what = (
        f"each sequence over {mesh.cp} ranks ({part} of max_length {cfg.data.max_length} tokens each), "
        f"{data_ranks} data-parallel ranks (world {mesh.world} / cp {mesh.cp}), parameters sharded over "
        f"{mesh.fsdp_shard} ranks (dp_shard {mesh.dp_shard} x cp {mesh.cp})"
        + (f"; {split.describe()}" if split else "")
        + ("; ring attention: CUDA, SDPA, causal rows only" if mesh.cp_backend == "ring" else "")
        + f"; {recipes}"
    )
    return [
        Finding(
            level="ok", check="context parallel", value=f"cp_size {mesh.cp} ({mesh.cp_backend})", message=what
        )
    ]


def capability_findings(cfg: Config, *, method: Any, world: int) -> list[Finding]:
    """The layouts the recipe asks for (context parallel, ring attention, tensor parallel, FP8) against what its
    method supports: the run's own check (:func:`~hf_fsdp2.run.registry.check_capabilities`) and message. Nothing
    when it asks for none; a mesh that does not fit the world is :func:`context_parallel_findings`'s to report."""
    from hf_fsdp2.parallel.accelerator import launcher_mesh
    from hf_fsdp2.run.registry import asked_layouts, check_capabilities

    try:
        mesh = cfg.fsdp.mesh_plan(world, launcher_mesh())
    except ConfigError:
        return []
    asked = asked_layouts(cfg, mesh)
    if not asked:
        return []
    names = ", ".join(layout.replace("_", " ") for layout in asked)
    try:
        check_capabilities(method, cfg, mesh)
    except ConfigError as err:
        return [
            Finding(
                level="error",
                check="layouts",
                value=f"{names} with the {method.name} recipe",
                message=str(err),
            )
        ]
    return [
        Finding(level="ok", check="layouts", value=names, message=f"supported by the {method.name} recipe")
    ]


def float8_findings(cfg: Config, on_gpu: bool, method: Any = None) -> list[Finding]:
    """``mixed_precision=fp8`` before a run: refused for a recipe that does not support it, or without FP8 hardware
    unless ``fp8_emulate`` (the run's own checks and messages), a warning when emulated or not compiled; nothing for
    other runs."""
    import torch

    from hf_fsdp2.parallel.float8 import check_float8_hardware, warn_without_compile

    t = cfg.train
    if t.mixed_precision != "fp8":
        return []
    plan = t.float8_plan()
    value = f"{plan.recipe}, all-gather {'float8' if plan.all_gather else 'bf16'}"
    if (
        method is not None and not method.capabilities.float8
    ):  # refused: capability_findings says so, with why
        return []
    try:
        emulated = check_float8_hardware(plan, torch.device("cuda" if on_gpu else "cpu"))
    except ConfigError as err:
        return [Finding(level="error", check="fp8", value=value, message=str(err))]
    out = [Finding(level="warning", check="fp8", value=value, message=emulated)] if emulated else []
    slow = warn_without_compile(cfg.fsdp.compile_plan(on_gpu=on_gpu).enabled)
    if slow:
        out.append(
            Finding(
                level="warning", check="fp8 compile", value=str(cfg.fsdp.torch_compile).lower(), message=slow
            )
        )
    return out or [
        Finding(
            level="ok",
            check="fp8",
            value=value,
            message="FP8 hardware; decoder-layer linears in float8, compiled",
        )
    ]
