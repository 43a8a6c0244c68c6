"""Configuration: the recipe's sections (one dataclass per concern, each validating itself and building the
settings its module applies), the settings objects, data-source specs, and YAML + CLI parsing.

The bottom of the package tree: nothing here imports another hf_fsdp2 package.

The names below load on first use (PEP 562): a command that needs one small module of the package (``hf-fsdp2
push`` reads :mod:`hf_fsdp2.config.plans`) does not import transformers through :mod:`hf_fsdp2.config.parse`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_fsdp2.config.outputs import ExportArgs, ObserveArgs
    from hf_fsdp2.config.parse import (
        CONFIG_NAME,
        SECTIONS,
        Config,
        known_keys,
        load_yaml,
        parse_config,
        save_config,
    )
    from hf_fsdp2.config.peft import PeftArgs
    from hf_fsdp2.config.plans import ConfigError, parse_size
    from hf_fsdp2.config.restarts import RestartArgs
    from hf_fsdp2.config.sections import DataArgs, ModelArgs
    from hf_fsdp2.config.training import FSDPArgs, TrainArgs

_HOME = {
    "ExportArgs": "outputs",
    "ObserveArgs": "outputs",
    "CONFIG_NAME": "parse",
    "SECTIONS": "parse",
    "Config": "parse",
    "known_keys": "parse",
    "load_yaml": "parse",
    "parse_config": "parse",
    "save_config": "parse",
    "PeftArgs": "peft",
    "ConfigError": "plans",
    "parse_size": "plans",
    "RestartArgs": "restarts",
    "DataArgs": "sections",
    "ModelArgs": "sections",
    "FSDPArgs": "training",
    "TrainArgs": "training",
}

__all__ = [
    "CONFIG_NAME",
    "Config",
    "ConfigError",
    "DataArgs",
    "ExportArgs",
    "FSDPArgs",
    "ModelArgs",
    "ObserveArgs",
    "PeftArgs",
    "RestartArgs",
    "SECTIONS",
    "TrainArgs",
    "known_keys",
    "load_yaml",
    "parse_config",
    "parse_size",
    "save_config",
]


def __getattr__(name: str) -> Any:
    """``from hf_fsdp2.config import TrainArgs`` imports the one module that defines it."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value
