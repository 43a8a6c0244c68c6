"""Worker for tests/distributed/test_compile_recompiles.py: training steps on real chat records of mixed
lengths (token and target counts change every step), an eval pass and generation in between, in eager mode
and under each compile scope, padding-free and padded. Reports per-step summed losses and the compile counters
after every step and after the eval. Run under torchrun; rank 0 writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoTokenizer

from hf_fsdp2 import collectives
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.observe.evaluate import eval_batches, evaluate_loss, generate_samples
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.activations import apply_activation_checkpointing
from hf_fsdp2.parallel.all_to_all import enable_context_parallel, shard_sequence
from hf_fsdp2.parallel.compiling import CompileWatch, compile_model, compile_regions
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.parallel.tensor import apply_tensor_parallel, tp_plan_for
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, shifted_target_rows

BATCH = 2


class _Plan(CompilePlan):
    """The run's compile plan with the test's backend: dynamo's guards, graph breaks and recompiles are the same
    whatever the backend; aot_eager (AOT autograd, no code generation) skips inductor's C++ builds, which take
    minutes per configuration on a 2-core CPU."""

    backend = "inductor"

    def kwargs(self) -> dict:
        return {**super().kwargs(), "backend": self.backend}


def examples(tokenizer, path: str) -> list[dict[str, list[int]]]:  # type: ignore[no-untyped-def]
    """Chat records tokenized with the chat template; loss on the assistant reply only."""
    out = []
    for line in Path(path).read_text().splitlines():
        messages = json.loads(line)["messages"]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        labels = [IGNORE_INDEX] * len(prompt) + list(ids[len(prompt) :])
        out.append({"input_ids": list(ids), "labels": labels})
    return out


def run(acc, args, scope: str, layout: str, data: list, tokenizer) -> dict:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = load_model(args.model).double()  # float64: compiled vs eager differ by rounding only
    _Plan.backend = args.whole_model_backend if scope == "model" else args.backend
    compile_plan = _Plan(enabled=scope != "eager", scope="regional" if scope == "eager" else scope)
    cp = layout.startswith("cp")  # context parallel over both ranks: one batch, each rank half of every row
    tp = layout.startswith(
        "tp"
    )  # tensor parallel over both ranks (no FSDP2): one batch, padded to even lengths
    collectives.set_layout(
        cp=2 if cp else 1, tp=2 if tp else 1, cp_group=torch.distributed.group.WORLD if cp else None
    )
    if cp:
        enable_context_parallel(model, torch.distributed.group.WORLD, 2)
    plan = ParallelPlan(layer_cls=decoder_layer_classes(model), ac=ShardingPlan().ac, compile=compile_plan)
    if tp:  # parallelize's order without its FSDP2 step: the data dimension would be 1 rank
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), tp_plan_for(model))
        apply_activation_checkpointing(model, plan.ac, plan.layer_cls)
        if compile_plan.enabled and scope == "regional":
            compile_regions(model, plan.layer_cls, compile_plan)
        elif compile_plan.enabled:
            compile_model(model, compile_plan)
    else:
        model = parallelize(model, acc, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # linear in the gradient: rounding is not amplified
    collate = (
        PackedCollator(tokenizer.pad_token_id, padding_free=True)
        if layout.endswith("pf")
        else PaddingCollator(tokenizer.pad_token_id, pad_to_multiple_of=2 if tp else None)
    )
    plan = LossPlan(8)  # chunks of 8 target rows: the chunk count changes with the step's targets
    watch = CompileWatch(enabled=scope != "eager").start()
    rank, world = acc.process_index, acc.num_processes
    out: dict = {"loss_sums": [], "targets": [], "tokens": [], "compile": [], "eval_loss": []}
    train, held_out = data[: -2 * world], data[-2 * world :]
    for step in range(args.steps):
        # Context parallel: both ranks read the batches rank 1 reads without it (their target counts all differ).
        first = (step * world + (1 if cp or tp else rank)) * BATCH
        batch = collate(train[first : first + BATCH])
        if cp:
            batch = shard_sequence(batch, 2, rank)
        rows = shifted_target_rows(batch["labels"])
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        loss = causal_lm_loss(model, inputs, batch["labels"], plan, rows).ce_sum
        acc.backward(loss / 64)
        opt.step()
        opt.zero_grad()
        sums = collectives.all_reduce_sum(
            torch.tensor([float(loss), float(rows.numel())], dtype=torch.float64)
        )
        out["loss_sums"].append(
            float(sums[0]) / (2 if tp else 1)
        )  # a tp group's ranks each hold the whole loss
        out["targets"].append(int(sums[1]))
        out["tokens"].append(int(batch["input_ids"].numel()))
        out["compile"].append(watch.take())
        if step == args.eval_after:  # eval and generation between steps, as the recipe does
            data_rank, data_world = (0, 1) if cp or tp else (rank, world)
            batches = eval_batches(
                held_out, rank=data_rank, world_size=data_world, batch_size=BATCH, collator=collate
            )
            out["eval_loss"].append(evaluate_loss(model, batches, torch.device("cpu"), plan=plan).loss)
            generate_samples(model, tokenizer, ["red green"], max_new_tokens=3, device=torch.device("cpu"))
            out["compile"].append(watch.take())
    collectives.set_layout()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--configs", required=True, help="comma-separated scope:layout, scope eager|regional|model"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--eval_after", type=int, default=2)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--whole_model_backend", default="inductor")
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = examples(tokenizer, args.data)
    results = {}
    for item in args.configs.split(","):
        scope, layout = item.split(":")
        results[item] = run(acc, args, scope, layout, data, tokenizer)
    if acc.process_index == 0:
        Path(args.out).write_text(json.dumps(results))
    acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
