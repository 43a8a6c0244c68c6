"""The plan at the start of a run (:func:`log_run_plan`: the table in the log, a warning when the peak does
not fit the GPU) and what the command and the run share: the model config a plan is made from
(:func:`read_model_config`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_fsdp2.config.plans import ConfigError
from hf_fsdp2.plan.settings import DEFAULT_HEADROOM, GIB, PlanError, PlannedMethod, PlanSettings
from hf_fsdp2.plan.table import MemoryPlan, format_plan, human_bytes, plan_memory

if TYPE_CHECKING:
    from hf_fsdp2.config import Config

logger = logging.getLogger("hf_fsdp2")


def read_model_config(
    model_name_or_path: str,
    *,
    model_config: str | Path | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """The config the plan is made from: ``model_config`` (a config.json file, or a folder holding one) when
    given, else the recipe's ``model_name_or_path`` (a local folder, or a hub id read from the hub's cache).

    Raises:
        PlanError: no config can be read; the message names the source and the fix.
    """
    from transformers import AutoConfig

    from hf_fsdp2.model import load_model_config

    if model_config is not None:
        path = Path(model_config).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise PlanError(
                f"--model_config {str(model_config)!r}: no such file; give a model's config.json or a folder "
                "holding one"
            )
        try:
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as err:
            raise PlanError(
                f"--model_config {str(model_config)!r} is not a transformers config.json: {err}"
            ) from err
    try:
        return load_model_config(model_name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except FileNotFoundError as err:
        raise PlanError(str(err)) from err
    except (OSError, ValueError) as err:
        raise PlanError(
            f"model_name_or_path={model_name_or_path!r} is no local folder here, and read as a hub id its "
            f"config.json could not be fetched ({str(err).splitlines()[0]}; offline: HF_HUB_OFFLINE=1, or no "
            "network). Give the config another way: --model_config path/to/config.json (or a local model "
            "folder), or --model_name_or_path <local folder>"
        ) from err


def _describe_error(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return text if isinstance(err, (PlanError, ConfigError)) else f"{type(err).__name__}: {text}"


def memory_warning(peak: int, total: int, world_size: int, headroom: float = DEFAULT_HEADROOM) -> str | None:
    """The start-of-run warning when the predicted ``peak`` does not fit a GPU of ``total`` bytes as
    ``hf-fsdp2 plan`` says "fits" (at most ``(1 - headroom) x total``), else None."""
    limit = total * (1 - headroom)
    if peak <= limit:
        return None
    return (
        f"the predicted peak {human_bytes(peak)} per rank exceeds {1 - headroom:.0%} of this GPU's {human_bytes(total)} "
        f"({human_bytes(limit)}; the rest is kept for the CUDA context, NCCL and fragmentation): the run will "
        f"likely fail with out-of-memory; `hf-fsdp2 plan --config <recipe> --world_size {world_size} "
        f"--gpu_memory {total // GIB}GiB` lists settings that fit"
    )


def log_run_plan(
    cfg: Config,
    model_config: Any,
    *,
    world_size: int,
    device: torch.device,
    method: PlannedMethod | None = None,
) -> MemoryPlan | None:
    """Log the plan of the run starting now, and warn when its peak does not fit the GPU with the recommender's
    headroom (:func:`memory_warning`).

    Call it on rank 0 only: it runs no collective and reads no weight (a meta model at the run's shape), and the
    global RNG state is restored after it. It never fails the run: anything that stops the plan is logged as one
    warning line and ``None`` returned (the plan is advice, not a check). ``method`` says how many rows an example
    is (a DPO pair: 2) and adds its notes (what the plan leaves out, GRPO's rollout phase); None: SFT's.

    Returns:
        The plan, or None when it could not be made.
    """
    from hf_fsdp2.parallel.accelerator import launcher_mesh

    try:
        with torch.random.fork_rng(devices=[]):
            settings = PlanSettings.from_config(
                cfg, world_size=world_size, device_type=device.type, launcher=launcher_mesh(), method=method
            )
            plan = plan_memory(model_config, settings)
    except Exception as err:  # noqa: BLE001 - advice only: the run goes on whatever the planner meets
        logger.warning("memory plan unavailable (the run goes on): %s", _describe_error(err))
        return None
    notes = method.plan_notes(cfg, plan, model_config) if method is not None else []
    for line in [*format_plan(plan).splitlines(), *notes]:
        logger.info(line)
    if device.type == "cuda":
        warning = memory_warning(plan.peak, torch.cuda.get_device_properties(device).total_memory, world_size)
        if warning:
            logger.warning(warning)
    return plan
