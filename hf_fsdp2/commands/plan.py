"""``hf-fsdp2 plan``: the per-rank memory of a recipe and the cheapest settings that fit a GPU
(:mod:`hf_fsdp2.plan`, docs/memory-plan.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, recipe_argv, user_error
from hf_fsdp2.methods import method_names


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from hf_fsdp2.config import ConfigError
    from hf_fsdp2.config.plans import parse_size_or_none
    from hf_fsdp2.methods import get_method, parse_method_config
    from hf_fsdp2.parallel.accelerator import launcher_mesh
    from hf_fsdp2.plan import (
        PlanError,
        PlanSettings,
        format_plan,
        format_recommendation,
        plan_memory,
        read_model_config,
        recommend,
    )
    from hf_fsdp2.run.registry import check_capabilities

    argv = recipe_argv(args)
    budget = None
    try:
        if args.gpu_memory is not None:
            budget = parse_size_or_none(args.gpu_memory)
            if budget is None:
                raise PlanError(
                    f"--gpu_memory {args.gpu_memory!r} is not a size; give one such as 80GB or 141GiB"
                )
        if not 0 <= args.headroom < 1:
            raise PlanError(f"--headroom {args.headroom} must be in [0, 1), e.g. 0.1")
        if args.world_size < 1:
            raise PlanError(f"--world_size {args.world_size} must be >= 1")
        method = get_method(args.recipe)
        cfg = parse_method_config(method, argv)
        m = cfg.model
        model_config = read_model_config(
            m.model_name_or_path or "",
            model_config=args.model_config,
            revision=m.model_revision,
            trust_remote_code=m.trust_remote_code,
        )
        settings = PlanSettings.from_config(
            cfg, world_size=args.world_size, device_type=args.device, method=method
        )
        # The run's refusal of a layout the method does not support (cp, ring, tp, fp8).
        check_capabilities(method, cfg, cfg.fsdp.mesh_plan(args.world_size, launcher_mesh()))
        if budget is None and args.device == "cuda" and torch.cuda.is_available():  # this machine's GPU
            budget = torch.cuda.get_device_properties(0).total_memory
        tried = (
            recommend(
                model_config,
                settings,
                budget,
                args.headroom,
                context_parallel=method.capabilities.context_parallel,
                expert_parallel=True,
            )
            if budget
            else []
        )
        same = [c.plan for c in tried if c.plan.settings == settings]  # the recipe's own settings, if tried
        plan = same[0] if same else plan_memory(model_config, settings)
    except (PlanError, ConfigError) as err:
        return user_error("plan", err)
    if args.json:
        out = plan.to_json()
        if budget:
            out.update(
                budget=budget,
                headroom=args.headroom,
                recommendation=[{"changes": c.changes, "peak": c.plan.peak, "fits": c.fits} for c in tried],
            )
        print(json.dumps(out))
        return 0
    notes = method.plan_notes(cfg, plan, model_config)
    print("\n".join([format_plan(plan), *notes]))
    if budget:
        print(format_recommendation(tried, budget, args.headroom))
    return 0


def register_plan(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory of a recipe (parameters, gradients, optimizer, FSDP buffers, activations, peak) "
        "and the cheapest settings that fit a GPU",
        description=(
            "Build the recipe's model from its config on the meta device (no weights read), compute what each "
            "rank holds (sharded parameters, gradients and AdamW state, FSDP2 buffers) and run one forward + "
            "backward at the micro-batch shape to count the activations the checkpointing mode keeps, the loss "
            "and the working set; print the table and, given --gpu_memory, the cheapest settings that fit. Any "
            "recipe key can be overridden after the options: hf-fsdp2 plan --config r.yaml --max_length 4096. "
            "docs/memory-plan.md says what is exact and what is approximate."
        ),
    )
    p.add_argument("--config", type=Path, default=None, help="the recipe YAML (as given to recipes/sft.py)")
    p.add_argument(
        "--world_size",
        "--world-size",
        dest="world_size",
        type=int,
        default=1,
        help="processes of the run (default: 1)",
    )
    p.add_argument(
        "--gpu_memory",
        "--gpu-memory",
        dest="gpu_memory",
        default=None,
        help="memory per GPU, e.g. 80GB (decimal, 80e9 bytes) or 141GiB: adds the cheapest settings that fit "
        "(default: this machine's GPU, if any)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --gpu_memory kept free for the CUDA context, NCCL and allocator fragmentation "
        "(default: 0.1)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="where the run computes: picks the attention kernel (default: cuda)",
    )
    p.add_argument(
        "--model_config",
        "--model-config",
        dest="model_config",
        default=None,
        help="the model's config.json (or a folder holding one), read instead of model_name_or_path's: "
        "plans a hub model offline",
    )
    p.add_argument(
        "--recipe",
        choices=method_names(),
        default="sft",
        help="the recipe the config is for: dpo and rm run 2 rows per pair; kto 1 with gradient; grpo "
        "micro-batches of completions and its rollout phase (default: sft)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    # Any other --key value pairs are recipe overrides, collected by main() (parse_known_args).
    p.set_defaults(func=_run_plan, overrides=[])
