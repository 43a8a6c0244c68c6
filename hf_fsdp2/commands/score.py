"""``hf-fsdp2 score``: a reward model's accuracy on preference pairs (held-out pairs after ``hf-fsdp2 train rm``)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, load_failed, model_path, read_records

logger = logging.getLogger("hf_fsdp2")


def _run_score(args: argparse.Namespace) -> int:
    records = read_records(args.data, "--data")
    source = model_path(args.model, what="--model")
    import torch

    from hf_fsdp2.demo.tasks import reward_accuracy
    from hf_fsdp2.model import auto_class_name, load_model, load_model_config, load_tokenizer

    try:
        tokenizer = load_tokenizer(source)
        if auto_class_name(load_model_config(source)) != "AutoModelForSequenceClassification":
            logger.warning(
                "%s is not a reward model (no *ForSequenceClassification architecture): its score head is new, "
                "initialised from --seed %d as the reward recipe initialises it (the accuracy a run starts from)",
                source,
                args.seed,
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            model = load_model(source, reward_head=int(tokenizer.pad_token_id))
    except (OSError, ValueError) as err:
        raise load_failed("--model", source, err) from err
    print(json.dumps(reward_accuracy(model, tokenizer, records, batch_size=args.batch_size)))
    return 0


def register_score(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "score",
        help="a reward model's accuracy on preference pairs (the chosen answer scored higher)",
        description=(
            "Load the reward model in MODEL (an export of recipes/rm.py: fp32, CPU; a causal LM gets the score head "
            "the recipe starts from), score both completions of every pair of DATA and print "
            '{"accuracy": a, "mean_margin": m, "mean_reward": r, "n": n}.'
        ),
    )
    p.add_argument("--model", type=Path, required=True, help="HF model folder (config, weights, tokenizer)")
    p.add_argument("--data", type=Path, required=True, help="prompt / chosen / rejected records (JSON Lines)")
    p.add_argument("--batch-size", type=int, default=16, help="pairs scored together (default: 16)")
    p.add_argument(
        "--seed", type=int, default=42, help="seeds a new score head (default: 42, the recipes' seed)"
    )
    p.set_defaults(func=_run_score)
