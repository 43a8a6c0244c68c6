"""Reward modelling: an HF causal LM with a scalar score head (``AutoModelForSequenceClassification``, one label),
trained with FSDP2 through Accelerate on preference pairs.

Data: the DPO recipe's ``prompt`` / ``chosen`` / ``rejected`` records (strings or message lists with the chat
template; no prompt column: the common prefix), each with an optional ``margin``; each row is the whole prompt +
completion and its reward the score at its last non-padding token. Loss (TRL's RewardTrainer): per pair
``-logsigmoid(r_chosen - r_rejected - margin)`` + ``center_rewards_coefficient`` x ``(r_chosen + r_rejected)^2``,
the mean over the step's pairs; ``accuracy``, ``margin``, ``mean_reward``, ``std_reward``, ``min_reward`` and
``max_reward`` logged per step. The export (the score head included) reloads with plain
``AutoModelForSequenceClassification.from_pretrained``; ``hf-fsdp2 score --model DIR --data pairs.jsonl`` prints
its accuracy on held-out pairs.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/rm.py --config my_rm.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/rm.py --config recipes/configs/rm_cpu_demo.yaml

The loop, the checkpoints and the verified export are the SFT recipe's (``run`` in recipes/sft.py).
"""

from __future__ import annotations

from hf_fsdp2.recipes.sft import run

from hf_fsdp2.config import parse_config
from hf_fsdp2.trainer.finish import run_recipe
from hf_fsdp2.trainer.reward import build_rm_data, rm_objective


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    run(cfg, build_rm_data, recipe="rm", objective=rm_objective(cfg))


if __name__ == "__main__":
    run_recipe(main)
