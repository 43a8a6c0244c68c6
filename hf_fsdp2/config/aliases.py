"""Keys spelt as TRL / the HF Trainer (and a few axolotl ones) spell them, read as hf_fsdp2's keys.

One table, :data:`ALIASES`: each foreign key, the hf_fsdp2 key it sets, and how its value maps. A value with no
equivalent (``optim: adafactor``, ``eval_strategy: epoch``) is an error naming the key, the value and what to use
instead; an alias and its key given with different values is an error too. Unknown keys still fail in
``parse.py`` with the nearest known names (aliases included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hf_fsdp2.config.plans import ConfigError

SKIP = object()  # the alias is accepted and changes nothing (its meaning is hf_fsdp2's behaviour already)


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _bf16(value: Any) -> Any:
    return "bf16" if _as_bool("bf16", value) else "no"


def _fp16(value: Any) -> Any:
    # fp16 mixed precision is refused by the train section with the reason; false changes nothing.
    return "fp16" if _as_bool("fp16", value) else SKIP


def _optim(value: Any) -> Any:
    # The Trainer's AdamW spellings are the one AdamW here (torch's, fused on CPU and GPU); muon is hf_fsdp2's key.
    text = str(value).strip().lower()
    if text in ("adamw", "adamw_torch", "adamw_torch_fused"):
        return "adamw"
    if text == "muon":
        return "muon"
    raise ConfigError(
        f"optim={value!r} has no equivalent here: use adamw (torch AdamW; adamw_torch and adamw_torch_fused mean "
        "it too) or muon (Muon on the decoder matrices, AdamW on the rest)"
    )


def _one_of(key: str, accepted: Sequence[str], hint: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if str(value) in accepted:
            return SKIP
        raise ConfigError(f"{key}={value!r} has no equivalent here ({hint}); accepted: {', '.join(accepted)}")

    return convert


def _save_strategy(value: Any) -> Any:
    if str(value) == "steps":
        return SKIP
    if str(value) == "no":
        return 0
    raise ConfigError(
        f"save_strategy={value!r}: checkpoints are taken every save_steps steps; use steps or no"
    )


def _report_to(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "none"
    return value


def _same(value: Any) -> Any:
    return value


def _resume(value: Any) -> Any:
    # The Trainer's resume_from_checkpoint=True resumes the last checkpoint of output_dir: 'latest' here. False is
    # no resume, and None (not SKIP) so that a command line's false also cancels the YAML's latest (CLI > YAML).
    # A path, or latest, is itself.
    text = str(value).strip().lower()
    if value is True or text in ("true", "yes"):
        return "latest"
    if value is False or text in ("false", "no", "none"):
        return None
    return value


def _true_is(target: Any) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        return target if _as_bool("flag", value) else SKIP

    return convert


@dataclass(frozen=True)
class Alias:
    """A foreign key: the hf_fsdp2 key it sets and its value mapping (``SKIP``: accepted, no change)."""

    key: str
    convert: Callable[[Any], Any]
    source: str


ALIASES: dict[str, Alias] = {
    # TRL / transformers TrainingArguments
    "bf16": Alias("mixed_precision", _bf16, "Trainer: bf16 true -> mixed_precision bf16, false -> no"),
    "fp16": Alias("mixed_precision", _fp16, "Trainer: fp16 true -> mixed_precision fp16 (refused: use bf16)"),
    "dtype": Alias("torch_dtype", _same, "TRL model_init dtype"),
    "dataset_train_split": Alias("dataset_split", _same, "TRL ScriptArguments"),
    "dataset_config": Alias("dataset_config_name", _same, "TRL ScriptArguments"),
    "max_seq_length": Alias("max_length", _same, "TRL < 0.20 SFTConfig"),
    "dataset_text_field": Alias("text_column", _same, "TRL SFTConfig"),
    "use_bnb_nested_quant": Alias(
        "bnb_4bit_use_double_quant", _same, "TRL ModelConfig (double quantisation)"
    ),
    "eval_strategy": Alias(
        "eval_steps",
        _one_of(
            "eval_strategy",
            ["steps", "no"],
            "evaluation runs every eval_steps when an eval set is given, at the end when eval_steps is 0",
        ),
        "Trainer",
    ),
    "logging_strategy": Alias(
        "logging_steps", _one_of("logging_strategy", ["steps"], "use logging_steps"), "Trainer"
    ),
    "save_strategy": Alias("save_steps", _save_strategy, "Trainer: no -> save_steps 0"),
    # The same key, the Trainer's values: true -> latest, false -> no resume (else "no such folder true", and only
    # once the model has loaded).
    "resume_from_checkpoint": Alias(
        "resume_from_checkpoint", _resume, "Trainer: true -> latest, false -> none (also over the YAML's)"
    ),
    "optim": Alias("optim", _optim, "Trainer: adamw_torch / adamw_torch_fused -> adamw; muon as is"),
    # axolotl
    "base_model": Alias("model_name_or_path", _same, "axolotl"),
    "sequence_len": Alias("max_length", _same, "axolotl"),
    "micro_batch_size": Alias("per_device_train_batch_size", _same, "axolotl"),
    "num_epochs": Alias("num_train_epochs", _same, "axolotl"),
    "sample_packing": Alias("packing", _same, "axolotl"),
    "val_set_size": Alias("eval_split_fraction", _same, "axolotl (a fraction; absolute counts are refused)"),
    "flash_attention": Alias("attn_implementation", _true_is("flash_attention_2"), "axolotl"),
}


def apply_aliases(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with every alias replaced by its hf_fsdp2 key (aliases that change nothing dropped) and a
    list-valued ``report_to`` (the Trainer's form) joined.

    Raises:
        ConfigError: an alias value with no equivalent, or an alias and its key with different values.
    """
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}  # hf_fsdp2 key -> the key that set it

    def put(key: str, value: Any, given_as: str) -> None:
        if key in out and out[key] != value:

            def says(name: str, result: Any) -> str:
                given = f"{name}={values[name]!r}"
                return given if name == key else f"{given} (read as {key}={result!r})"

            raise ConfigError(
                f"{where}: {says(origin[key], out[key])} and {says(given_as, value)} disagree; keep one"
            )
        out[key], origin[key] = value, given_as

    for key, value in values.items():
        alias = ALIASES.get(key)
        if alias is None:
            put(key, _report_to(value) if key == "report_to" else value, key)
            continue
        mapped = alias.convert(value)
        if mapped is SKIP:
            continue
        if key == "val_set_size" and float(mapped) >= 1:
            raise ConfigError(f"{where}: val_set_size={value!r} is a count; give a fraction in (0, 1)")
        put(alias.key, mapped, key)
    return out


def rewrite_argv(args: Sequence[str]) -> list[str]:
    """Command-line ``--alias value`` / ``--alias=value`` / a bare boolean ``--alias`` turned into hf_fsdp2
    arguments, and ``--report_to a b`` joined into one value."""
    out: list[str] = []
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if name not in ALIASES and name != "report_to":
            out.append(arg)
            i += 1
            continue
        values: list[str] = []
        i += 1
        if "=" in arg:
            values = [arg.split("=", 1)[1]]
        else:
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        value: Any = values if name == "report_to" else (values[0] if values else "true")
        for key, mapped in apply_aliases({name: value}, "the command line").items():
            # None puts the key back to its default (None): argparse reads no None, so an empty value, which
            # the section reads as None (TrainArgs.__post_init__), overriding the YAML's value.
            out.append(f"--{key}=" if mapped is None else f"--{key}={mapped}")
    return out
