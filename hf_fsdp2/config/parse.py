"""Parsing a recipe: YAML plus command-line overrides into a validated :class:`Config`, and saving it.

Precedence is CLI > YAML > defaults. The YAML file is turned into ``--key value`` arguments placed
before the command line's own, so both go through the same argparse types and choices
(transformers.HfArgumentParser) and the last occurrence, the command line's, wins. Unknown keys are
errors that name the key and its closest known names; a key of another method's section names that method.

The shared sections are :data:`SECTIONS`; a training method adds its own section (its keys and defaults) and its
defaults for shared keys (:func:`hf_fsdp2.methods.parse_method_config` passes them here).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

from hf_fsdp2.config.aliases import ALIASES, apply_aliases, rewrite_argv
from hf_fsdp2.config.float8 import check_float8_combination
from hf_fsdp2.config.outputs import ExportArgs, ObserveArgs
from hf_fsdp2.config.peft import PeftArgs
from hf_fsdp2.config.plans import ConfigError, check
from hf_fsdp2.config.restarts import RestartArgs
from hf_fsdp2.config.sections import DataArgs, ModelArgs
from hf_fsdp2.config.training import FSDPArgs, TrainArgs

CONFIG_NAME = "hf_fsdp2_config.yaml"  # the resolved config, written into the run folder

SECTIONS: tuple[type, ...] = (
    ModelArgs,
    DataArgs,
    TrainArgs,
    FSDPArgs,
    PeftArgs,
    ExportArgs,
    ObserveArgs,
    RestartArgs,
)
"""The sections every method shares; a method's own section comes after them."""


@dataclass(kw_only=True)
class Config:
    """All settings of one run, one attribute per concern."""

    model: ModelArgs
    data: DataArgs
    train: TrainArgs
    fsdp: FSDPArgs
    peft: PeftArgs
    export: ExportArgs
    observe: ObserveArgs
    restart: RestartArgs
    method: Any = None  # the training method's own section (its dataclass), or None (SFT, CPT)

    def validate(self) -> None:
        """Every section validates itself; then the keys of different sections that must agree.

        Raises:
            ConfigError: naming the key, its value, what is allowed and the fix.
        """
        m, d, t, f, p = self.model, self.data, self.train, self.fsdp, self.peft
        m.validate()
        d.validate(m.attn_implementation)
        t.validate()
        f.validate()
        p.validate()
        self.export.validate(t.save_steps)
        self.observe.validate(has_eval=d.has_eval())
        self.restart.validate()
        if self.method is not None and hasattr(self.method, "validate"):
            self.method.validate()
        if t.mixed_precision == "fp8":
            check_float8_combination(
                load_in_4bit=p.load_in_4bit,
                use_peft=p.use_peft,
                tp_size=f.tp_size or 1,
                ram_efficient_loading=f.fsdp_cpu_ram_efficient_loading,
                optim=t.optim,
                all_gather=t.float8_plan().all_gather,
                ep_size=f.ep_size or 1,
            )
        if p.load_in_4bit and p.bnb_4bit_compute_dtype is not None:
            compute = {"bf16": "bfloat16", "fp16": "float16"}.get(t.mixed_precision, m.torch_dtype)
            check(
                compute == "auto" or p.bnb_4bit_compute_dtype == compute,
                f"bnb_4bit_compute_dtype={p.bnb_4bit_compute_dtype!r} but the run computes in {compute} "
                f"(mixed_precision={t.mixed_precision}, torch_dtype={m.torch_dtype}): the 4-bit weights are "
                "dequantised to the compute dtype; remove the key or change mixed_precision",
            )
        check(
            not (m.resize_token_embeddings and f.fsdp_cpu_ram_efficient_loading),
            "resize_token_embeddings=true with fsdp_cpu_ram_efficient_loading=true is not supported (the new rows "
            "are initialised from the weights, which only rank 0 holds then); resize once offline with "
            "model.resize_token_embeddings(len(tokenizer)) and save_pretrained, or turn the loading option off",
        )

    def to_flat_dict(self) -> dict[str, Any]:
        """Every key with its resolved value, in the flat form the YAML recipes use."""
        flat: dict[str, Any] = {}
        sections = [
            self.model,
            self.data,
            self.train,
            self.fsdp,
            self.peft,
            self.export,
            self.observe,
            self.restart,
        ]
        for section in [*sections, *([self.method] if self.method is not None else [])]:
            flat.update(dataclasses.asdict(section))
        return flat


