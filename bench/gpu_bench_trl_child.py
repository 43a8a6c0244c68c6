"""gpu_bench.py's TRL child: one ``trl.SFTTrainer`` runner, in the process ``accelerate launch`` started
(``gpu_bench.py --trl-child kernels:ac``); writes its raw measurements as JSON for `gpu_bench_trl.run_trl`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from gpu_bench_work import BETAS, EPS, LR, SHAPES, batch_counts, max_mem_gib, summarize, sync, trl_rows


def fsdp_on_gloo() -> None:
    """CPU only: mark Accelerate's shared state FSDP before the Trainer builds its Accelerator.

    Accelerate turns FSDP on only for GPU-like distributed types; on CPU it would train an unsharded copy.
    The plugin is built from the variables ``accelerate launch`` set from TRL's FSDP2 file, and the
    Trainer is told to use this state (``accelerator_config={"use_configured_state": True}``): its
    Accelerator then prepares the model through the same FSDP2 path as on a GPU, on gloo.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = PartialState(cpu=True)
    state._shared_state["distributed_type"] = DistributedType.FSDP
    state._shared_state["fsdp_plugin"] = FullyShardedDataParallelPlugin()


def trl_child(args: argparse.Namespace) -> None:
    """One TRL runner, in the process ``accelerate launch`` started: writes its raw measurements as JSON."""
    from accelerate.utils import DistributedType
    from datasets import Dataset
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hf_fsdp2.observe.flops import flops_model, non_embedding_params

    kernels, ac = args.trl_child.split(":")
    on_cpu = args.cpu or not torch.cuda.is_available()
    if on_cpu:
        fsdp_on_gloo()
    vocab = SHAPES[args.shape]["vocab_size"]
    total = args.warmup + args.steps
    dataset = Dataset.from_dict(trl_rows(args.seq, vocab, total))
    work = Path(args.trl_out).parent
    settings: dict[str, Any] = {
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": True,
        "dataset_kwargs": {"skip_prepare_dataset": True},  # the rows come packed: the same for every runner
        "train_sampling_strategy": "sequential",  # step i trains on row i, as the hf_fsdp2 runners do
        "max_length": args.seq,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": ac == "full",
        "use_liger_kernel": kernels == "liger",
        "bf16": not on_cpu,
        "model_init_kwargs": {"attn_implementation": "sdpa", "dtype": "float32"},
        "learning_rate": LR,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "weight_decay": 0.0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "max_steps": total,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    placement: dict[str, Any] = (
        {"use_cpu": True, "accelerator_config": {"use_configured_state": True}} if on_cpu else {}
    )
    config = SFTConfig(output_dir=str(work / f"trl-{kernels}-{ac}"), **settings, **placement)
    ends: list[float] = []
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())

    class StepEnds(TrainerCallback):
        """The same clock as the hf_fsdp2 runners: a step ends when the device is done with it."""

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_step_end(self, *a: Any, **k: Any) -> None:
            sync(device)
            ends.append(time.perf_counter())

    trainer = SFTTrainer(model=args.trl_model, args=config, train_dataset=dataset, callbacks=[StepEnds()])
    model = trainer.model
    flops = flops_model(model.config, non_embedding_params(model))
    collate = trainer.data_collator
    counts: list[tuple[int, int, float]] = []

    def counting_collator(examples: list[dict[str, Any]]) -> dict[str, Any]:
        # Counts what TRL's own collator hands the model, in the order the steps consume it.
        batch = collate(examples)
        counts.append(batch_counts(batch, flops))
        return batch

    trainer.data_collator = counting_collator
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if len(ends) != total or len(counts) < total or len(losses) != total:
        raise RuntimeError(
            f"TRL ran {len(ends)} steps, {len(counts)} batches, {len(losses)} losses for {total}"
        )
    w = args.warmup
    sharded = any(isinstance(p, DTensor) for p in trainer.model.parameters())
    result = {
        **summarize(counts[w:total], ends[-1] - ends[w - 1]),
        "max_mem_allocated_gib": max_mem_gib(device),
        "final_loss": losses[-1],
        "fsdp2_sharded": bool(
            sharded
            and trainer.accelerator.distributed_type == DistributedType.FSDP
            and trainer.accelerator.is_fsdp2
        ),
        "settings": {**settings, **placement},
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.trl_out).write_text(json.dumps(result))
