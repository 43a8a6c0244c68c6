"""``hf-fsdp2 show-data``: a recipe's tokenized training examples with the trained tokens highlighted
(:mod:`hf_fsdp2.data.mixture`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, recipe_argv, user_error


def _run_show_data(args: argparse.Namespace) -> int:
    import datasets

    from hf_fsdp2.config import ConfigError, parse_config
    from hf_fsdp2.config.sources import DataSource
    from hf_fsdp2.data.loading import load_source
    from hf_fsdp2.data.mixture import build_sft_datasets_from_config, format_trained_spans
    from hf_fsdp2.data.packing import layout_summary, pack_examples
    from hf_fsdp2.model import load_tokenizer

    argv = recipe_argv(args)
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
        return user_error("show-data", err)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    scope = f"the first {limit} records of each source" if limit > 0 else "every record"
    print(f"# {scope}; trained tokens {'highlighted' if color else 'between [[ and ]]'}")
    for line in data.summary_lines(d.max_length):
        print(f"# {line}")
    packed = pack_examples(data.train, d.max_length) if d.packing else None
    print(
        "# "
        + layout_summary(
            data.train,
            packed,
            batch_size=t.per_device_train_batch_size,
            world_size=1,
            seed=t.seed,
            padding_free=bool(d.padding_free),
        )
    )
    offset = 0
    for stats, count in zip(data.stats, data.train_counts, strict=False):
        for i in range(offset, offset + min(args.num_examples, count)):
            example = data.train[i]
            ids, labels = example["input_ids"], example["labels"]
            print(
                f"\n=== {stats.source} ({stats.dataset_format}): example {i - offset}, {len(ids)} tokens, "
                f"{example['num_targets']} trained ==="
            )
            print(format_trained_spans(tokenizer, ids, labels, color=color))
            if args.tokens:
                tokens = tokenizer.convert_ids_to_tokens(ids)
                for position, (token_id, token, label) in enumerate(zip(ids, tokens, labels, strict=True)):
                    mark = "T" if position > 0 and label != -100 else "."
                    print(f"{position:6d} {mark} {token_id:8d} {token!r}")
        offset += count
    return 0


def register_show_data(subparsers: Subparsers) -> None:
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
