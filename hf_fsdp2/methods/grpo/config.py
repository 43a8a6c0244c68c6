"""The GRPO recipe's keys (recipes/grpo.py), TRL's ``GRPOConfig`` names and defaults (``loss_type: dapo``, ``beta: 0``:
no reference model unless a KL term is asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GrpoArgs:
    """Online RL with verifiable rewards (recipes/grpo.py)."""

    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient to the reference (TRL's default 0: no reference model is loaded)."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={"help": f"One of {', '.join(GRPO_LOSS_TYPES)} (TRL's GRPOConfig names; its default dapo)."},
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "With beta > 0: the reference model folder or hub id; default the model being trained (its weights "
            "as loaded). Ignored with LoRA, whose reference is the base with the adapter disabled."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout of the policy and reference to 0 (TRL's default), so log-probs are exact."
        },
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (a group)."})
    max_completion_length: int = field(default=256, metadata={"help": "New tokens per completion at most."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also scales the scored log-probs)."}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling: the smallest token set of this mass."}
    )
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens (0: all)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound of the ratio: 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping bound: 1 + epsilon_high (default epsilon; DAPO: 0.28)."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimizer updates per generation batch (mu), against the sampler's log-probs."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": f"Advantage scaling: one of {', '.join(SCALE_REWARDS)} (std of the group, the batch, none)."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward functions: exact_match, format, length_penalty, or module:function (TRL signature)."
        },
    )
    reward_weights: list[float] = field(
        default_factory=list, metadata={"help": "One weight per reward function (default 1.0 each)."}
    )
    reward_reference_column: str = field(
        default="answer", metadata={"help": "The dataset column exact_match compares the completion with."}
    )
    reward_format_pattern: str | None = field(
        default=None,
        metadata={"help": "The regular expression the format reward requires the completion to match."},
    )
    rollout_gather: str = field(
        default="full",
        metadata={
            "help": "full: the model gathered once per rollout (fast); layer: gathered per layer and token, for "
            "models whose full copy does not fit beside their shards."
        },
    )
    log_completions: int = field(
        default=4, metadata={"help": "Eval samples (prompt, completion, reward) logged at each eval step."}
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(self.loss_type in GRPO_LOSS_TYPES, f"loss_type={self.loss_type!r} is not a loss of the GRPO recipe: one "
              f"of {', '.join(GRPO_LOSS_TYPES)}")  # fmt: skip
        check(self.beta >= 0, f"beta={self.beta} must be >= 0")
        check(self.num_generations >= 2, f"num_generations={self.num_generations} must be >= 2: a group of one has "
              "no baseline")  # fmt: skip
        check(
            self.max_completion_length >= 1,
            f"max_completion_length={self.max_completion_length} must be >= 1",
        )
        check(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        check(self.top_k >= 0, f"top_k={self.top_k} must be >= 0")
        check(0 <= self.epsilon < 1, f"epsilon={self.epsilon} must be in [0, 1)")
        check(
            self.epsilon_high is None or self.epsilon_high >= 0,
            f"epsilon_high={self.epsilon_high} must be >= 0",
        )
        check(self.num_iterations >= 1, f"num_iterations={self.num_iterations} must be >= 1")
        check(
            self.rollout_gather in ("full", "layer"),
            f"rollout_gather={self.rollout_gather!r} is not full or layer",
        )
        check(self.scale_rewards in SCALE_REWARDS,
              f"scale_rewards={self.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")  # fmt: skip
        check(not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
              f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs: one "
              "weight per function")  # fmt: skip
