"""``hf-fsdp2 export`` (a sharded checkpoint to a consolidated HF folder, :mod:`hf_fsdp2.export`) and
``hf-fsdp2 merge-adapter`` (a LoRA adapter merged into its base offline, :mod:`hf_fsdp2.lora.merge`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, model_path, user_error


def _run_export(args: argparse.Namespace) -> int:
    import yaml

    from hf_fsdp2.checkpoint.layout import STATE_FILE
    from hf_fsdp2.checkpoint.resume import checkpoint_problems
    from hf_fsdp2.config import CONFIG_NAME, ConfigError, parse_size
    from hf_fsdp2.export import ExportError, export_checkpoint
    from hf_fsdp2.export.offline import write_full_model
    from hf_fsdp2.lora.offline import wrap_lora, write_lora
    from hf_fsdp2.observe.logs import last_metrics

    ckpt = Path(args.checkpoint).expanduser()
    config = ckpt / CONFIG_NAME
    try:
        saved = yaml.safe_load(config.read_text()) if config.is_file() else {}
        lora = bool((saved if isinstance(saved, dict) else {}).get("use_peft"))
    except (yaml.YAMLError, UnicodeDecodeError):
        # checkpoint_problems names the file, the line and the reason.
        problems = "; ".join(checkpoint_problems(ckpt, digests=False)[:3]) or f"{CONFIG_NAME} cannot be read"
        return user_error(
            "export",
            ExportError(
                f"{ckpt} is damaged: {problems}. Restore the file from a copy, or export an earlier "
                "checkpoint-<step> of the run"
            ),
        )
    # The model card's figures: the run's last logged step at or before the checkpoint's (none if unreadable).
    try:
        step = int(json.loads((ckpt / STATE_FILE).read_text()).get("step", 0))
        metrics = last_metrics(ckpt.parent, step)
    except (OSError, ValueError):
        metrics = None
    try:
        result = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            dtype=args.dtype,
            max_shard_bytes=parse_size(args.max_shard_size) if args.max_shard_size else None,
            overwrite=args.overwrite,
            verify=not args.no_verify,
            verify_atol=args.verify_atol,
            metrics=metrics,
            wrap=wrap_lora if lora else None,
            write=write_lora if lora else write_full_model,
        )
    except (ExportError, ConfigError, FileNotFoundError) as err:
        return user_error("export", err)
    print(
        json.dumps(
            {
                "out_dir": str(result.out_dir),
                "files": result.files,
                "total_bytes": result.total_bytes,
                "dtype": result.dtype,
                "verified": result.verify.summary() if result.verify else None,
            }
        )
    )
    return 0


def register_export(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the consolidated HF folder (safetensors, config, tokenizer, card) of a sharded checkpoint",
        description=(
            "Rebuild the run's model from CHECKPOINT/hf_fsdp2_config.yaml (model_name_or_path gives the "
            "architecture, tokenizer and generation config), fill it from the checkpoint's DCP shards and "
            "write OUT_DIR as the end of training does: sharded safetensors + index, config.json, "
            "generation_config.json, tokenizer with chat template, README.md model card; verified before it "
            "is published. One process; needs host memory for the model in its training dtype."
        ),
    )
    p.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="a <output_dir>/checkpoint-<step> folder"
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the export folder (empty or new)")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "float16", "training"],
        default=None,
        help="dtype of the safetensors (default: the run's export_dtype; training = as trained)",
    )
    p.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        default=None,
        help="largest safetensors file, e.g. 5GB or 500MB (default: the run's max_shard_size)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="export into a non-empty OUT_DIR, replacing its files"
    )
    p.add_argument("--no-verify", action="store_true", help="skip the verification (not recommended)")
    p.add_argument(
        "--verify-atol",
        type=float,
        default=None,
        help="probe-logit tolerance (default: by dtype, docs/export.md)",
    )
    p.set_defaults(func=_run_export)


def _run_merge_adapter(args: argparse.Namespace) -> int:
    from hf_fsdp2.config import ConfigError, parse_size
    from hf_fsdp2.export import ExportError
    from hf_fsdp2.lora.adapter import LoraError
    from hf_fsdp2.lora.merge import merge_adapter_offline

    try:
        base = args.base_model or _adapter_base(args.adapter_dir)
        result = merge_adapter_offline(
            args.adapter_dir,
            args.out_dir,
            base_model=model_path(base, what="the base model") if base else None,
            dtype=args.dtype,
            max_shard_bytes=parse_size(args.max_shard_size),
            overwrite=args.overwrite,
            verify=not args.no_verify,
        )
    except (LoraError, ExportError, ConfigError, FileNotFoundError, OSError) as err:
        return user_error("merge-adapter", err)
    print(json.dumps(result))
    return 0


def _adapter_base(adapter_dir: Path) -> str | None:
    """adapter_config.json's base_model_name_or_path, to check before loading (None: merge_adapter_offline says
    what is wrong with the folder)."""
    from hf_fsdp2.export.folder import json_problem
    from hf_fsdp2.lora.adapter import ADAPTER_CONFIG_NAME

    config = adapter_dir / ADAPTER_CONFIG_NAME
    if not config.is_file() or json_problem(config):
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    return str(base) if base else None


def register_merge_adapter(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "merge-adapter",
        help="merge a PEFT LoRA adapter into its base model offline and write a consolidated HF folder",
        description=(
            "Load the base model (adapter_config.json's base_model_name_or_path unless --base-model) in fp32, "
            "apply ADAPTER_DIR with PEFT, merge (W + scale * B @ A) and write OUT_DIR as the export does: "
            "safetensors, config, tokenizer; verified by a fresh-process reload before it is published. One "
            "process; needs host memory for the model in fp32."
        ),
    )
    p.add_argument(
        "adapter_dir",
        type=Path,
        metavar="ADAPTER_DIR",
        help="adapter_config.json + adapter_model.safetensors",
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the merged model folder (empty or new)")
    p.add_argument(
        "--base-model", "--base_model", dest="base_model", default=None, help="base model folder or hub id"
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16", help="dtype of the weights"
    )
    p.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        default="5GB",
        help="largest safetensors file",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty OUT_DIR, replacing its files"
    )
    p.add_argument("--no-verify", action="store_true", help="skip the verification (not recommended)")
    p.set_defaults(func=_run_merge_adapter)
