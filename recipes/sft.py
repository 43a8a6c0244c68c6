"""Supervised fine-tuning of an HF causal LM with FSDP2 through Accelerate.

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py \
        --config recipes/configs/llama3_8b_sft.yaml
CPU machine (2 gloo processes; the same FSDP2 code path):
    accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
        --config recipes/configs/demo_smollm2.yaml
    torchrun --nproc_per_node 2 recipes/sft.py --config recipes/configs/demo_smollm2.yaml
Any key of the YAML can be overridden on the command line: ``--learning_rate 1e-5``.

The run reads top to bottom in hf_fsdp2/run/loop.py (one screen): config -> session (accelerator, run folder)
-> memory plan -> tokenizer -> data -> model (sharded) + optimizer -> schedule -> the method's step -> checkpoints
(resume) -> loop (forward, loss, backward, clip, step, log) -> export. SFT's data and objective are
hf_fsdp2/methods/sft/.
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("sft")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
