"""Typed configuration: one dataclass per concern, parsed from a YAML recipe plus CLI overrides.

Precedence is CLI > YAML > defaults. The YAML file is turned into ``--key value`` arguments placed
before the command line's own, so both go through the same argparse types and choices
(transformers.HfArgumentParser) and the last occurrence, the command line's, wins. Unknown keys are
errors that name the key and its closest known names.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml
from transformers import HfArgumentParser

CONFIG_NAME = "hf_fsdp2_config.yaml"  # the resolved config, written into the run folder


class ConfigError(ValueError):
    """A configuration value or key a user must fix; the message says what and how."""


@dataclass
class ModelArgs:
    """Which model and tokenizer to load, and how."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub model id or local folder of an HF causal LM (required)."}
    )
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision (branch, tag or commit)."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer id or folder; defaults to model_name_or_path."}
    )
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in. FSDP2 keeps fp32 master copies of trainable "
            "parameters under mixed precision whatever this is."
        },
    )
    attn_implementation: str = field(
        default="auto",
        metadata={
            "help": "Attention kernel: auto (transformers picks what the model supports: sdpa, else eager), sdpa, "
            "eager, flash_attention_2, flex_attention."
        },
    )
    resize_token_embeddings: bool = field(
        default=False,
        metadata={
            "help": "Grow the model's embedding (and untied head) to the tokenizer's size when the tokenizer has "
            "more tokens than the model has rows; off: such a pair is refused."
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code from the hub repo; off unless you trust it."}
    )


@dataclass
class DataArgs:
    """Where the training records come from and how they become token ids and loss masks."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, local .jsonl/.json/.parquet/.csv/.txt/.arrow file, or folder "
            "(required unless dataset_mixture is given)."
        },
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset subset."})
    dataset_split: str = field(default="train", metadata={"help": "Split of a hub dataset to train on."})
    dataset_revision: str | None = field(default=None, metadata={"help": "Hub dataset branch, tag or commit."})
    dataset_mixture: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Weighted sources instead of dataset_name: 'id_or_path[?subset=S&split=T&revision=R]:weight,...'; "
            "weight 0.5 takes a seeded half of a source's records, 2 every record twice."
        },
    )
    dataset_format: Literal["auto", "messages", "conversations", "prompt_completion", "alpaca", "text"] = field(
        default="auto", metadata={"help": "Record format; auto detects it from the columns of each source."}
    )
    dataset_column_mapping: list[str] = field(
        default_factory=list,
        metadata={"help": "Rename columns before format detection: 'question=prompt,answer=completion'."},
    )
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes that tokenize (datasets.map num_proc); the result is cached."}
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Eval source: hub id or local path, optionally 'id?subset=S&split=T'."}
    )
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of eval_dataset_name."})
    eval_split_fraction: float = field(
        default=0.0, metadata={"help": "Hold out this fraction of every training source for eval (seeded); 0 = none."}
    )
    max_length: int = field(default=1024, metadata={"help": "Tokens per example (and per packed row)."})
    long_examples: Literal["truncate", "drop", "error"] = field(
        default="truncate",
        metadata={"help": "Examples longer than max_length: truncate, drop (counted), or error (a bad record)."},
    )
    on_bad_record: Literal["error", "skip"] = field(
        default="error",
        metadata={"help": "Malformed records: error (names source and index) or skip (counted in the summary)."},
    )
    chat_loss: Literal["assistant", "last_assistant", "all"] | None = field(
        default=None,
        metadata={
            "help": "Chat records: loss on every assistant turn, the last one only, or every token; "
            "unset follows assistant_only_loss."
        },
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={"help": "Chat records: loss on assistant tokens only (false = chat_loss all)."},
    )
    completion_only_loss: bool = field(
        default=True, metadata={"help": "prompt/completion records: loss on the completion only."}
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack several examples per row of max_length (best-fit decreasing); position_ids restart "
            "per example and no attention crosses examples."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Flatten each micro-batch into one row without padding (position_ids mark examples)."},
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes."})

    def resolved_chat_loss(self) -> str:
        """``chat_loss``, or what ``assistant_only_loss`` means when it is unset."""
        return self.chat_loss or ("assistant" if self.assistant_only_loss else "all")


@dataclass
class TrainArgs:
    """The optimisation loop, its schedule and where outputs go."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Run folder: export, metrics.jsonl, resolved config (required)."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow an output_dir that holds a previous run (its files are replaced)."}
    )
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 uses num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs when max_steps is -1."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Examples per micro-batch per rank."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate of AdamW."})
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW weight decay of matrices (embeddings included); none on biases and norm weights."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = field(
        default="cosine", metadata={"help": "Decay after warmup: cosine, linear or constant."}
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of steps of linear warmup."})
    warmup_steps: int = field(default=0, metadata={"help": "Warmup steps; overrides warmup_ratio when > 0."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm; 0 disables."})
    seed: int = field(default=42, metadata={"help": "Seed of model init, data order and dropout."})
    logging_steps: int = field(default=1, metadata={"help": "Log (and append to metrics.jsonl) every N steps."})
    save_steps: int = field(
        default=0,
        metadata={"help": "Sharded checkpoint to <output_dir>/checkpoint-<step> every N steps and at the end; 0 = none."},
    )
    save_total_limit: int = field(
        default=3, metadata={"help": "Keep the last K checkpoints (0 keeps all); the one resumed from is never deleted."}
    )
    save_async: bool = field(
        default=False, metadata={"help": "Write checkpoints in the background while training continues."}
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "'latest' (in output_dir) or a checkpoint-<step> folder to resume from."}
    )
    mixed_precision: Literal["bf16", "fp16", "no"] = field(
        default="bf16", metadata={"help": "Compute dtype; wins over the accelerate config file's value."}
    )
    ce_chunk_tokens: int = field(
        default=1024,
        metadata={
            "help": "Cross entropy over chunks of this many tokens, never the full [tokens x vocab] fp32 "
            "logits (used when a micro-batch has more tokens); 0 = plain logits."
        },
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Liger's fused RMSNorm/SwiGLU/RoPE kernels (GPU, pip install liger-kernel)."},
    )
    ddp_timeout: int = field(
        default=1800, metadata={"help": "Seconds a collective may wait before the run fails (NCCL/gloo timeout)."}
    )


@dataclass
class FSDPArgs:
    """How FSDP2 shards the model, activation checkpointing and torch.compile."""

    fsdp_layer_cls_to_wrap: list[str] = field(
        default_factory=list,
        metadata={"help": "Decoder-layer class names, one FSDP unit each; empty = model._no_split_modules."},
    )
    fsdp_reshard_after_forward: bool = field(
        default=True, metadata={"help": "Free gathered layer weights after forward (ZeRO-3) or keep (ZeRO-2)."}
    )
    fsdp_cpu_offload: bool = field(
        default=False, metadata={"help": "Keep sharded params, grads and optimizer state in host memory."}
    )
    fsdp_cpu_ram_efficient_loading: bool = field(
        default=False, metadata={"help": "Only rank 0 reads the weights; the others start on meta and get shards."}
    )
    fsdp_reduce_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "dtype of the gradient reduce-scatter (fp32 unless you accept bf16)."}
    )
    fsdp_sync_each_microbatch: bool = field(
        default=True,
        metadata={
            "help": "Reduce-scatter gradients after every micro-batch (sharded grads, low memory); false "
            "keeps unsharded grads until the last micro-batch (less traffic, full-size grads in memory)."
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Activation checkpointing around each decoder layer (activation_checkpointing=full)."},
    )
    activation_checkpointing: str | None = field(
        default=None,
        metadata={
            "help": "none, full, every_k, selective (keep matmul/attention outputs, recompute the rest) or "
            "offload (full, layer inputs in host memory; GPU); unset = full if gradient_checkpointing else none."
        },
    )
    ac_every_k: int = field(
        default=2, metadata={"help": "With activation_checkpointing=every_k: checkpoint layers 0, k, 2k, ..."}
    )
    torch_compile: bool | None = field(
        default=None, metadata={"help": "torch.compile the model; default on with a GPU, off on CPU."}
    )
    torch_compile_scope: Literal["regional", "model"] = field(
        default="regional",
        metadata={"help": "regional: each decoder layer, one shared graph (default); model: the whole model."},
    )
    torch_compile_mode: str | None = field(
        default=None, metadata={"help": "torch.compile mode: default, reduce-overhead, max-autotune..."}
    )
    torch_compile_dynamic: bool | None = field(default=None, metadata={"help": "torch.compile dynamic shapes."})
    torch_compile_fullgraph: bool = field(default=False, metadata={"help": "torch.compile fullgraph."})


@dataclass
class PeftArgs:
    """LoRA through PEFT (docs/lora.md): the adapter goes to output_dir, the merged model to output_dir/merged."""

    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "Module names, or all-linear."}
    )
    lora_modules_to_save: list[str] = field(
        default_factory=list, metadata={"help": "Modules trained in full beside the adapter (e.g. lm_head)."}
    )
    use_rslora: bool = field(default=False, metadata={"help": "rsLoRA scaling alpha/sqrt(r) instead of alpha/r."})
    merge_adapter: bool = field(
        default=False, metadata={"help": "Also export the merged full model to <output_dir>/merged."}
    )


