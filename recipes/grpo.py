"""GRPO (group relative policy optimisation) of an HF causal LM with FSDP2 through Accelerate: online RL with
verifiable rewards.

Data: ``prompt`` records (strings, or message lists rendered with the chat template and the generation prompt); the
other columns go to the reward functions. Each step, every rank samples ``num_generations`` completions of each of
its prompts from the current policy (the sharded policy gathered once for the rollout, transformers' ``generate``
with its KV cache), scores them with ``reward_funcs`` (built-ins or ``module:function``, weighted), normalises the
rewards per prompt group (``scale_rewards``) and trains on the clipped surrogate loss (``loss_type`` grpo, dr_grpo or
dapo; ``epsilon``/``epsilon_high``; ``num_iterations`` updates per generation batch; ``beta``: KL to the reference,
the LoRA base or a frozen sharded copy). TRL's GRPOTrainer names and formulas; docs/grpo.md.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --config my_grpo.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/grpo.py --config my_grpo.yaml

The loop, the checkpoints and the verified export are every method's (hf_fsdp2/run/loop.py); this
method's config, data and objective are hf_fsdp2/methods/grpo/.
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("grpo")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
