"""Unit tests for hf_fsdp2.config: YAML + CLI parsing, precedence, validation, saving, sizes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hf_fsdp2.config import (
    SECTIONS,
    Config,
    ConfigError,
    DataArgs,
    ExportArgs,
    FSDPArgs,
    ModelArgs,
    PeftArgs,
    TrainArgs,
    known_keys,
    parse_config,
    parse_size,
    save_config,
)
from hf_fsdp2.methods import method_names, parse_method_config

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {"model_name_or_path": "org/model", "dataset_name": "data.jsonl", "output_dir": "out"}
REQUIRED_ARGV = [a for key, value in REQUIRED.items() for a in (f"--{key}", value)]


def write_yaml(tmp_path: Path, values: dict[str, Any], name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def parse_cli(*args: str) -> Config:
    return parse_config([*REQUIRED_ARGV, *args])


# ---------------------------------------------------------------------------------------------------
# Defaults, YAML, CLI and their precedence
# ---------------------------------------------------------------------------------------------------


def test_defaults_without_config_file() -> None:
    cfg = parse_cli()
    assert cfg.model == ModelArgs(model_name_or_path="org/model")
    assert cfg.data == DataArgs(dataset_name="data.jsonl")
    assert cfg.train == TrainArgs(output_dir="out")
    assert cfg.fsdp == FSDPArgs()
    assert cfg.peft == PeftArgs()
    assert cfg.export == ExportArgs()
    # A few defaults by value, so a silent change of a default shows up here.
    assert cfg.train.learning_rate == 2e-5
    assert cfg.train.lr_scheduler_type == "cosine"
    assert cfg.train.mixed_precision == "bf16"
    assert cfg.train.max_steps == -1
    assert cfg.train.gradient_accumulation_steps == 1
    assert cfg.fsdp.fsdp_layer_cls_to_wrap == []
    assert cfg.fsdp.torch_compile is None
    assert cfg.peft.lora_target_modules == ["all-linear"]
    assert cfg.export.max_shard_size == "5GB"


def test_yaml_values_are_typed_like_cli_values(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    # PyYAML reads `1e-4` (no dot) as a string: the argparse type must still make it a float.
    path.write_text(
        "model_name_or_path: org/model\n"
        "dataset_name: data.jsonl\n"
        "output_dir: out\n"
        "learning_rate: 1e-4\n"
        "max_steps: 7\n"
        "gradient_checkpointing: true\n"
        "lr_scheduler_type: linear\n"
        "warmup_ratio: 0.25\n"
        "model_revision: null\n"
        "fsdp_layer_cls_to_wrap:\n  - LlamaDecoderLayer\n  - MistralDecoderLayer\n"
    )
    cfg = parse_config(["--config", str(path)])
    assert cfg.train.learning_rate == pytest.approx(1e-4)
    assert isinstance(cfg.train.learning_rate, float)
    assert cfg.train.max_steps == 7
    assert isinstance(cfg.train.max_steps, int)
    assert cfg.fsdp.gradient_checkpointing is True
    assert cfg.train.lr_scheduler_type == "linear"
    assert cfg.train.warmup_ratio == 0.25
    assert cfg.model.model_revision is None
    assert cfg.fsdp.fsdp_layer_cls_to_wrap == ["LlamaDecoderLayer", "MistralDecoderLayer"]


@pytest.mark.parametrize("cli_first", [False, True])
def test_cli_wins_over_yaml_wherever_config_is_placed(tmp_path: Path, cli_first: bool) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "learning_rate": 1e-4, "max_steps": 7, "seed": 3})
    cli = ["--learning_rate", "3e-4", "--seed", "11"]
    argv = [*cli, "--config", str(path)] if cli_first else ["--config", str(path), *cli]
    cfg = parse_config(argv)
    assert cfg.train.learning_rate == pytest.approx(3e-4)  # CLI
    assert cfg.train.seed == 11  # CLI
    assert cfg.train.max_steps == 7  # YAML only
    assert cfg.train.per_device_train_batch_size == 8  # default


def test_cli_list_replaces_yaml_list(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "fsdp_layer_cls_to_wrap": ["A", "B"]})
    cfg = parse_config(["--config", str(path), "--fsdp_layer_cls_to_wrap", "C"])
    assert cfg.fsdp.fsdp_layer_cls_to_wrap == ["C"]


def test_cli_list_with_several_values() -> None:
    cfg = parse_cli("--fsdp_layer_cls_to_wrap", "LlamaDecoderLayer", "Qwen2DecoderLayer")
    assert cfg.fsdp.fsdp_layer_cls_to_wrap == ["LlamaDecoderLayer", "Qwen2DecoderLayer"]


def test_cli_key_equals_value_form() -> None:
    cfg = parse_cli("--learning_rate=5e-5", "--max_steps=9")
    assert cfg.train.learning_rate == pytest.approx(5e-5)
    assert cfg.train.max_steps == 9


def test_bare_bool_flag_means_true() -> None:
    assert parse_cli("--gradient_checkpointing").fsdp.gradient_checkpointing is True
    assert parse_cli("--gradient_checkpointing", "false").fsdp.gradient_checkpointing is False


def test_required_keys_may_come_from_yaml_alone(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, REQUIRED)
    cfg = parse_config(["--config", str(path)])
    assert (cfg.model.model_name_or_path, cfg.data.dataset_name, cfg.train.output_dir) == (
        "org/model",
        "data.jsonl",
        "out",
    )


def test_empty_yaml_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert parse_config(["--config", str(path), *REQUIRED_ARGV]) == parse_cli()


# ---------------------------------------------------------------------------------------------------
# Unknown keys
# ---------------------------------------------------------------------------------------------------

TYPOS = [
    ("learning_rat", "learning_rate"),
    ("gradient_acumulation_steps", "gradient_accumulation_steps"),
    ("lr_schedular_type", "lr_scheduler_type"),
    ("fsdp_layer_cls_to_warp", "fsdp_layer_cls_to_wrap"),
]


@pytest.mark.parametrize(("key", "suggestion"), TYPOS)
def test_unknown_yaml_key_names_key_and_close_match(tmp_path: Path, key: str, suggestion: str) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, key: 1})
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", str(path)])
    message = str(err.value)
    assert repr(key) in message
    assert suggestion in message
    assert str(path) in message


@pytest.mark.parametrize(("key", "suggestion"), TYPOS)
def test_unknown_cli_key_names_key_and_close_match(key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli(f"--{key}", "1")
    assert repr(key) in str(err.value)
    assert suggestion in str(err.value)
    assert "command line" in str(err.value)


def test_unknown_cli_key_in_equals_form() -> None:
    with pytest.raises(ConfigError, match=r"'learning_rat'.*learning_rate"):
        parse_cli("--learning_rat=1e-3")


def test_unknown_key_without_close_match_points_to_help(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli("--zzz", "1")
    assert "'zzz'" in str(err.value)
    assert "did you mean" not in str(err.value)
    assert "--help" in str(err.value)


def test_nested_yaml_section_is_an_unknown_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "train": {"learning_rate": 1e-4}})
    with pytest.raises(ConfigError, match="'train'"):
        parse_config(["--config", str(path)])


def test_positional_value_without_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="stray"):
        parse_cli("stray")


# ---------------------------------------------------------------------------------------------------
# Bad choices, bad types, ranges, required keys
# ---------------------------------------------------------------------------------------------------

BAD_CHOICES = [
    ("lr_scheduler_type", "cosin"),
    ("mixed_precision", "fp4"),
    ("torch_dtype", "float64"),
    ("export_dtype", "int8"),
    ("dataset_format", "chat"),
]


@pytest.mark.parametrize(("key", "value"), BAD_CHOICES)
def test_bad_choice_on_cli_names_key_and_value(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli(f"--{key}", value)
    assert key in str(err.value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(("key", "value"), BAD_CHOICES)
def test_bad_choice_in_yaml_names_key_and_value(tmp_path: Path, key: str, value: str) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, key: value})
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", str(path)])
    assert key in str(err.value)
    assert repr(value) in str(err.value)


BAD_TYPES = [
    ("max_steps", "1.5"),
    ("per_device_train_batch_size", "two"),
    ("learning_rate", "fast"),
    ("overwrite_output_dir", "maybe"),
    ("gradient_checkpointing", "maybe"),
    ("torch_compile", "sometimes"),
]


@pytest.mark.parametrize(("key", "value"), BAD_TYPES)
def test_bad_type_on_cli_names_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli(f"--{key}", value)
    assert key in str(err.value)
    assert value in str(err.value)


def test_bad_types_in_yaml_name_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "max_steps": 1.5})
    with pytest.raises(ConfigError, match=r"max_steps.*1\.5"):
        parse_config(["--config", str(path)])
    path = write_yaml(tmp_path, {**REQUIRED, "fsdp_cpu_offload": "maybe"})
    with pytest.raises(ConfigError, match="fsdp_cpu_offload.*maybe"):
        parse_config(["--config", str(path)])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--warmup_ratio", "1.0"), "warmup_ratio=1.0"),
        (("--warmup_ratio", "-0.1"), "warmup_ratio=-0.1"),
        (("--per_device_train_batch_size", "0"), "per_device_train_batch_size=0"),
        (("--gradient_accumulation_steps", "0"), "gradient_accumulation_steps=0"),
        (("--max_steps", "0"), "max_steps=0"),
        (("--max_steps", "-2"), "max_steps=-2"),
        (("--learning_rate", "0"), "learning_rate=0.0"),
        (("--learning_rate=-1e-5",), "learning_rate=-1e-05"),  # argparse reads a bare -1e-5 as a flag
        (("--learning_rate", "nan"), "learning_rate=nan"),
        (("--max_length", "0"), "max_length=0"),
        (("--warmup_steps", "-1"), "warmup_steps=-1"),
        (("--max_grad_norm", "-1"), "max_grad_norm=-1.0"),
        (("--weight_decay", "-0.1"), "weight_decay=-0.1"),
        (("--logging_steps", "0"), "logging_steps=0"),
        (("--num_train_epochs", "0"), "num_train_epochs=0.0"),
    ],
)
def test_range_errors_name_key_and_value(args: tuple[str, ...], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli(*args)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("recipe", "args", "expected"),
    [
        ("dpo", ("--loss_type", "kpo"), "loss_type='kpo' is not a loss of the DPO recipe: one of sigmoid, ipo, robust"),
        ("kto", ("--loss_type", "kpo"), "loss_type='kpo' is not a loss of the KTO recipe: one of kto, apo_zero_unpaired"),
        ("kto", ("--desirable_weight", "0"), "desirable_weight=0.0 must be > 0"),
        ("kto", ("--undesirable_weight=-1",), "undesirable_weight=-1.0 must be > 0"),
        ("dpo", ("--loss_type", "ipo", "--label_smoothing", "0.1"), "applies to loss_type sigmoid (cDPO), robust or simpo"),
        ("dpo", ("--cpo_alpha", "1.0"), "cpo_alpha=1.0 applies to loss_type simpo (CPO-SimPO), not 'sigmoid'"),
        ("dpo", ("--loss_type", "simpo", "--cpo_alpha=-1"), "cpo_alpha=-1.0 must be >= 0"),
        (
            "dpo",
            ("--loss_type", "orpo", "--precompute_ref_log_probs", "true"),
            "loss_type='orpo' is reference-free (no reference model, no reference pass): precompute_ref_log_probs",
        ),
        ("dpo", ("--loss_type", "simpo", "--ref_model_name_or_path", "x"), "ref_model_name_or_path would do nothing"),
        ("rm", ("--center_rewards_coefficient=-1",), "center_rewards_coefficient=-1.0 must be >= 0"),
        ("grpo", ("--loss_type", "sigmoid"), "loss_type='sigmoid' is not a loss of the GRPO recipe"),
    ],
)  # fmt: skip
def test_a_methods_range_errors_name_key_and_value(recipe: str, args: tuple[str, ...], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_method_config(recipe, [*REQUIRED_ARGV, *args])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "args",
    [
        ("--warmup_ratio", "0.0"),
        ("--warmup_ratio", "0.99"),
        ("--max_steps", "1"),
        ("--max_steps", "-1"),
        ("--num_train_epochs", "0", "--max_steps", "5"),  # epochs unused when max_steps is set
        ("--max_grad_norm", "0"),
        ("--mixed_precision", "no"),
    ],
)
def test_range_boundaries_that_are_accepted(args: tuple[str, ...]) -> None:
    parse_cli(*args)


@pytest.mark.parametrize(
    "args",
    [
        ("--loss_type", "simpo", "--label_smoothing", "0.1", "--cpo_alpha", "1.0", "--simpo_gamma", "0"),
        ("--loss_type", "orpo", "--beta", "0.2"),
    ],
)
def test_dpo_boundaries_that_are_accepted(args: tuple[str, ...]) -> None:
    parse_method_config("dpo", [*REQUIRED_ARGV, *args])


def test_fp16_is_refused_with_the_alternatives() -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli("--mixed_precision", "fp16")
    assert "fp16" in str(err.value)
    assert "bf16" in str(err.value)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (("--packing", "true", "--attn_implementation", "my_kernel"), "attn_implementation"),
        (("--save_steps=-1",), "save_steps"),
        (("--save_total_limit=-2",), "save_total_limit"),
        (("--use_peft", "true", "--lora_r", "0"), "lora_r"),
        (("--merge_adapter", "true"), "merge_adapter"),
        (
            ("--resize_token_embeddings", "true", "--fsdp_cpu_ram_efficient_loading", "true"),
            "fsdp_cpu_ram_efficient_loading",
        ),
        (("--push_to_hub", "true"), "push_to_hub"),
        (("--report_to", "mlflow"), "report_to"),
        (("--torch_compile_mode", "fast"), "torch_compile_mode"),
        (("--max_shard_size", "lots"), "max_shard_size"),
    ],
)
def test_unavailable_or_invalid_features_are_refused(args: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_cli(*args)


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_missing_required_key_is_an_error(missing: str) -> None:
    argv = [a for key, value in REQUIRED.items() if key != missing for a in (f"--{key}", value)]
    with pytest.raises(ConfigError) as err:
        parse_config(argv)
    assert missing in str(err.value)
    assert "required" in str(err.value)


# ---------------------------------------------------------------------------------------------------
# The --config file itself
# ---------------------------------------------------------------------------------------------------


def test_config_flag_without_path() -> None:
    with pytest.raises(ConfigError, match="--config needs a path"):
        parse_config(["--config"])


def test_config_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such file") as err:
        parse_config(["--config", str(missing)])
    assert str(missing) in str(err.value)


def test_config_file_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping.*list"):
        parse_config(["--config", str(path)])


def test_config_file_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("key: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config(["--config", str(path)])


def test_yaml_mapping_value_for_scalar_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "learning_rate": {"peak": 1e-4}})
    with pytest.raises(ConfigError, match="learning_rate: a mapping"):
        parse_config(["--config", str(path)])


def test_yaml_empty_list_is_an_error_naming_the_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "lora_target_modules": []})
    with pytest.raises(ConfigError, match="lora_target_modules: an empty list"):
        parse_config(["--config", str(path)])


def test_config_equals_path_form(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "max_steps": 4})
    assert parse_config([f"--config={path}"]).train.max_steps == 4


# ---------------------------------------------------------------------------------------------------
# save_config
# ---------------------------------------------------------------------------------------------------


def test_save_config_writes_every_key_flat(tmp_path: Path) -> None:
    cfg = parse_cli("--max_steps", "3")
    path = save_config(cfg, tmp_path / "run" / "config.yaml")  # parent is created
    assert path == tmp_path / "run" / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    assert list(saved) == list(known_keys())
    assert saved["max_steps"] == 3
    assert saved["model_name_or_path"] == "org/model"
    assert saved["learning_rate"] == 2e-5


def test_save_config_round_trips_non_default_values(tmp_path: Path) -> None:
    cfg = parse_cli(
        "--learning_rate",
        "3e-4",
        "--max_steps",
        "12",
        "--lr_scheduler_type",
        "linear",
        "--warmup_ratio",
        "0.1",
        "--fsdp_layer_cls_to_wrap",
        "LlamaDecoderLayer",
        "--gradient_checkpointing",
        "true",
        "--torch_compile",
        "false",
        "--mixed_precision",
        "no",
        "--export_dtype",
        "float32",
        "--max_shard_size",
        "500MB",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
        "--model_revision",
        "main",
    )
    path = save_config(cfg, tmp_path / "config.yaml")
    again = parse_config(["--config", str(path)])
    assert again == cfg
    assert again.fsdp.torch_compile is False  # not confused with the None default


def test_save_config_round_trips_defaults(tmp_path: Path) -> None:
    cfg = parse_cli()
    path = save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load(path.read_text())["fsdp_layer_cls_to_wrap"] == []
    assert parse_config(["--config", str(path)]) == cfg


def test_yaml_empty_list_where_empty_is_the_default(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {**REQUIRED, "fsdp_layer_cls_to_wrap": []})
    assert parse_config(["--config", str(path)]).fsdp.fsdp_layer_cls_to_wrap == []


def test_to_flat_dict_has_one_entry_per_field() -> None:
    cfg = parse_cli()
    flat = cfg.to_flat_dict()
    n_fields = sum(len(dataclasses.fields(s)) for s in SECTIONS)
    assert len(flat) == n_fields  # no two sections share a key name
    assert flat["output_dir"] == "out"


# ---------------------------------------------------------------------------------------------------
# parse_size
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5_000_000_000),
        ("500MB", 500_000_000),
        ("2GiB", 2 * 1024**3),
        ("3MiB", 3 * 1024**2),
        ("1KiB", 1024),
        ("10KB", 10_000),
        ("1.5GB", 1_500_000_000),
        ("1TB", 10**12),
        ("100", 100),
        ("100B", 100),
        ("5gb", 5_000_000_000),
        (" 5 GB ", 5_000_000_000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "0", "0GB", "-5GB", "GB", "5XB", "five GB", "nanGB"])
def test_parse_size_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(text)
    assert repr(text) in str(err.value)


def test_parse_size_rejects_infinity() -> None:
    with pytest.raises(ConfigError):
        parse_size("infGB")


@pytest.mark.parametrize(
    "recipe", sorted((REPO_ROOT / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_recipe_config_parses(recipe: Path) -> None:
    """Each YAML in recipes/configs names only known keys of its method with valid values (the data is not read
    here); the method is the one its name says (dpo_cpu_demo.yaml, llama3_8b_dpo.yaml: dpo), else sft."""
    method = next((m for m in method_names() if m in recipe.stem.split("_")), "sft")
    cfg = parse_method_config(method, ["--config", str(recipe)])
    assert cfg.train.output_dir and cfg.model.model_name_or_path


# Every alias of hf_fsdp2/config/aliases.py::ALIASES: (YAML key, value) -> the hf_fsdp2 keys it sets.
ALIAS_CASES = [
    ("bf16", True, {"mixed_precision": "bf16"}),
    ("bf16", False, {"mixed_precision": "no"}),
    ("fp16", False, {}),
    ("dtype", "bfloat16", {"torch_dtype": "bfloat16"}),
    ("dataset_train_split", "train_sft", {"dataset_split": "train_sft"}),
    ("dataset_config", "en", {"dataset_config_name": "en"}),
    ("max_seq_length", 512, {"max_length": 512}),
    ("dataset_text_field", "content", {"text_column": "content"}),
    ("use_bnb_nested_quant", True, {"bnb_4bit_use_double_quant": True}),
    ("eval_strategy", "steps", {}),
    ("eval_strategy", "no", {}),
    ("logging_strategy", "steps", {}),
    ("save_strategy", "steps", {}),
    ("save_strategy", "no", {"save_steps": 0}),
    ("optim", "adamw_torch_fused", {"optim": "adamw"}),
    ("optim", "adamw_torch", {"optim": "adamw"}),
    ("optim", "muon", {"optim": "muon"}),
    ("base_model", "org/m", {"model_name_or_path": "org/m"}),
    ("sequence_len", 256, {"max_length": 256}),
    ("micro_batch_size", 4, {"per_device_train_batch_size": 4}),
    ("num_epochs", 2, {"num_train_epochs": 2}),
    ("sample_packing", True, {"packing": True}),
    ("val_set_size", 0.05, {"eval_split_fraction": 0.05}),
    ("flash_attention", True, {"attn_implementation": "flash_attention_2"}),
    # The Trainer's resume_from_checkpoint=True is hf_fsdp2's latest.
    ("resume_from_checkpoint", True, {"resume_from_checkpoint": "latest"}),
    ("resume_from_checkpoint", False, {"resume_from_checkpoint": None}),
    ("resume_from_checkpoint", "out/checkpoint-4", {"resume_from_checkpoint": "out/checkpoint-4"}),
]


@pytest.mark.parametrize("key, value, want", ALIAS_CASES, ids=lambda v: str(v))
def test_trl_trainer_and_axolotl_spellings_map_to_one_key(
    key: str, value: Any, want: dict, tmp_path: Path
) -> None:
    from hf_fsdp2.config.aliases import ALIASES, apply_aliases

    assert key in ALIASES
    assert apply_aliases({key: value}, "r.yaml") == want
    recipe = tmp_path / "r.yaml"
    required = {k: v for k, v in REQUIRED.items() if k not in want}  # base_model gives model_name_or_path
    recipe.write_text(yaml.safe_dump({**required, key: value}))
    cfg = parse_config(["--config", str(recipe)]).to_flat_dict()
    assert all(cfg[k] == v for k, v in want.items())


def test_every_alias_is_in_the_test_table() -> None:
    from hf_fsdp2.config.aliases import ALIASES

    assert set(ALIASES) == {key for key, _, _ in ALIAS_CASES}


@pytest.mark.parametrize(
    "args, want",
    [
        (["--resume_from_checkpoint", "true"], "latest"),
        (["--resume_from_checkpoint=True"], "latest"),
        (["--resume_from_checkpoint"], "latest"),  # a bare flag, as the Trainer's boolean
        (["--resume_from_checkpoint", "latest"], "latest"),
        (["--resume_from_checkpoint", "false"], None),
        (["--resume_from_checkpoint", "out/checkpoint-4"], "out/checkpoint-4"),
    ],
)
def test_resume_from_checkpoint_true_means_latest_on_the_command_line(
    args: list[str], want: str | None
) -> None:
    """``--resume_from_checkpoint true`` (HF Trainer) resumes ``latest``; it was once read as a folder
    named ``true``, refused only after the model had loaded."""
    assert parse_config([*REQUIRED_ARGV, *args]).train.resume_from_checkpoint == want


@pytest.mark.parametrize("no", ["false", "False", "no", "none"])
@pytest.mark.parametrize("in_yaml", ["latest", True, "out/checkpoint-4"])
def test_resume_from_checkpoint_false_on_the_command_line_cancels_the_yamls(
    no: str, in_yaml: Any, tmp_path: Path
) -> None:
    """CLI > YAML: ``--resume_from_checkpoint false`` starts a new run where the recipe says ``latest`` (it was
    dropped as "no change", and the YAML's latest resumed)."""
    recipe = write_yaml(tmp_path, {**REQUIRED, "resume_from_checkpoint": in_yaml})
    assert parse_config(["--config", str(recipe)]).train.resume_from_checkpoint is not None
    for args in (["--resume_from_checkpoint", no], [f"--resume_from_checkpoint={no}"]):
        cfg = parse_config(["--config", str(recipe), *args])
        assert cfg.train.resume_from_checkpoint is None
        assert cfg.to_flat_dict()["resume_from_checkpoint"] is None  # the saved config too
    # And the other way: the command line's latest over the YAML's false.
    recipe = write_yaml(tmp_path, {**REQUIRED, "resume_from_checkpoint": False}, "off.yaml")
    cfg = parse_config(["--config", str(recipe), "--resume_from_checkpoint", "latest"])
    assert cfg.train.resume_from_checkpoint == "latest"


def test_aliases_on_the_command_line_and_a_report_to_list() -> None:
    cfg = parse_config(
        [*REQUIRED_ARGV, "--bf16", "--dtype", "bfloat16", "--report_to", "tensorboard", "tensorboard"]
    )
    assert (cfg.train.mixed_precision, cfg.model.torch_dtype) == ("bf16", "bfloat16")
    assert cfg.observe.report_to == "tensorboard,tensorboard"  # a list, joined (names deduplicated when read)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"optim": "adafactor"}, "optim='adafactor' has no equivalent here"),
        ({"eval_strategy": "epoch"}, "eval_strategy='epoch' has no equivalent here"),
        ({"save_strategy": "epoch"}, "save_strategy='epoch'"),
        ({"bf16": True, "mixed_precision": "no"}, "bf16=True (read as mixed_precision='bf16') and mixed_precision='no' disagree"),
        ({"val_set_size": 2000}, "val_set_size=2000 is a count"),
        ({"bf16": "maybe"}, "bf16: expected true or false"),
    ],
)  # fmt: skip
def test_alias_values_without_an_equivalent_and_conflicts_are_refused(
    values: dict, message: str, tmp_path
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**REQUIRED, **values}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--config", str(recipe)])