@dataclass
class ExportArgs:
    """The consolidated HF folder written at the end, and the hub."""

    export_dtype: Literal["bfloat16", "float32", "float16", "training"] = field(
        default="bfloat16",
        metadata={"help": "dtype of the exported safetensors; training = the dtype the weights were trained in."},
    )
    max_shard_size: str = field(default="5GB", metadata={"help": "Largest safetensors shard, as in save_pretrained."})
    export_verify: bool = field(
        default=True,
        metadata={
            "help": "Check the export before publishing it: keys, shapes, dtypes, values read back bit-exact, "
            "and probe logits of a fresh transformers reload against the live model."
        },
    )
    export_verify_atol: float | None = field(
        default=None, metadata={"help": "Largest probe-logit difference accepted; default by dtype (docs/export.md)."}
    )
    push_to_hub: bool = field(
        default=False, metadata={"help": "Upload the export (with metrics and resolved config) to hub_model_id."}
    )
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repo id to push to (namespace/name)."})
    hub_private_repo: bool | None = field(
        default=None,
        metadata={"help": "Create the repo private (true) or public (false); default the namespace's default."},
    )
    hub_revision: str | None = field(
        default=None, metadata={"help": "Branch to push the export to (created if missing); default main."}
    )
    hub_commit_message: str | None = field(
        default=None, metadata={"help": "Commit message of the export's push; default names the run."}
    )
    hub_token: str | None = field(
        default=None,
        metadata={"help": "Hub token; default HF_TOKEN, then the `hf auth login` token. Never written to disk."},
    )
    push_checkpoints_to_branch: str | None = field(
        default=None,
        metadata={"help": "Also upload each checkpoint to last-checkpoint/ on this branch, in the background."},
    )


