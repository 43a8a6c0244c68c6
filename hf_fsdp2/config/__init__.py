"""Configuration: the recipe's sections (one dataclass per concern, each validating itself and building the
settings its module applies), the settings objects, data-source specs, and YAML + CLI parsing.

The bottom of the package tree: nothing here imports another hf_fsdp2 package.
"""

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
from hf_fsdp2.config.sections import DataArgs, ModelArgs
from hf_fsdp2.config.training import FSDPArgs, PreferenceArgs, TrainArgs

__all__ = [
    "CONFIG_NAME",
    "SECTIONS",
    "Config",
    "ConfigError",
    "DataArgs",
    "ExportArgs",
    "FSDPArgs",
    "ModelArgs",
    "ObserveArgs",
    "PeftArgs",
    "PreferenceArgs",
    "TrainArgs",
    "known_keys",
    "load_yaml",
    "parse_config",
    "parse_size",
    "save_config",
]
