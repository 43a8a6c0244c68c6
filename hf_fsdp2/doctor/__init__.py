"""``hf-fsdp2 doctor``: the pitfalls of sharded training caught in seconds, before a run starts (no training, no
weights read). Three sections, one :class:`~hf_fsdp2.parallel.launch_config.Finding` per line (ok / warning /
error, the value, the fix): the environment (:mod:`.environment`), the accelerate config read as FSDP2
(:mod:`hf_fsdp2.parallel.launch_config`, the same mapping every launch logs) and the recipe (:mod:`.recipe`).
docs/fsdp2-guide.md links each pitfall to the check that catches it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_fsdp2.methods import get_method
from hf_fsdp2.parallel.launch_config import Finding


@dataclass
class Report:
    """The findings of each section, in order."""

    sections: dict[str, list[Finding]] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return sum(f.level == "error" for found in self.sections.values() for f in found)

    @property
    def warnings(self) -> int:
        return sum(f.level == "warning" for found in self.sections.values() for f in found)

    def text(self) -> str:
        lines = []
        for name, found in self.sections.items():
            lines.append(f"== {name}")
            lines += [f.line() for f in found] or ["ok      (nothing to check)"]
        lines.append(f"== {self.errors} error(s), {self.warnings} warning(s)")
        return "\n".join(lines)

    def as_json(self) -> dict[str, object]:
        return {
            "errors": self.errors,
            "warnings": self.warnings,
            "sections": {k: [f.as_dict() for f in v] for k, v in self.sections.items()},
        }


def run_doctor(
    recipe_argv: list[str] | None,
    accelerate_config: str | Path | None,
    *,
    recipe: str = "sft",
    environ: Mapping[str, str] | None = None,
) -> Report:
    """Every check that applies: the environment always; the accelerate config when given; the recipe when
    ``recipe_argv`` (``--config r.yaml`` and overrides) is given."""
    import torch

    from hf_fsdp2.config import ConfigError, parse_config
    from hf_fsdp2.doctor.environment import cuda_findings, debug_findings, version_findings
    from hf_fsdp2.methods import parse_method_config
    from hf_fsdp2.parallel.launch_config import fsdp_findings, read_accelerate_config

    environ = os.environ if environ is None else environ
    report = Report()
    settings: dict[str, Any] = {}
    accel: list[Finding] = []
    if accelerate_config is not None:
        try:
            settings = read_accelerate_config(accelerate_config)
        except ValueError as err:
            accel.append(
                Finding(
                    level="error", check="accelerate config", value=str(accelerate_config), message=str(err)
                )
            )
    processes = settings.get("num_processes")
    machines = int(settings.get("num_machines") or 1)
    per_node = int(processes) // machines if processes else None
    use_cpu = settings.get("use_cpu") if "use_cpu" in settings else None
    report.sections["environment"] = [
        *version_findings(),
        *cuda_findings(per_node, use_cpu=use_cpu),
        *debug_findings(environ, machines),
    ]
    cfg = None
    recipe_found: list[Finding] = []
    if recipe_argv is not None:
        try:
            cfg = parse_method_config(recipe, recipe_argv)
        except (ConfigError, FileNotFoundError, ValueError) as err:
            recipe_found.append(
                Finding(
                    level="error",
                    check="recipe",
                    value=" ".join(recipe_argv),
                    message=str(err).splitlines()[0],
                )
            )
    if settings:
        from hf_fsdp2.parallel.accelerator import describe_policy, mixed_precision_policy

        base = (
            cfg
            if cfg is not None
            else parse_config(["--model_name_or_path", "-", "--dataset_name", "-", "--output_dir", "-"])
        )
        accel += fsdp_findings(settings, base)
        t, f = base.train, base.fsdp
        policy = describe_policy(mixed_precision_policy(t.mixed_precision, f.fsdp_reduce_dtype))
        accel.append(
            Finding(level="ok", check="FSDP2 mixed precision", value=t.mixed_precision, message=policy)
        )
        offload = "parameters, gradients and AdamW state in host memory" if f.fsdp_cpu_offload else "off"
        accel.append(
            Finding(
                level="ok", check="FSDP2 CPU offload", value=str(f.fsdp_cpu_offload).lower(), message=offload
            )
        )
    if accelerate_config is not None:
        report.sections[f"accelerate config {accelerate_config}"] = accel
    if cfg is not None:
        recipe_found += _recipe_findings(cfg, recipe, settings, processes, torch.cuda.is_available())
    if recipe_argv is not None:
        report.sections[f"recipe ({recipe})"] = recipe_found
    return report


def _recipe_findings(
    cfg: Any, recipe: str, settings: Mapping[str, Any], processes: Any, on_gpu: bool
) -> list[Finding]:
    """The recipe's checks (:mod:`.recipe`) at the world size the accelerate config asks for (else the GPUs here)."""
    import torch

    from hf_fsdp2.doctor.layouts import (
        capability_findings,
        context_parallel_findings,
        expert_findings,
        float8_findings,
    )
    from hf_fsdp2.doctor.recipe import (
        data_findings,
        disk_findings,
        hub_findings,
        memory_findings,
        output_findings,
        wrap_findings,
    )
    from hf_fsdp2.model import load_tokenizer
    from hf_fsdp2.plan import PlanError, read_model_config

    m = cfg.model
    out: list[Finding] = []
    try:  # the method's own checks of its keys, as its launch does before any work
        get_method(recipe).objective(cfg)
    except (ValueError, ImportError) as err:
        return [Finding(level="error", check="recipe", value=recipe, message=str(err).splitlines()[0])]
    try:
        model_config = read_model_config(
            m.model_name_or_path or "", revision=m.model_revision, trust_remote_code=m.trust_remote_code
        )
    except (PlanError, OSError, ValueError) as err:
        return [
            Finding(
                level="error",
                check="model",
                value=str(m.model_name_or_path),
                message=str(err).splitlines()[0],
            )
        ]
    world = int(processes) if processes else (torch.cuda.device_count() if on_gpu else 1)
    budget = torch.cuda.get_device_properties(0).total_memory if on_gpu else None
    found, plan = memory_findings(
        cfg,
        model_config,
        method=get_method(recipe),
        world=world,
        budget=budget,
        device="cuda" if on_gpu else "cpu",
    )
    out += found
    out += capability_findings(cfg, method=get_method(recipe), world=world)
    out += context_parallel_findings(cfg, model_config, method=get_method(recipe), world=world)
    out += float8_findings(cfg, on_gpu, get_method(recipe))
    out += expert_findings(cfg, plan, on_gpu=on_gpu)
    out += wrap_findings(model_config, settings, cfg)
    out += disk_findings(cfg, plan)
    out += output_findings(cfg)
    out += hub_findings(cfg)
    try:
        tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.model_name_or_path or "",
            revision=m.model_revision,
            trust_remote_code=m.trust_remote_code,
        )
    except (OSError, ValueError) as err:
        return [
            *out,
            Finding(
                level="error",
                check="tokenizer",
                value=str(m.model_name_or_path),
                message=str(err).splitlines()[0],
            ),
        ]
    out += data_findings(cfg, get_method(recipe), tokenizer)
    return out