def known_keys(section: type | None = None) -> dict[str, dataclasses.Field[Any]]:
    """All config keys of the shared sections (and of a method's ``section``), mapped to their dataclass field."""
    classes = (*SECTIONS, *([section] if section is not None else []))
    return {f.name: f for cls in classes for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class _Keys:
    """The keys one parse accepts, and where the others belong, for the messages."""

    fields: dict[str, dataclasses.Field[Any]]
    elsewhere: Mapping[str, str]
    recipe: str

    def unknown(self, key: str, where: str) -> ConfigError:
        if key in self.elsewhere:
            other = self.elsewhere[key]
            return ConfigError(
                f"config key {key!r} in {where} is a key of the {other} recipe, not of the {self.recipe} recipe; "
                f"remove it, or train with recipes/{other.split(' and ')[0]}.py (hf-fsdp2 train "
                f"{other.split(' and ')[0]})"
            )
        close = difflib.get_close_matches(key, [*self.fields, *ALIASES], n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; run the recipe with --help for all keys"
        return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def _yaml_to_argv(values: dict[str, Any], path: str, keys: _Keys) -> list[str]:
    """Turn YAML values into ``--key value`` arguments so argparse checks them like CLI ones."""
    fields = keys.fields
    argv: list[str] = []
    for key, value in values.items():
        if key not in fields:
            raise keys.unknown(key, path)
        if value is None:
            continue
        if isinstance(value, list):
            if not value:
                factory = fields[key].default_factory
                if callable(factory) and factory() == []:
                    continue  # an empty list is this key's default
                raise ConfigError(
                    f"{key}: an empty list in {path}; give at least one value or remove the key"
                )
            argv.append(f"--{key}")
            argv.extend(str(v) for v in value)
        elif isinstance(value, bool):
            argv.append(f"--{key}={'true' if value else 'false'}")
        elif isinstance(value, dict) and key.endswith("_kwargs"):
            argv.append(f"--{key}={json.dumps(value)}")  # keys named *_kwargs (TRL's) take a mapping, as JSON
        elif isinstance(value, dict):
            raise ConfigError(f"{key}: a mapping in {path} where a single value is expected: {value!r}")
        else:
            # --key=value, so that a negative number is not read as a flag.
            argv.append(f"--{key}={value}")
    return argv


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a recipe YAML file into a flat dict.

    Raises:
        ConfigError: the file is missing, not YAML, or not a flat mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        values = yaml.safe_load(p.read_text()) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"--config {path} is not a text file (byte {err.start}: not UTF-8); give the recipe's YAML file"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"--config {path} is not valid YAML{where}: {getattr(err, 'problem', None) or err}; fix that line"
        ) from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must be a mapping of key: value, got {type(values).__name__}")
    return values


def parse_config(
    argv: Sequence[str] | None = None,
    *,
    section: type | None = None,
    defaults: Mapping[str, Any] | None = None,
    elsewhere: Mapping[str, str] | None = None,
    recipe: str = "sft",
) -> Config:
    """Parse ``[--config recipe.yaml] [--key value ...]`` into a validated :class:`Config`.

    Args:
        argv: command-line arguments without the program name; defaults to ``sys.argv[1:]``.
        section: the training method's own section (a dataclass), parsed after the shared ones into ``method``.
        defaults: the method's defaults for keys of the shared sections, under the YAML and the command line.
        elsewhere: keys of other methods' sections -> those methods, for the message that refuses them.
        recipe: the method's name, for messages.

    Returns:
        The resolved configuration (CLI > YAML > defaults).

    Raises:
        ConfigError: unknown keys or values that cannot work, with the key, value and fix.
        SystemExit: argparse's own exit for ``--help`` and for a value of the wrong type or choice.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    keys = _Keys(known_keys(section), elsewhere or {}, recipe)
    classes = (*SECTIONS, *([section] if section is not None else []))
    # The method's defaults for shared keys go first: the YAML's values and then the command line's override them.
    yaml_argv: list[str] = _yaml_to_argv(dict(defaults), "the recipe's defaults", keys) if defaults else []
    for i, arg in enumerate(args):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(args):
                    raise ConfigError("--config needs a path to a YAML recipe")
                path = args[i + 1]
                del args[i : i + 2]
            else:
                path = arg.split("=", 1)[1]
                del args[i]
            # TRL / Trainer spellings (bf16, dtype, dataset_train_split, ...) read as hf_fsdp2's keys.
            yaml_argv += _yaml_to_argv(apply_aliases(load_yaml(path), path), path, keys)
            break
    args = rewrite_argv(args)
    parser = HfArgumentParser(classes)  # type: ignore[arg-type]
    parser.add_argument("--config", help="YAML recipe; command-line values override its keys")

    def _error(message: str) -> NoReturn:
        # argparse prints the whole usage and exits; a ConfigError carries just the key and the allowed values.
        raise ConfigError(message)

    parser.error = _error  # type: ignore[method-assign,assignment]
    for arg in args:
        if arg.startswith("--") and arg != "--help":
            key = arg[2:].split("=", 1)[0]
            if key not in keys.fields:
                raise keys.unknown(key, "the command line")
    parsed = parser.parse_args_into_dataclasses(args=yaml_argv + args, return_remaining_strings=True)
    # HfArgumentParser returns one object per section, then a namespace for the extra --config
    # argument, then the strings it could not place.
    sections, remaining = parsed[: len(classes)], parsed[-1]
    if remaining:
        raise ConfigError(
            f"unexpected command-line arguments {remaining}; every value needs a --key before it"
        )
    model, data, train, fsdp, peft, export, observe, restart = sections[: len(SECTIONS)]
    cfg = Config(
        model=model,
        data=data,
        train=train,
        fsdp=fsdp,
        peft=peft,
        export=export,
        observe=observe,
        restart=restart,
        method=sections[len(SECTIONS)] if section is not None else None,
    )
    cfg.validate()
    return cfg


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as a flat YAML recipe that ``--config`` accepts again.

    Returns:
        The path written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(cfg.to_flat_dict(), sort_keys=False))
    return p
