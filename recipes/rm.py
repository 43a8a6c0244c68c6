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

The loop, the checkpoints and the verified export are every method's (hf_fsdp2/run/loop.py); this
method's config, data and objective are hf_fsdp2/methods/rm/.
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("rm")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
