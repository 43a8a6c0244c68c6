"""The reward-model recipe's keys (TRL's RewardConfig names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fsdp2.config.plans import check


@dataclass
class RmArgs:
    """A scalar score head trained with the Bradley-Terry loss on preference pairs (recipes/rm.py)."""

    center_rewards_coefficient: float = field(
        default=0.0,
        metadata={"help": "Weight of the centering term (r_c + r_r)^2 (TRL's; 0 = none)."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout of the model to 0 (TRL's default), so rewards are exact."},
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.center_rewards_coefficient >= 0,
            f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0",
        )
