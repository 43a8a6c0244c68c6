"""The output sections of a recipe: the export and hub, and what the run reports. Each validates itself."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hf_fsdp2.config.plans import (
    ConfigError,
    check,
    check_trackers_installed,
    parse_report_to,
    parse_size_or_none,
    parse_step_range,
    repo_id_problem,
)


@dataclass(kw_only=True)
class ExportArgs:
    """The consolidated HF folder written at the end, and the hub."""

    export_dtype: Literal["bfloat16", "float32", "float16", "training"] = field(
        default="bfloat16",
        metadata={
            "help": "dtype of the exported safetensors; training = the dtype the weights were trained in."
        },
    )
    max_shard_size: str = field(
        default="5GB", metadata={"help": "Largest safetensors shard, as in save_pretrained."}
    )
    export_verify: bool = field(
        default=True,
        metadata={
            "help": "Check the export before publishing it: keys, shapes, dtypes, values read back bit-exact, "
            "and probe logits of a fresh transformers reload against the live model."
        },
    )
    export_verify_atol: float | None = field(
        default=None,
        metadata={"help": "Largest probe-logit difference accepted; default by dtype (docs/export.md)."},
    )
    eval_harness_tasks: str | None = field(
        default=None,
        metadata={
            "help": "After the verified export, rank 0 runs lm-evaluation-harness on it for these comma-separated "
            "tasks (hf-fsdp2 eval-harness; pip install 'hf_fsdp2[eval]'): eval_harness.json and the model card."
        },
    )
    eval_harness_limit: int | None = field(
        default=None, metadata={"help": "First N items of each eval_harness_tasks task; default all."}
    )
    push_to_hub: bool = field(
        default=False,
        metadata={"help": "Upload the export (with metrics and resolved config) to hub_model_id."},
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Hub repo id to push to (namespace/name)."}
    )
    hub_private_repo: bool | None = field(
        default=None,
        metadata={
            "help": "Create the repo private (true) or public (false); default the namespace's default."
        },
    )
    hub_revision: str | None = field(
        default=None, metadata={"help": "Branch to push the export to (created if missing); default main."}
    )
    hub_commit_message: str | None = field(
        default=None, metadata={"help": "Commit message of the export's push; default names the run."}
    )
    hub_token: str | None = field(
        default=None,
        metadata={
            "help": "Hub token; default HF_TOKEN, then the `hf auth login` token. Never written to disk."
        },
    )
    push_checkpoints_to_branch: str | None = field(
        default=None,
        metadata={
            "help": "Also upload each checkpoint to last-checkpoint/ on this branch, in the background."
        },
    )

    def validate(self, save_steps: int) -> None:
        """Raises ConfigError for keys that cannot work together; the hub token is checked by the recipe."""
        check(
            parse_size_or_none(self.max_shard_size) is not None,
            f"max_shard_size={self.max_shard_size!r} must be a size such as '5GB'",
        )
        check(
            self.export_verify_atol is None or self.export_verify_atol > 0,
            f"export_verify_atol={self.export_verify_atol} must be > 0 (or unset for the default by dtype)",
        )
        if self.eval_harness_tasks:  # said before training, not after it
            import importlib.util

            check(
                importlib.util.find_spec("lm_eval") is not None,
                f"eval_harness_tasks={self.eval_harness_tasks!r} needs lm-evaluation-harness, which is not installed; "
                "pip install 'hf_fsdp2[eval]' (the lm-eval package), or unset eval_harness_tasks",
            )
        check(
            self.eval_harness_limit is None or self.eval_harness_limit > 0,
            f"eval_harness_limit={self.eval_harness_limit} must be > 0 (or unset for every item)",
        )
        for key, on in (
            ("push_to_hub", self.push_to_hub),
            ("push_checkpoints_to_branch", self.push_checkpoints_to_branch),
        ):
            check(
                not on or bool(self.hub_model_id),
                f"{key} needs hub_model_id, the repo to push to (e.g. --hub_model_id my-org/my-model)",
            )
        problem = repo_id_problem(self.hub_model_id) if self.hub_model_id else None
        check(problem is None, problem or "")
        if self.push_checkpoints_to_branch:
            check(
                save_steps > 0,
                f"push_checkpoints_to_branch={self.push_checkpoints_to_branch!r} needs checkpoints: set save_steps > 0",
            )
            check(
                self.push_checkpoints_to_branch != (self.hub_revision or "main"),
                f"push_checkpoints_to_branch={self.push_checkpoints_to_branch!r} is also the export's branch "
                f"(hub_revision={self.hub_revision or 'main'!r}); use another branch, e.g. 'checkpoints'",
            )


@dataclass(kw_only=True)
class ObserveArgs:
    """What the run reports: trackers, evaluation, profiling, debug switches (docs/observability.md)."""

    report_to: str = field(
        default="none",
        metadata={
            "help": "Trackers besides metrics.jsonl (always written): none, all (every one installed), or a "
            "comma list of tensorboard, wandb, trackio."
        },
    )
    run_name: str | None = field(
        default=None, metadata={"help": "Run name in trackers; default output_dir's name."}
    )
    tracker_project: str = field(default="hf_fsdp2", metadata={"help": "wandb / trackio project."})
    eval_steps: int = field(
        default=0,
        metadata={
            "help": "Evaluate every N steps (and at the end) when an eval set is given; 0 = at the end only."
        },
    )
    per_device_eval_batch_size: int | None = field(
        default=None,
        metadata={"help": "Eval examples per batch per rank; default per_device_train_batch_size."},
    )
    eval_prompts: list[str] = field(
        default_factory=list,
        metadata={"help": "Prompts (user turns) completed greedily at each eval and logged as text."},
    )
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Tokens generated per eval prompt."})
    peak_flops: float | None = field(
        default=None,
        metadata={"help": "Peak FLOP/s of one device for MFU; default from the GPU's name (bf16 dense)."},
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "help": "Trace steps 'a-b' with torch.profiler; one Chrome trace per rank in output_dir/profile."
        },
    )
    memory_snapshot_steps: str | None = field(
        default=None,
        metadata={
            "help": "CUDA only: record allocations over steps 'a-b' and dump a memory snapshot per rank."
        },
    )
    distributed_debug: Literal["off", "info", "detail"] = field(
        default="off",
        metadata={
            "help": "Set TORCH_DISTRIBUTED_DEBUG / NCCL_DEBUG (info), plus the NCCL flight recorder (detail)."
        },
    )

    def validate(self, *, has_eval: bool) -> None:
        """Trackers (known and installed), eval, profiling ranges, MFU peak."""
        try:
            check_trackers_installed(parse_report_to(self.report_to))
            parse_step_range(self.profile_steps, "profile_steps")
            parse_step_range(self.memory_snapshot_steps, "memory_snapshot_steps")
        except ValueError as err:
            raise ConfigError(str(err)) from err
        check(
            self.eval_steps >= 0, f"eval_steps={self.eval_steps} must be >= 0 (0 = evaluate at the end only)"
        )
        check(
            self.eval_steps == 0 or has_eval,
            f"eval_steps={self.eval_steps} but there is no eval set; give eval_dataset_name or eval_split_fraction "
            "(e.g. 0.05), or set eval_steps=0",
        )
        check(
            not self.eval_prompts or has_eval,
            "eval_prompts are completed at each eval, but there is no eval set; give eval_dataset_name or "
            "eval_split_fraction",
        )
        check(
            self.per_device_eval_batch_size is None or self.per_device_eval_batch_size >= 1,
            f"per_device_eval_batch_size={self.per_device_eval_batch_size} must be >= 1 (or unset)",
        )
        check(self.eval_max_new_tokens >= 1, f"eval_max_new_tokens={self.eval_max_new_tokens} must be >= 1")
        check(
            self.peak_flops is None or (self.peak_flops > 0 and math.isfinite(self.peak_flops)),
            f"peak_flops={self.peak_flops} must be > 0 FLOP/s of one device (e.g. 989e12 for an H100 SXM in bf16)",
        )
