"""KTO (Kahneman-Tversky optimisation) of an HF causal LM with FSDP2 through Accelerate, on unpaired data.

Data: ``prompt`` / ``completion`` / ``label`` records (label true: desirable; strings or message lists with the chat
template), or ``chosen`` / ``rejected`` pairs (unpaired as TRL does); loss on the completions only. Each example's
loss is ``desirable_weight``·(1 − σ(β(r − z0))) or ``undesirable_weight``·(1 − σ(β(z0 − r))) with ``r`` its log-ratio
to the reference and ``z0`` the KL estimate from the micro-batch's prompts paired with other completions
(``loss_type: kto``; ``apo_zero_unpaired`` has no KL term); the loss is the mean over the step's examples, and kl,
rewards/chosen, rewards/rejected, rewards/margins, logps/* are logged per step as TRL names them. The reference is
DPO's: a frozen sharded copy, ``precompute_ref_log_probs``, or with LoRA the base with the adapter disabled.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/kto.py --config my_kto.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/kto.py --config recipes/configs/kto_cpu_demo.yaml

The loop, the checkpoints and the verified export are every method's (hf_fsdp2/run/loop.py); this
method's config, data and objective are hf_fsdp2/methods/kto/.
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("kto")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
