"""Direct preference optimisation of an HF causal LM with FSDP2 through Accelerate (after SFT).

Data: ``prompt`` / ``chosen`` / ``rejected`` records (strings or message lists with the chat template; no prompt
column: the common prefix), loss on the completions only. Each micro-batch of B pairs is one forward of 2B rows;
the loss (``loss_type`` sigmoid, ipo, robust, hinge; ``beta``, ``label_smoothing``) is the mean over the step's
pairs, and rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/* are logged per step as
TRL names them. The reference: a frozen sharded copy, ``precompute_ref_log_probs``, or with LoRA the base with
the adapter disabled (hf_fsdp2/methods/dpo/objective.py).

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/dpo.py \
        --config recipes/configs/llama3_8b_dpo.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/dpo.py --config recipes/configs/dpo_cpu_demo.yaml

The loop, the checkpoints and the verified export are every method's (hf_fsdp2/run/loop.py); this
method's config, data and objective are hf_fsdp2/methods/dpo/.
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("dpo")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