@dataclass
class ObserveArgs:
    """What the run reports: trackers, evaluation, profiling, debug switches (docs/observability.md)."""

    report_to: str = field(
        default="none",
        metadata={
            "help": "Trackers besides metrics.jsonl (always written): none, all (every one installed), or a "
            "comma list of tensorboard, wandb, trackio."
        },
    )
    run_name: str | None = field(default=None, metadata={"help": "Run name in trackers; default output_dir's name."})
    tracker_project: str = field(default="hf_fsdp2", metadata={"help": "wandb / trackio project."})
    eval_steps: int = field(
        default=0,
        metadata={"help": "Evaluate every N steps (and at the end) when an eval set is given; 0 = at the end only."},
    )
    per_device_eval_batch_size: int | None = field(
        default=None, metadata={"help": "Eval examples per batch per rank; default per_device_train_batch_size."}
    )
    eval_prompts: list[str] = field(
        default_factory=list,
        metadata={"help": "Prompts (user turns) completed greedily at each eval and logged as text."},
    )
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Tokens generated per eval prompt."})
    peak_flops: float | None = field(
        default=None,
        metadata={"help": "Peak FLOP/s of one device for MFU; default from the GPU's name (bf16 dense)."},
    )
    profile_steps: str | None = field(
        default=None,
        metadata={"help": "Trace steps 'a-b' with torch.profiler; one Chrome trace per rank in output_dir/profile."},
    )
    memory_snapshot_steps: str | None = field(
        default=None,
        metadata={"help": "CUDA only: record allocations over steps 'a-b' and dump a memory snapshot per rank."},
    )
    distributed_debug: Literal["off", "info", "detail"] = field(
        default="off",
        metadata={"help": "Set TORCH_DISTRIBUTED_DEBUG / NCCL_DEBUG (info), plus the NCCL flight recorder (detail)."},
    )


