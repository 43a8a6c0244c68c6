"""Continued pre-training of an HF causal LM on plain-text documents with FSDP2 through Accelerate.

Loss on every token; no document is truncated or dropped: documents are concatenated (each ending with EOS)
and cut into rows of exactly ``max_length`` tokens, or cut and packed by best fit (``corpus_layout``);
positions restart per document unless ``cross_document_attention: true``; ``streaming: true`` reads a corpus
larger than memory or disk cache, each rank its own slice, resumable exactly (hf_fsdp2/data/corpus.py).

GPU node (8 GPUs):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/cpt.py \
        --config recipes/configs/llama3_8b_cpt.yaml
CPU machine (2 gloo processes):
    torchrun --nproc_per_node 2 recipes/cpt.py --config recipes/configs/cpt_cpu_demo.yaml

The loop, the checkpoints and the export are every method's (hf_fsdp2/run/loop.py); only the data differs
(hf_fsdp2/methods/cpt/).
"""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run

METHOD = get_method("cpt")


def main(argv: list[str] | None = None) -> None:
    # Config (YAML + CLI, validated: the shared sections and the method's own), then the library's loop.
    run(parse_method_config(METHOD, argv), METHOD)


if __name__ == "__main__":
    run_recipe(main)
