"""Worker for tests/distributed/test_export_composite_2rank.py: per composite folder, load it with its own class (rank 0
reads the weights, the others build it on meta), freeze the tower and projector, shard (each text decoder layer, the tower, the projector: one unit each), train
one step on text, and export gather-free against the folder it was loaded from.

Run under torchrun with ``--family NAME=FOLDER`` pairs; rank 0 writes ``<out>/<name>/trained.pt`` (the full trained
state dict, gathered here only as the test's reference) and ``<out>/report.json``. ``--checkpoint NAME`` also saves a
sharded checkpoint of that family (for the offline export); ``--lacking FOLDER=OTHER`` trains the model of FOLDER and
exports it against OTHER, a copy holding one tensor more, which must be refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import TrainerState
from hf_fsdp2.composite import composite_spec, freeze_parts
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.export import ExportError, export_model
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.model import decoder_layer_classes, fsdp_unit_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import cross_entropy_sum
from hf_fsdp2.train.optim import build_adamw, param_groups


def train_one(acc, folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[bool]]:  # type: ignore[no-untyped-def]
    # Rank-0 loading, as recipes load by default: the other ranks build the model on meta and get their shards, the
    # frozen tower's too, from rank 0; their export names come from the folder's tensor names alike.
    model = load_model(str(folder), empty_weights=acc.process_index != 0)
    on_meta = [
        False
    ] * acc.num_processes  # which ranks built the model on meta (the test checks rank-0 loading)
    dist.all_gather_object(on_meta, any(p.is_meta for p in model.parameters()))
    spec = composite_spec(model.config)
    assert spec is not None
    freeze_parts(model, spec, freeze_vision_tower=True, freeze_multi_modal_projector=True)
    layers = decoder_layer_classes(model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=layers, units=fsdp_unit_classes(model, layers)))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(acc.process_index))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    acc.backward(cross_entropy_sum(logits, ids) / ids[:, 1:].numel())
    opt.step()
    opt.zero_grad()
    return model, opt, on_meta


def export(acc, model, folder: Path, out: Path, source: Path):  # type: ignore[no-untyped-def]
    unwrapped = acc.unwrap_model(model)
    return export_model(
        model,
        out,
        config=unwrapped.config,
        tokenizer=load_tokenizer(str(folder)),
        generation_config=unwrapped.generation_config,
        dtype="bfloat16",
        max_shard_bytes=400_000,  # several files: rank i % 2 assembles file i, carried tensors included
        compute_dtype=torch.float32,
        source=ExportSource(str(source)),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", action="append", default=[], help="NAME=FOLDER")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--lacking", default="", help="FOLDER=OTHER: OTHER holds one tensor the model lacks")
    args = ap.parse_args()
    out = Path(args.out)
    plan = ShardingPlan(cpu_ram_efficient_loading=True)
    acc = build_accelerator(plan, mixed_precision="no", compile_plan=CompilePlan())
    rank = acc.process_index
    report: dict = {}
    for pair in args.family:
        name, folder = pair.split("=", 1)
        model, opt, on_meta = train_one(acc, Path(folder))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            (out / name).mkdir(parents=True, exist_ok=True)
            torch.save(full, out / name / "trained.pt")
        del full
        if name == args.checkpoint:  # a real 2-rank checkpoint: it holds what trains, not the frozen tower
            run = out / name / "run"
            saver = Checkpointer(run, keep_last=0, async_save=False, is_main_process=acc.is_main_process)
            state = TrainerState(
                step=1,
                epoch=0,
                batches_in_epoch=1,
                world_size=acc.num_processes,
                scheduler={},
                per_device_train_batch_size=2,
                gradient_accumulation_steps=1,
            )
            saver.save(1, model, opt, state, json.dumps({"model_name_or_path": folder, "seed": 1}))
        result = export(acc, model, Path(folder), out / name / "export", Path(folder))
        report[name] = {
            "verify": result.verify.summary() if result.verify else "",
            "files": result.files,
            "on_meta": on_meta,
        }
        del model, opt
    if args.lacking:
        folder, other = args.lacking.split("=", 1)
        model, _, _ = train_one(acc, Path(folder))
        try:
            export(acc, model, Path(folder), out / "lacking", Path(other))
            report["lacking"] = {"error": "", "published": True}
        except ExportError as err:  # every rank: the plan is refused on every rank alike
            report["lacking"] = {
                "error": str(err),
                "published": any((out / "lacking").glob("model*.safetensors")),
            }
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report))
    acc.end_training()


if __name__ == "__main__":
    main()
    # As recipes/sft.py does: skip interpreter finalization, where gloo's worker threads can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
