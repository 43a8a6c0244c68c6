"""Direct preference optimisation of an HF causal LM with FSDP2 through Accelerate (after SFT).

Data: ``prompt`` / ``chosen`` / ``rejected`` records (strings or message lists with the chat template; no prompt
column: the common prefix), loss on the completions only. Each micro-batch of B pairs is one forward of 2B rows;
the loss (``loss_type`` sigmoid, ipo, robust, hinge; ``beta``, ``label_smoothing``) is the mean over the step's
pairs, and rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/* are logged per step as
TRL names them. The reference: a frozen sharded copy, ``precompute_ref_log_probs``, or with LoRA the base with
the adapter disabled (hf_fsdp2/trainer/preference.py).

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/dpo.py \
        --config recipes/configs/llama3_8b_dpo.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/dpo.py --config recipes/configs/dpo_cpu_demo.yaml

The loop, the checkpoints and the verified export are the SFT recipe's (``run`` in recipes/sft.py).
"""

from __future__ import annotations

from hf_fsdp2.recipes.sft import run

from hf_fsdp2.config import parse_config
from hf_fsdp2.trainer.dpo_data import build_dpo_data
from hf_fsdp2.trainer.finish import run_recipe
from hf_fsdp2.trainer.preference import dpo_objective


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    run(cfg, build_dpo_data, recipe="dpo", objective=dpo_objective(cfg))


if __name__ == "__main__":
    run_recipe(main)
