"""The package list (everything else is in pyproject.toml): hf_fsdp2 and its subpackages, and two folders of data files
installed inside the package: accelerate_configs/ as ``hf_fsdp2.accelerate_configs`` (so that `hf-fsdp2 train` finds
them in an installed wheel) and the recipe YAMLs of recipes/configs/ as ``hf_fsdp2.recipe_configs``. Training methods run from the library (``python -m hf_fsdp2.methods NAME``); a checkout's
recipes/*.py are short scripts over the same library and need no alias."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["hf_fsdp2", "hf_fsdp2.*"]), "hf_fsdp2.accelerate_configs", "hf_fsdp2.recipe_configs"],
    package_dir={"hf_fsdp2.accelerate_configs": "accelerate_configs", "hf_fsdp2.recipe_configs": "recipes/configs"},
)
