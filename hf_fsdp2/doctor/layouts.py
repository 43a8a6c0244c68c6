"""``hf-fsdp2 doctor``'s checks of the parallel layouts a recipe asks for, as the run checks them before any work:
context parallel (the mesh against the world and the heads, a MoE router loss, the kernel the exchange wraps, ring
attention's limits), the layouts against the method's capabilities, and FP8 (its hardware, emulation, compile)."""

from __future__ import annotations

from typing import Any

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.parallel.launch_config import Finding


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


def expert_findings(cfg: Config, plan: Any, *, on_gpu: bool) -> list[Finding]:
    """A mixture of experts: what its experts move per step against expert parallel's proposal
    (:mod:`hf_fsdp2.plan.experts`), and the kernel they run with (:mod:`hf_fsdp2.parallel.grouped_mm`); nothing for a
    dense model or when the plan could not be made."""
    import torch

    from hf_fsdp2.dtypes import MIXED_PRECISION
    from hf_fsdp2.parallel.grouped_mm import experts_kernel
    from hf_fsdp2.plan import human_bytes

    experts = getattr(plan, "experts", None)
    if experts is None:
        return []
    s, run = experts.shapes, experts.current
    value = (
        f"{len(s.layers)} MoE layers x {s.num_experts} experts, {100 * s.share:.0f}% of the parameters, "
        f"ep_size {experts.ep}"
    )
    out: list[Finding] = []
    if experts.proposed is not None:
        best = next(o for o in experts.options if o.ep == experts.proposed)
        out.append(
            Finding(
                level="warning",
                check="experts",
                value=value,
                message=f"flat FSDP2 gathers {human_bytes(run.gathered)} of experts per layer and moves "
                f"{human_bytes(run.step_sent)} per step and rank for them; ep_size {best.ep} would move "
                f"{human_bytes(best.step_sent)} ({best.step_sent / max(run.step_sent, 1):.2f}x)",
                fix=f"set ep_size: {best.ep} (hf-fsdp2 plan lists every ep_size)",
            )
        )
    else:
        out.append(
            Finding(
                level="ok",
                check="experts",
                value=value,
                message=f"{human_bytes(run.step_sent)} per step and rank for the experts",
            )
        )
    capability = torch.cuda.get_device_capability(0) if on_gpu else None
    kernel = experts_kernel(
        s.implementation,
        compiled=cfg.fsdp.compile_plan(on_gpu=on_gpu).enabled,
        compute_dtype=MIXED_PRECISION.get(cfg.train.mixed_precision) or torch.float32,
        device_type="cuda" if on_gpu else "cpu",
        capability=capability,
        expert_parallel=experts.ep > 1,
    )
    out.append(
        Finding(
            level="ok" if kernel.reason is None else "warning",
            check="experts kernel",
            value=kernel.kernel,
            message=f"experts_implementation={kernel.implementation!r}"
            + (f": {kernel.reason}" if kernel.reason else ""),
        )
    )
    return out
