"""A training method defined outside hf_fsdp2: a config section of its own, SFT's data, an objective of its own (SFT's
token loss in the shared step skeleton, with a metric of the method's), registered with one call and run by the
library's loop like any built-in method (tests/unit/test_methods.py launches it on 2 ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_fsdp2.config.plans import check
from hf_fsdp2.methods import get_method, parse_method_config, register
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run
from hf_fsdp2.run.method import Method, Objective, loss_step
from hf_fsdp2.train.step import TokenLoss


@dataclass
class ToyArgs:
    """The toy method's keys."""

    toy_weight: float = field(
        default=1.0, metadata={"help": "A number the method logs as toy/weight each step."}
    )

    def validate(self) -> None:
        check(self.toy_weight > 0, f"toy_weight={self.toy_weight} must be > 0")


class ToyLoss(TokenLoss):
    """SFT's token loss and the toy's metric."""

    weight = 1.0

    def metrics(self, micro_batches: int) -> dict[str, float]:
        return {**super().metrics(micro_batches), "toy/weight": self.weight}


def _build(session: Any, model: Any, optimizer: Any, scheduler: Any, data: Any) -> tuple[Any, Any]:
    def new_loss() -> ToyLoss:
        loss = ToyLoss(model.loss_plan, session.device, model.module)
        loss.weight = session.cfg.method.toy_weight
        return loss

    return loss_step(session, model, optimizer, scheduler, new_loss), None


TOY = register(
    Method(
        name="toy",
        title="a toy method registered from outside",
        build_data=get_method("sft").build_data,
        objective=lambda cfg: Objective(_build),
        section=ToyArgs,
    )
)


def main(argv: list[str] | None = None) -> None:
    run(parse_method_config(TOY, argv), TOY)


if __name__ == "__main__":
    run_recipe(main)
