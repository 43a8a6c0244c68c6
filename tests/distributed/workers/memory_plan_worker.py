"""Worker for tests/distributed/test_memory_plan.py: measure what each rank really holds.

Run under torchrun; every rank writes ``<out>/rank<r>.json``. For each model folder and each activation-
checkpointing mode: load the model, shard it as a run does (``parallelize``, bf16 mixed precision), run one
micro-batch through the run's loss with ``SavedTensorMeter`` around the forward (the bytes kept for backward),
backward, an AdamW step; then sum the unique storages of the local parameter shards, gradient shards and
optimizer state. A 3-row linear layer sharded alone shows the padded storage of ranks whose chunk is empty.
With --cp N the mesh is context parallel over every rank and each model runs as the run applies it (the all-to-all
attention, each rank its part of the sequences: hf_fsdp2.parallel.all_to_all).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hf_fsdp2 import collectives
from hf_fsdp2.config.plans import ACPlan, CompilePlan, LoraSettings, MeshPlan, ShardingPlan
from hf_fsdp2.lora.adapter import apply_lora
from hf_fsdp2.lora.quantize import quantize_base
from hf_fsdp2.model import decoder_layer_classes, load_model
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.all_to_all import enable_context_parallel, shard_sequence
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.plan import SavedTensorMeter
from hf_fsdp2.train.loss import backward_scale, causal_lm_loss, count_target_tokens, plan_loss
from hf_fsdp2.train.optim import build_adamw, param_groups

MODES = ("none", "full", "every_k", "selective", "offload")


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's data: its local shard; a tensor subclass (the NF4 weight) its parts."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if is_traceable_wrapper_subclass(local):
        names, _ = local.__tensor_flatten__()
        return [part for name in names for part in _plain(getattr(local, name))]
    return [local]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors: their local shards; NF4: its parts)."""
    seen: dict[int, int] = {}
    for t in tensors:
        for plain in _plain(t):
            storage = plain.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(params), "optimizer": storage_bytes(state)}


def measure(
    acc, model_dir: str, mode: str, batch: int, seq: int, chunk: int, rank: int, adapter: str = ""
) -> dict[str, int]:
    """``adapter``: "" (full fine-tuning), or LoRA r=8 as the run wraps it: "lora", "dora", "qlora" (the 4-bit base
    as the run quantises it, then LoRA), "qdora"."""
    model = load_model(model_dir)
    layer_cls = decoder_layer_classes(model)
    if adapter.startswith("q"):
        quantize_base(model, layer_cls, shards=acc.num_processes)
    if adapter:
        model = apply_lora(model, LoraSettings(r=8, use_dora="dora" in adapter), seed=0)
    cp = collectives.cp_size()
    if cp > 1:  # as the run's build_model: the all-to-all attention before sharding
        enable_context_parallel(model, collectives.cp_group(), cp)
    # offload is refused by build_accelerator on CPU (host memory already); parallelize applies it as asked.
    sharding = ShardingPlan(activation_checkpointing=ACPlan(mode, every_k=2, pin_memory=False))
    model = parallelize(model, acc, ParallelPlan(layer_cls=layer_cls, ac=sharding.ac))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    loss_plan = plan_loss(model, chunk)
    gen = torch.Generator().manual_seed(100 + collectives.data_rank())  # a cp group's ranks: the same batch
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    labels = ids
    if cp > 1:  # as the run's step: this rank's part of each sequence, its labels one column wider
        part = shard_sequence({**inputs, "labels": ids}, cp, collectives.cp_rank())
        labels = part.pop("labels")
        inputs = part
    with SavedTensorMeter(model, layer_cls) as meter:
        out = causal_lm_loss(model, inputs, labels, loss_plan)
    saved = meter.result()
    tokens = count_target_tokens(labels) * acc.num_processes  # every rank has the same count here
    (out.ce_sum * backward_scale(tokens, acc.num_processes)).backward()
    del out
    grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    opt.step()
    result = held(model, opt)
    result.update(grads=grads, activations=saved.activations, loss=saved.loss, chunk=loss_plan.chunk_tokens)
    return result


def empty_shard_probe() -> dict[str, int]:
    """A Linear(8 -> 3) sharded alone (fp32, no mixed precision): at world 4 rank 3's chunk is empty."""
    torch.manual_seed(0)
    probe = torch.nn.Linear(8, 3)
    fully_shard(probe)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True)
    probe(torch.randn(2, 8)).sum().backward()
    grads = storage_bytes([p.grad for p in probe.parameters() if p.grad is not None])
    opt.step()
    result = held(probe, opt)
    result.update(grads=grads, weight_rows=probe.weight.to_local().shape[0])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=[], help="name=folder:batch:seq:ce_chunk_tokens")
    ap.add_argument("--adapters", nargs="*", default=[], help="name=folder:batch:seq:ce_chunk_tokens:adapter")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--cp", type=int, default=1, help="context-parallel ranks (all of them: the mesh is cp only)"
    )
    args = ap.parse_args()
    mesh = MeshPlan(cp=args.cp) if args.cp > 1 else None
    acc = build_accelerator(
        ShardingPlan(), mixed_precision="bf16", compile_plan=CompilePlan(), force_cpu=True, mesh=mesh
    )
    rank = acc.process_index
    report: dict = {"world": acc.num_processes, "models": {}}
    for spec in args.models:
        name, rest = spec.split("=", 1)
        folder, batch, seq, chunk = rest.rsplit(":", 3)
        report["models"][name] = {
            mode: measure(acc, folder, mode, int(batch), int(seq), int(chunk), rank) for mode in MODES
        }
    for spec in args.adapters:
        name, rest = spec.split("=", 1)
        folder, batch, seq, chunk, adapter = rest.rsplit(":", 4)
        report["models"][name] = {
            mode: measure(acc, folder, mode, int(batch), int(seq), int(chunk), rank, adapter)
            for mode in MODES
        }
    if args.cp == 1:  # the probe shards alone over every rank
        report["probe"] = empty_shard_probe()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    acc.end_training()


if __name__ == "__main__":
    main()