def test_an_unknown_key_still_fails_with_the_nearest_names_aliases_included(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**REQUIRED, "bf61": True}))
    with pytest.raises(ConfigError, match="unknown config key 'bf61' .*did you mean bf16"):
        parse_config(["--config", str(recipe)])


# ---------------------------------------------------------------------------------------------------
# Defaults resolved at start: rank-0-only loading, the host group's timeout
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "local_world", "resize", "expected", "why"),
    [
        ((), 8, False, True, "default with 8 processes on this node"),
        ((), 2, False, True, "default with 2 processes on this node"),
        ((), 1, False, False, "one process per node"),
        ((), 8, True, False, "resize_token_embeddings=true"),
        (("--fsdp_cpu_ram_efficient_loading", "false"), 8, False, False, "set by the recipe"),
        (("--fsdp_cpu_ram_efficient_loading", "true"), 1, False, True, "set by the recipe"),
    ],
)
def test_rank0_only_loading_defaults_on_with_several_processes_per_node(
    argv: tuple[str, ...], local_world: int, resize: bool, expected: bool, why: str
) -> None:
    cfg = parse_cli(*argv)
    assert cfg.fsdp.fsdp_cpu_ram_efficient_loading == (None if not argv else argv[1] == "true")
    note = cfg.fsdp.resolve_ram_efficient_loading(local_world, resize_embeddings=resize)
    assert cfg.fsdp.fsdp_cpu_ram_efficient_loading is expected
    assert note.startswith(f"fsdp_cpu_ram_efficient_loading={str(expected).lower()} (") and why in note
    assert cfg.fsdp.sharding_plan(on_gpu=False).cpu_ram_efficient_loading is expected


def test_the_session_resolves_rank0_only_loading_from_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_fsdp2.parallel.accelerator import local_world_size

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size() == 1  # a plain `python recipe.py`
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun / accelerate launch --nproc_per_node 8
    assert local_world_size() == 8


def test_host_wait_timeout_default_and_range() -> None:
    from hf_fsdp2 import collectives

    assert parse_cli().train.host_wait_timeout == collectives.HOST_WAIT_TIMEOUT_S == 6 * 3600
    assert parse_cli("--host_wait_timeout", "60").train.host_wait_timeout == 60
    with pytest.raises(ConfigError, match=r"host_wait_timeout=0 must be > 0 seconds"):
        parse_cli("--host_wait_timeout", "0")
