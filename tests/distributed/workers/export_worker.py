"""Worker for tests/distributed/test_export_2rank.py: shard a tiny model, train a step, export gather-free.

Run under torchrun; rank 0 writes ``<out>/report.json`` and ``<out>/reference.pt`` (the full trained
weights, gathered here only as the test's reference, cast to the export dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import TrainerState
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.dtypes import DTYPES
from hf_fsdp2.export import ExportVerificationError, export_model, verify_export
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import cross_entropy_sum
from hf_fsdp2.train.optim import build_adamw, param_groups


def corrupt_one_tensor(folder: Path) -> str:
    """Flip the bytes of the first tensor of the last weight file (headers stay valid)."""
    path = sorted(folder.glob("model*.safetensors"))[-1]
    with open(path, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        name, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
        start, end = entry["data_offsets"]
        fh.seek(8 + n + start)
        data = bytearray(fh.read(min(end - start, 64)))
        fh.seek(8 + n + start)
        fh.write(bytes(b ^ 0x5A for b in data))
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max_shard_bytes", type=int, default=10**9)
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--no_tokenizer", action="store_true")
    ap.add_argument("--corrupt", action="store_true", help="then corrupt a copy and expect verify to fail")
    ap.add_argument(
        "--checkpoint", action="store_true", help="also save a sharded checkpoint under <out>/run"
    )
    args = ap.parse_args()
    out = Path(args.out)

    plan = ShardingPlan(activation_checkpointing=args.ac)
    acc = build_accelerator(plan, mixed_precision="bf16", compile_plan=CompilePlan())
    rank = acc.process_index
    model = load_model(args.model)
    tokenizer = None if args.no_tokenizer else load_tokenizer(args.model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=decoder_layer_classes(model), ac=plan.ac))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")

    # One step, so that the exported weights are not the ones the model was loaded with.
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(rank))
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    acc.backward(cross_entropy_sum(logits, ids) / ids[:, 1:].numel())
    opt.step()
    opt.zero_grad()

    if args.checkpoint:  # a real 2-rank checkpoint, for the offline `hf-fsdp2 export` test
        run = out / "run"
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
        config_yaml = json.dumps({"model_name_or_path": args.model, "dataset_name": "tiny/chat", "seed": 1})
        saver.save(1, model, opt, state, config_yaml)  # YAML is a superset of JSON
        if rank == 0:
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        dtype = DTYPES.get(args.dtype)
        torch.save({k: v.to(dtype) if dtype else v for k, v in full.items()}, out / "reference.pt")
    del full
    unwrapped = acc.unwrap_model(model)
    result = export_model(
        model,
        out / "export",
        config=unwrapped.config,
        tokenizer=tokenizer,
        generation_config=unwrapped.generation_config,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        model_card="---\nlibrary_name: transformers\n---\n# test card\n",
        compute_dtype=torch.bfloat16,
    )
    report = {
        "files": result.files,
        "dtype": result.dtype,
        "total_bytes": result.total_bytes,
        "verify_ok": result.verify is not None and result.verify.ok,
        "verify": result.verify.summary() if result.verify else "",
        "max_logit_diff": result.verify.max_logit_diff if result.verify else None,
        "tensors_checked": result.verify.tensors if result.verify else 0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if args.corrupt:
        if rank == 0:
            shutil.copytree(out / "export", out / "corrupt")
            report["corrupted"] = corrupt_one_tensor(out / "corrupt")
        dist.barrier()  # every rank: the file is corrupted before anyone reads it back
        try:
            verify_export(model, out / "corrupt", dtype=args.dtype, compute_dtype=torch.bfloat16)
            report["corruption_caught"] = ""
        except ExportVerificationError as err:
            report["corruption_caught"] = str(err)
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report))
    acc.end_training()


if __name__ == "__main__":
    main()
    # As recipes/sft.py does: skip interpreter finalization, where gloo's worker threads can abort
    # the process after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
