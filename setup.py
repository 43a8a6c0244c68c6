"""The package list (everything else is in pyproject.toml): hf_fsdp2 and its subpackages, and the recipes of
recipes/ installed as ``hf_fsdp2.recipes`` and the accelerate configs as ``hf_fsdp2.accelerate_configs``, so that `hf-fsdp2 train` finds them in an installed wheel while a
checkout runs them from recipes/ as they are (`accelerate launch recipes/sft.py ...`)."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["hf_fsdp2", "hf_fsdp2.*"]),
        "hf_fsdp2.recipes",
        "hf_fsdp2.accelerate_configs",
    ],
    package_dir={"hf_fsdp2.recipes": "recipes", "hf_fsdp2.accelerate_configs": "accelerate_configs"},
)
