"""Side by side on CPU: hf_fsdp2's SFT recipe vs the HF transformers Trainer vs TRL's SFTTrainer.

    python bench/trainer_bench.py                       # 3 alternating rounds, table + JSON in bench/out/
    python bench/trainer_bench.py --rounds 1 --steps 4 --hidden 64 --layers 2   # a quick look

The same work for every runner: one random-init Llama-architecture model (saved once, loaded by each
run), the same tokenized examples (the recipe's own pipeline: chat template, assistant-only labels) in
the same order, batches of the same examples, fp32, AdamW with the same settings, constant learning
rate, gradient clipping at 1.0, one process (hf_fsdp2 runs FSDP2 at world size 1). Runners:

* ``hf_fsdp2``           the SFT recipe's pieces and loop (``hf_fsdp2.run``, the library's ``train_step``) on
                         its DEFAULT settings: padding-free batches (the start-up probe finds they give this model
                         the padded logits), chunked cross entropy;
* ``hf_fsdp2_padded``    the same with ``padding_free: false`` (padded batches, as the Trainer);
* ``hf_fsdp2_plain_ce``  the defaults with ``ce_chunk_tokens: 0`` (the full [tokens x vocab] logits);
* ``trainer``            ``transformers.Trainer`` with ``DataCollatorForSeq2Seq`` (padded batches);
* ``trl``                ``trl.SFTTrainer`` on the same pre-tokenized examples (its default collator).

Each run is a fresh process; the runs alternate (A B C D E, A B C D E, ...) and the table gives medians
over rounds, the ratio of the medians to ``trainer``'s and each round's own ratio (runs of one round are
minutes apart, so a round's ratio is the least noisy comparison). Each round also times an fp32 matmul
(``matmul_gflops``: the best of several 1024^3 products, same threads) and every runner's useful FLOP/s
(6N + 12LHQT per real token of each example, the library's FLOP model) is given as a fraction of it. Per run:

* ``target_tok_s``: target (trained) tokens of steps ``warmup+1..steps`` over the wall time between the
  end of step ``warmup`` and the end of the last step (the same clock for every runner: the time each
  step's end is reported);
* ``peak_rss_gib``: the process's peak resident memory over the training steps (Linux ``VmHWM``, reset
  when training starts, so model building and tokenizing are left out; ``ru_maxrss`` elsewhere);
* ``padding_eff``: target tokens / positions processed over all steps;
* ``final_loss``: the loss of the last step (mean over its target tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUNNERS = ("hf_fsdp2", "hf_fsdp2_padded", "hf_fsdp2_plain_ce", "trainer", "trl")


def reset_peak_rss() -> None:
    """Start the peak-memory count now (Linux: VmHWM is reset by writing 5 to /proc/self/clear_refs), so
    that the peak is the training steps', not the set-up's (model building, tokenizing)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_gib() -> float:
    """The process's peak resident memory since :func:`reset_peak_rss` (VmHWM), else since its start."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


# ---------------------------------------------------------------------------------------------- set-up


def prepare(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Model folder, data JSONL and the shared example order, once for all runs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from data_bench import chatterbot_records, load_bench_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_name = load_bench_tokenizer(args.tokenizer)
    records = chatterbot_records()
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "tokenizer": tokenizer_name,
        "examples": len(records),
        "params": n_params,
        "vocab": len(tokenizer),
    }


def shared_settings(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return {
        "model_name_or_path": str(work / "model"),
        "dataset_name": str(work / "chat.jsonl"),
        "max_length": args.max_length,
        "max_steps": args.steps,
        "per_device_train_batch_size": args.batch_size,
        "gradient_accumulation_steps": 1,
        "learning_rate": args.lr,
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "seed": 42,
    }


def tokenized_examples(settings: dict[str, Any]) -> Any:
    """The recipe's tokenized training examples (the same call the recipe makes)."""
    from hf_fsdp2.config import DataArgs
    from hf_fsdp2.data.mixture import build_sft_datasets_from_config
    from hf_fsdp2.model import load_tokenizer

    tokenizer = load_tokenizer(settings["model_name_or_path"])
    d = DataArgs(dataset_name=settings["dataset_name"], max_length=settings["max_length"])
    return tokenizer, build_sft_datasets_from_config(d, tokenizer, seed=settings["seed"]).train