SECTIONS: tuple[type, ...] = (ModelArgs, DataArgs, TrainArgs, FSDPArgs, PeftArgs, ExportArgs, ObserveArgs)


@dataclass
class Config:
    """All settings of one run, one attribute per concern."""

    model: ModelArgs
    data: DataArgs
    train: TrainArgs
    fsdp: FSDPArgs
    peft: PeftArgs
    export: ExportArgs
    observe: ObserveArgs

    def to_flat_dict(self) -> dict[str, Any]:
        """Every key with its resolved value, in the flat form the YAML recipes use."""
        flat: dict[str, Any] = {}
        for section in (self.model, self.data, self.train, self.fsdp, self.peft, self.export, self.observe):
            flat.update(dataclasses.asdict(section))
        return flat


def known_keys() -> dict[str, dataclasses.Field[Any]]:
    """All config keys, mapped to their dataclass field."""
    return {f.name: f for cls in SECTIONS for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known_keys()), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; run the recipe with --help for all keys"
    return ConfigError(f"unknown config key {key!r} in {where}{hint}")


def _yaml_to_argv(values: dict[str, Any], path: str) -> list[str]:
    """Turn YAML values into ``--key value`` arguments so argparse checks them like CLI ones."""
    fields = known_keys()
    argv: list[str] = []
    for key, value in values.items():
        if key not in fields:
            raise _unknown_key_error(key, path)
        if value is None:
            continue
        if isinstance(value, list):
            if not value:
                factory = fields[key].default_factory
                if callable(factory) and factory() == []:
                    continue  # an empty list is this key's default
                raise ConfigError(f"{key}: an empty list in {path}; give at least one value or remove the key")
            argv.append(f"--{key}")
            argv.extend(str(v) for v in value)
        elif isinstance(value, bool):
            argv.append(f"--{key}={'true' if value else 'false'}")
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
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path} is not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must be a mapping of key: value, got {type(values).__name__}")
    return values


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Parse ``[--config recipe.yaml] [--key value ...]`` into a validated :class:`Config`.

    Args:
        argv: command-line arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The resolved configuration (CLI > YAML > defaults).

    Raises:
        ConfigError: unknown keys or values that cannot work, with the key, value and fix.
        SystemExit: argparse's own exit for ``--help`` and for a value of the wrong type or choice.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    yaml_argv: list[str] = []
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
            yaml_argv = _yaml_to_argv(load_yaml(path), path)
            break
    parser = HfArgumentParser(SECTIONS)  # type: ignore[arg-type]
    parser.add_argument("--config", help="YAML recipe; command-line values override its keys")

    def _error(message: str) -> NoReturn:
        # argparse prints the whole usage and exits; a ConfigError carries just the key and the allowed values.
        raise ConfigError(message)

    parser.error = _error  # type: ignore[method-assign,assignment]
    for arg in args:
        if arg.startswith("--") and arg != "--help":
            key = arg[2:].split("=", 1)[0]
            if key not in known_keys():
                raise _unknown_key_error(key, "the command line")
    parsed = parser.parse_args_into_dataclasses(args=yaml_argv + args, return_remaining_strings=True)
    # HfArgumentParser returns one object per section, then a namespace for the extra --config
    # argument, then the strings it could not place.
    sections, remaining = parsed[: len(SECTIONS)], parsed[-1]
    if remaining:
        raise ConfigError(f"unexpected command-line arguments {remaining}; every value needs a --key before it")
    cfg = Config(*sections)
    validate(cfg)
    return cfg


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Check values that argparse types cannot: ranges and combinations.

    Raises:
        ConfigError: naming the key, its value, what is allowed and the fix.
    """
    m, d, t, f, p, e = cfg.model, cfg.data, cfg.train, cfg.fsdp, cfg.peft, cfg.export
    _check(m.model_name_or_path is not None, "model_name_or_path is required: a hub id or a local model folder")
    _check(
        d.dataset_name is not None or bool(d.dataset_mixture),
        "dataset_name is required: a hub dataset id, a local file or folder (or give dataset_mixture)",
    )
    _check(t.output_dir is not None, "output_dir is required: the folder for the export, metrics and config")
    _check(d.max_length > 0, f"max_length={d.max_length} must be > 0")
    _check(d.dataloader_num_workers >= 0, f"dataloader_num_workers={d.dataloader_num_workers} must be >= 0")
    _check(
        t.per_device_train_batch_size >= 1,
        f"per_device_train_batch_size={t.per_device_train_batch_size} must be >= 1",
    )
    _check(
        t.gradient_accumulation_steps >= 1,
        f"gradient_accumulation_steps={t.gradient_accumulation_steps} must be >= 1",
    )
    _check(t.max_steps == -1 or t.max_steps > 0, f"max_steps={t.max_steps} must be -1 (use epochs) or > 0")
    _check(
        t.max_steps > 0 or (t.num_train_epochs > 0 and math.isfinite(t.num_train_epochs)),
        f"num_train_epochs={t.num_train_epochs} must be > 0 when max_steps=-1",
    )
    _check(t.learning_rate > 0 and math.isfinite(t.learning_rate), f"learning_rate={t.learning_rate} must be > 0")
    _check(t.weight_decay >= 0, f"weight_decay={t.weight_decay} must be >= 0")
    _check(0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1, "adam_beta1 and adam_beta2 must be in [0, 1)")
    _check(0 <= t.warmup_ratio < 1, f"warmup_ratio={t.warmup_ratio} must be in [0, 1)")
    _check(t.warmup_steps >= 0, f"warmup_steps={t.warmup_steps} must be >= 0")
    _check(t.max_grad_norm >= 0, f"max_grad_norm={t.max_grad_norm} must be >= 0 (0 disables clipping)")
    _check(t.ce_chunk_tokens >= 0, f"ce_chunk_tokens={t.ce_chunk_tokens} must be >= 0 (0 = plain logits)")
    _check(t.ddp_timeout > 0, f"ddp_timeout={t.ddp_timeout} must be > 0 seconds")
    _check(t.logging_steps >= 1, f"logging_steps={t.logging_steps} must be >= 1")
    _validate_data(d, m.attn_implementation)
    _validate_observe(cfg.observe, has_eval=d.eval_dataset_name is not None or d.eval_split_fraction > 0)
    _check(t.save_steps >= 0, f"save_steps={t.save_steps} must be >= 0 (0 = no checkpoints)")
    _check(t.save_total_limit >= 0, f"save_total_limit={t.save_total_limit} must be >= 0 (0 keeps all)")
    _check(p.lora_r >= 1, f"lora_r={p.lora_r} must be >= 1")
    _check(0 <= p.lora_dropout < 1, f"lora_dropout={p.lora_dropout} must be in [0, 1)")
    _check(bool(p.lora_target_modules), "lora_target_modules is empty; give module names or all-linear")
    _check(not p.merge_adapter or p.use_peft, "merge_adapter=true needs use_peft=true")
    # Accelerate maps the optimizer's parameters to the sharded ones by data_ptr, which is 0 for every meta
    # parameter of the non-zero ranks: their optimizer then steps the wrong adapter tensors (docs/lora.md).
    _check(
        not (m.resize_token_embeddings and f.fsdp_cpu_ram_efficient_loading),
        "resize_token_embeddings=true with fsdp_cpu_ram_efficient_loading=true is not supported (the new rows are "
        "initialised from the weights, which only rank 0 holds then); resize once offline with "
        "model.resize_token_embeddings(len(tokenizer)) and save_pretrained, or turn the loading option off",
    )
    _check(
        not (p.use_peft and f.fsdp_cpu_ram_efficient_loading),
        "use_peft=true with fsdp_cpu_ram_efficient_loading=true is not supported (the non-zero ranks' optimizer "
        "would hold the wrong adapter parameters); set fsdp_cpu_ram_efficient_loading=false",
    )
    _validate_hub(e, t.save_steps)
    if t.mixed_precision == "fp16":
        raise ConfigError(
            "mixed_precision='fp16' needs a gradient scaler that FSDP2 training here does not use; "
            "use 'bf16' (GPUs since Ampere) or 'no' (fp32)"
        )
    _check(
        _parse_size(e.max_shard_size) > 0, f"max_shard_size={e.max_shard_size!r} must be a size such as '5GB'"
    )
    from hf_fsdp2.parallel.activations import AC_MODES

    _check(
        f.activation_checkpointing is None or f.activation_checkpointing in AC_MODES,
        f"activation_checkpointing={f.activation_checkpointing!r} is not one of {', '.join(AC_MODES)}",
    )
    _check(
        not (f.gradient_checkpointing and f.activation_checkpointing not in (None, "full")),
        f"gradient_checkpointing=true and activation_checkpointing={f.activation_checkpointing!r} disagree; "
        "set only activation_checkpointing",
    )
    _check(f.ac_every_k >= 1, f"ac_every_k={f.ac_every_k} must be >= 1")
    _check(
        f.torch_compile_scope in ("regional", "model"),
        f"torch_compile_scope={f.torch_compile_scope!r} is not one of regional, model",
    )
    _check(
        f.torch_compile_mode in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        f"torch_compile_mode={f.torch_compile_mode!r} is not one of default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs",
    )


def ac_mode(f: FSDPArgs) -> str:
    """The activation-checkpointing mode: ``activation_checkpointing``, else from gradient_checkpointing."""
    if f.activation_checkpointing is not None:
        return f.activation_checkpointing
    return "full" if f.gradient_checkpointing else "none"


def _validate_observe(o: ObserveArgs, *, has_eval: bool) -> None:
    """Trackers (known and installed), eval, profiling ranges, MFU peak."""
    from hf_fsdp2.observe.profiling import parse_step_range
    from hf_fsdp2.observe.trackers import build_trackers

    try:
        build_trackers(o.report_to, ".", project=o.tracker_project, run_name="check")  # names + installed
        parse_step_range(o.profile_steps, "profile_steps")
        parse_step_range(o.memory_snapshot_steps, "memory_snapshot_steps")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _check(o.eval_steps >= 0, f"eval_steps={o.eval_steps} must be >= 0 (0 = evaluate at the end only)")
    _check(
        o.eval_steps == 0 or has_eval,
        f"eval_steps={o.eval_steps} but there is no eval set; give eval_dataset_name or eval_split_fraction "
        "(e.g. 0.05), or set eval_steps=0",
    )
    _check(
        not o.eval_prompts or has_eval,
        "eval_prompts are completed at each eval, but there is no eval set; give eval_dataset_name or "
        "eval_split_fraction",
    )
    _check(
        o.per_device_eval_batch_size is None or o.per_device_eval_batch_size >= 1,
        f"per_device_eval_batch_size={o.per_device_eval_batch_size} must be >= 1 (or unset)",
    )
    _check(o.eval_max_new_tokens >= 1, f"eval_max_new_tokens={o.eval_max_new_tokens} must be >= 1")
    _check(
        o.peak_flops is None or (o.peak_flops > 0 and math.isfinite(o.peak_flops)),
        f"peak_flops={o.peak_flops} must be > 0 FLOP/s of one device (e.g. 989e12 for an H100 SXM in bf16)",
    )


def _validate_hub(e: ExportArgs, save_steps: int) -> None:
    """Hub keys that cannot work together; the token is checked by the recipe before any work."""
    _check(
        e.export_verify_atol is None or e.export_verify_atol > 0,
        f"export_verify_atol={e.export_verify_atol} must be > 0 (or unset for the default by dtype)",
    )
    for key, on in (("push_to_hub", e.push_to_hub), ("push_checkpoints_to_branch", e.push_checkpoints_to_branch)):
        _check(
            not on or bool(e.hub_model_id),
            f"{key} needs hub_model_id, the repo to push to (e.g. --hub_model_id my-org/my-model)",
        )
    if e.hub_model_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(e.hub_model_id)
        except HFValidationError as err:
            raise ConfigError(f"hub_model_id={e.hub_model_id!r} is not a valid repo id: {err}") from err
    if e.push_checkpoints_to_branch:
        _check(
            save_steps > 0,
            f"push_checkpoints_to_branch={e.push_checkpoints_to_branch!r} needs checkpoints: set save_steps > 0",
        )
        _check(
            e.push_checkpoints_to_branch != (e.hub_revision or "main"),
            f"push_checkpoints_to_branch={e.push_checkpoints_to_branch!r} is also the export's branch "
            f"(hub_revision={e.hub_revision or 'main'!r}); use another branch, e.g. 'checkpoints'",
        )


def _validate_data(d: DataArgs, attn_implementation: str) -> None:
    from hf_fsdp2.data.packing import PACKED_ATTENTION_IMPLEMENTATIONS
    from hf_fsdp2.data.sources import parse_column_mapping, parse_source, resolve_sources

    try:
        resolve_sources(
            dataset_name=d.dataset_name,
            dataset_config_name=d.dataset_config_name,
            dataset_split=d.dataset_split,
            dataset_revision=d.dataset_revision,
            dataset_mixture=d.dataset_mixture,
        )
        parse_column_mapping(d.dataset_column_mapping)
        if d.eval_dataset_name is not None:
            parse_source(d.eval_dataset_name, split=d.eval_dataset_split)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _check(
        d.eval_dataset_name is None or d.eval_split_fraction == 0,
        f"eval_dataset_name={d.eval_dataset_name!r} and eval_split_fraction={d.eval_split_fraction}: give one "
        "eval source, a separate dataset or a fraction held out from train",
    )
    _check(0 <= d.eval_split_fraction < 1, f"eval_split_fraction={d.eval_split_fraction} must be in [0, 1)")
    _check(
        d.dataset_num_proc is None or d.dataset_num_proc >= 1,
        f"dataset_num_proc={d.dataset_num_proc} must be >= 1 (or unset: tokenize in the main process)",
    )
    _check(
        d.assistant_only_loss or d.chat_loss in (None, "all"),
        f"chat_loss={d.chat_loss!r} trains on assistant turns but assistant_only_loss=false asks for every token; "
        "unset one of them",
    )
    if (d.packing or d.padding_free) and attn_implementation != "auto":  # auto: checked once the model is loaded
        _check(
            attn_implementation in PACKED_ATTENTION_IMPLEMENTATIONS,
            f"packing={d.packing}, padding_free={d.padding_free} need an attention implementation that keeps "
            f"examples apart by position_ids, one of {list(PACKED_ATTENTION_IMPLEMENTATIONS)}; "
            f"attn_implementation={attn_implementation!r} is not; use sdpa or turn packing off",
        )


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _parse_size(size: str) -> int:
    text = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                return int(float(number) * _UNITS[unit])
            except (ValueError, OverflowError):
                return -1
    try:
        return int(text)
    except (ValueError, OverflowError):
        return -1


def parse_size(size: str) -> int:
    """Bytes in a size string such as ``"5GB"``, ``"500MB"`` or ``"2GiB"``.

    Raises:
        ConfigError: the string is not a positive size.
    """
    value = _parse_size(size)
    if value <= 0:
        raise ConfigError(f"max_shard_size={size!r} must be a positive size such as '5GB' or '500MB'")
    return value


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as a flat YAML recipe that ``--config`` accepts again.

    Returns:
        The path written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(cfg.to_flat_dict(), sort_keys=False))
    return p
