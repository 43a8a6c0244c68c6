"""The recipe YAMLs, installed as the data package ``hf_fsdp2.recipe_configs`` (setup.py)."""