def recipe_order(n: int, seed: int) -> list[int]:
    """The order in which the recipe (one rank) visits the examples in its first epoch."""
    from hf_fsdp2.data.loader import ShardedSampler

    return list(iter(ShardedSampler(n, rank=0, world_size=1, seed=seed)))


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Achieved fp32 FLOP/s of an n x n x n matmul on this CPU (the best of ``repeats`` timed products)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def useful_flops(settings: dict[str, Any], first: int, last: int) -> float:
    """The FLOPs of steps ``first+1..last`` that any runner must do: the library's FLOP model (6N + 12LHQT per
    token, T each example's own length) over the real tokens of the examples of those steps (the same examples
    in the same order for every runner)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp2.observe.flops import flops_model, non_embedding_params

    config = AutoConfig.from_pretrained(settings["model_name_or_path"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    flops = flops_model(config, non_embedding_params(model))
    _, examples = tokenized_examples(settings)
    order = recipe_order(len(examples), settings["seed"])
    size = settings["per_device_train_batch_size"]
    lengths = [len(examples[i]["input_ids"]) for i in order[first * size : last * size]]
    return float(flops.for_sequences(lengths))


# ---------------------------------------------------------------------------------------------- runners


@dataclass
class RecipePieces:
    """The SFT recipe's pieces up to its loop, as a recipe run builds them (:func:`recipe_pieces`)."""

    cfg: Any
    session: Any
    data: Any
    model: Any
    optimizer: Any
    scheduler: Any
    observer: Any
    step_settings: Any
    batches: Iterator[dict[str, Any]]


@contextlib.contextmanager
def recipe_pieces(
    settings: dict[str, Any], out_dir: Path, extra: dict[str, Any], config_path: Path
) -> Iterator[RecipePieces]:
    """Build the SFT recipe's pieces (hf_fsdp2.run) from ``settings`` + ``extra`` (its config written to
    ``config_path``), the model in train mode; after the body, the observer is closed and training ended."""
    import yaml

    from hf_fsdp2.config import parse_config
    from hf_fsdp2.methods.sft.data import build_sft_data
    from hf_fsdp2.run.build import build_model, build_schedule, load_run_tokenizer
    from hf_fsdp2.run.observer import Observer
    from hf_fsdp2.run.session import Session
    from hf_fsdp2.train.step import StepSettings

    config = {
        **settings,
        "output_dir": str(out_dir),
        "overwrite_output_dir": True,
        "mixed_precision": "no",
        "logging_steps": 1,
        "save_steps": 0,
        "export_verify": False,
        **extra,
    }
    config_path.write_text(yaml.safe_dump(config))
    cfg = parse_config(["--config", str(config_path)])
    with Session.start(cfg) as session:
        tokenizer = load_run_tokenizer(session)
        data = build_sft_data(session, tokenizer)
        model, optimizer = build_model(session, tokenizer)
        scheduler = build_schedule(session, optimizer, data.total_steps)
        observer = Observer(
            session,
            model,
            tokenizer,
            eval_set=None,
            collator=data.collator,
            first_step=1,
            total_steps=data.total_steps,
        )
        step_settings = StepSettings(
            model.loss_plan, cfg.train.max_grad_norm, cfg.fsdp.fsdp_sync_each_microbatch
        )
        batches = observer.timed(data.stream)
        model.module.train()
        yield RecipePieces(cfg, session, data, model, optimizer, scheduler, observer, step_settings, batches)
        observer.close()
        session.accelerator.end_training()


