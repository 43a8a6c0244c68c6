"""The recipes: runnable training scripts (``sft``, ``cpt``, ``dpo``), each a short script over the library
with its loop in view; ``configs/`` holds their YAML recipes. Installed as ``hf_fsdp2.recipes``."""