def run_hf_fsdp2(settings: dict[str, Any], out_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """The SFT recipe's own pieces and loop (hf_fsdp2.run, hf_fsdp2.train.step.train_step), timed at each
    step's end; the metrics file and log line are written as in a recipe run."""
    from hf_fsdp2.train.step import train_step

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    ends: list[float] = []
    losses: list[float] = []
    targets: list[int] = []
    processed: list[int] = []
    with recipe_pieces(settings, out_dir, extra, out_dir.parent / f"{out_dir.name}.yaml") as run:
        reset_peak_rss()
        for step in range(1, run.data.total_steps + 1):
            run.observer.start_step(step)
            micro_batches = [next(run.batches) for _ in range(run.cfg.train.gradient_accumulation_steps)]
            out = train_step(
                run.model.module,
                run.optimizer,
                run.scheduler,
                micro_batches,
                run.step_settings,
                run.session.device,
            )
            record = run.observer.end_step(
                step, micro_batches, out, run.model.module, epoch=run.data.stream.epoch
            )
            ends.append(time.perf_counter())
            assert record is not None  # logging_steps 1
            losses.append(record["loss"])
            targets.append(out.target_tokens)
            processed.append(out.processed_tokens)
        peak = peak_rss_gib()
    return {
        "step_ends": ends,
        "targets": targets,
        "processed": processed,
        "losses": losses,
        "peak_rss_gib": peak,
    }


def run_hf_trainer(settings: dict[str, Any], out_dir: Path, use_trl: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback

    tokenizer, examples = tokenized_examples(settings)
    order = recipe_order(len(examples), settings["seed"])
    examples = examples.select(order).select_columns(["input_ids", "labels"])
    model = AutoModelForCausalLM.from_pretrained(settings["model_name_or_path"], dtype=torch.float32)
    model.config.use_cache = False
    ends: list[float] = []
    peaks: list[float] = []

    class StepEnds(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            reset_peak_rss()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())
            peaks.append(peak_rss_gib())

    common = {
        "output_dir": str(out_dir),
        "per_device_train_batch_size": settings["per_device_train_batch_size"],
        "gradient_accumulation_steps": 1,
        "max_steps": settings["max_steps"],
        "learning_rate": settings["learning_rate"],
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "optim": "adamw_torch",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "dataloader_num_workers": 0,
        "seed": settings["seed"],
        "disable_tqdm": True,
    }
    if use_trl:
        from trl import SFTConfig, SFTTrainer

        trainer_args: Any = SFTConfig(**common, max_length=settings["max_length"], packing=False)
        base: Any = SFTTrainer
        kwargs: dict[str, Any] = {"processing_class": tokenizer}
    else:
        from transformers import TrainingArguments

        trainer_args = TrainingArguments(**common)
        base = Trainer
        kwargs = {"data_collator": DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)}

    class InOrder(base):  # type: ignore[misc,valid-type]
        """The recipe's example order (pre-applied above), read sequentially."""

        def _get_train_sampler(self, *a: Any, **k: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(
        model=model, args=trainer_args, train_dataset=examples, callbacks=[StepEnds()], **kwargs
    )
    # The positions each batch processes, from the trainer's own collator on the same batches.
    collate = trainer.data_collator
    size = settings["per_device_train_batch_size"]
    targets, processed = [], []
    for step in range(settings["max_steps"]):
        batch = collate([trainer.train_dataset[i] for i in range(step * size, (step + 1) * size)])
        labels = batch["labels"]
        targets.append(int((labels[:, 1:] != -100).sum()))
        processed.append(labels.numel())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "step_ends": ends,
        "targets": targets,
        "processed": processed,
        "losses": losses,
        "peak_rss_gib": peaks[-1],
    }


def child(runner: str, work: Path, out: Path, args: argparse.Namespace) -> None:
    settings = shared_settings(args, work)
    run_dir = work / "runs" / f"{runner}"
    if runner == "matmul":
        out.write_text(json.dumps({"runner": runner, "matmul_gflops": matmul_gflops() / 1e9}))
        return
    if runner == "hf_fsdp2":
        result = run_hf_fsdp2(settings, run_dir, {})
    elif runner == "hf_fsdp2_padded":
        result = run_hf_fsdp2(settings, run_dir, {"padding_free": False})
    elif runner == "hf_fsdp2_plain_ce":
        result = run_hf_fsdp2(settings, run_dir, {"ce_chunk_tokens": 0})
    else:
        result = run_hf_trainer(settings, run_dir, use_trl=runner == "trl")
    w = args.warmup
    ends, targets = result["step_ends"], result["targets"]
    if len(ends) != args.steps or len(result["losses"]) != args.steps:
        raise RuntimeError(
            f"{runner}: {len(ends)} step ends and {len(result['losses'])} losses for {args.steps} steps"
        )
    seconds = ends[-1] - ends[w - 1]
    summary = {
        "runner": runner,
        "target_tok_s": sum(targets[w:]) / seconds,
        "useful_gflops": useful_flops(settings, w, args.steps) / seconds / 1e9,
        "peak_rss_gib": result["peak_rss_gib"],
        "padding_eff": sum(targets) / sum(result["processed"]),
        "final_loss": result["losses"][-1],
        "losses": result["losses"],
        "target_tokens": sum(targets),
    }
    out.write_text(json.dumps(summary))


# ---------------------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None, run: Callable[..., Any] = subprocess.run) -> None:
    """The command line (``argv``, default sys.argv); each run is ``run(command, cwd=, env=, capture_output=True,
    text=True)`` (subprocess.run: a fresh process; the tests fork the same command line from a pre-imported one)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokenizer", default="auto", help="auto | smollm2 | llama2 (see bench/data_bench.py)")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "trainer_bench"))
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.work)
    if args.child:
        child(args.child, work, Path(args.child_out), args)
        sys.stdout.flush()
        os._exit(0)  # as the recipe: no interpreter finalization after a gloo run
    if not 1 <= args.warmup < args.steps:
        sys.exit(f"--warmup {args.warmup} must be in [1, --steps)")
    runners = args.runners.split(",")
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        sys.exit(f"unknown runners {unknown}; choose from {', '.join(RUNNERS)}")
    setup = prepare(work, args)
    print(
        f"model: {setup['params'] / 1e6:.1f}M parameters, vocab {setup['vocab']} ({setup['tokenizer']}); "
        f"{setup['examples']} examples; {args.steps} steps of {args.batch_size}; fp32; torch threads "
        f"{os.environ.get('OMP_NUM_THREADS', 'default')}",
        flush=True,
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    passthrough = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--max-length",
        str(args.max_length),
        "--lr",
        str(args.lr),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--work",
        str(work),
    ]
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in [*runners, "matmul"]}
    for round_ in range(args.rounds):
        for runner in [*runners, "matmul"]:  # alternate: one run of each per round
            out = work / f"{runner}.{round_}.json"
            start = time.perf_counter()
            proc = run(
                [sys.executable, __file__, "--child", runner, "--child-out", str(out), *passthrough],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0 or not out.exists():
                sys.exit(
                    f"{runner} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
                )
            result = json.loads(out.read_text())
            results[runner].append(result)
            if runner == "matmul":
                print(f"round {round_ + 1} fp32 matmul {result['matmul_gflops']:.1f} GFLOP/s", flush=True)
                continue
            print(
                f"round {round_ + 1} {runner:18s} {result['target_tok_s']:8.1f} target tok/s  "
                f"peak {result['peak_rss_gib']:.2f} GiB  loss {result['final_loss']:.4f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    table = summarize(results)
    print_table(table)
    report = {"setup": setup, "args": vars(args), "runs": results, "medians": table}
    (work / "results.json").write_text(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over rounds per runner, their ratios to the Trainer's, each round's own ratios, and the useful
    FLOP/s as a fraction of the fp32 matmul timed in the same round."""
    matmul = [r["matmul_gflops"] for r in results.get("matmul", [])]
    table: dict[str, dict[str, Any]] = {}
    for runner, runs in results.items():
        if runner == "matmul" or not runs:
            continue
        row: dict[str, Any] = {
            key: statistics.median(r[key] for r in runs)
            for key in ("target_tok_s", "peak_rss_gib", "padding_eff", "final_loss", "useful_gflops")
        }
        if matmul:
            row["matmul_fraction"] = statistics.median(
                r["useful_gflops"] / m for r, m in zip(runs, matmul, strict=False)
            )
        table[runner] = row
    base_runs = results.get("trainer")
    if base_runs:
        base = table["trainer"]
        for runner, row in table.items():
            row["speed_vs_trainer"] = row["target_tok_s"] / base["target_tok_s"]
            row["memory_vs_trainer"] = row["peak_rss_gib"] / base["peak_rss_gib"]
            pairs = list(zip(results[runner], base_runs, strict=False))
            row["speed_vs_trainer_per_round"] = [r["target_tok_s"] / b["target_tok_s"] for r, b in pairs]
            row["memory_vs_trainer_per_round"] = [r["peak_rss_gib"] / b["peak_rss_gib"] for r, b in pairs]
    if matmul:
        table["matmul"] = {"matmul_gflops": statistics.median(matmul), "per_round": matmul}
    return table


def print_table(table: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'runner':18s} {'target tok/s':>12s} {'x trainer':>9s} {'per round':>14s} {'peak GiB':>9s} "
        f"{'x trainer':>9s} {'pad eff':>8s} {'final loss':>10s} {'GFLOP/s':>8s} {'of matmul':>9s}"
    )
    for runner, row in table.items():
        if runner == "matmul":
            continue
        rounds = ",".join(f"{x:.2f}" for x in row.get("speed_vs_trainer_per_round", []))
        print(
            f"{runner:18s} {row['target_tok_s']:12.1f} {row.get('speed_vs_trainer', float('nan')):9.2f} "
            f"{rounds:>14s} {row['peak_rss_gib']:9.2f} {row.get('memory_vs_trainer', float('nan')):9.2f} "
            f"{row['padding_eff']:8.1%} {row['final_loss']:10.4f} {row['useful_gflops']:8.1f} "
            f"{row.get('matmul_fraction', float('nan')):9.1%}"
        )
    if "matmul" in table:
        print(
            f"fp32 matmul (1024^3, same threads): {table['matmul']['matmul_gflops']:.1f} GFLOP/s (median of rounds)"
        )


if __name__ == "__main__":
    main()
