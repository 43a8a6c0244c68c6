"""Worker for tests/distributed/test_expert_parallel.py: every MoE family of tests/support/moe.py trained through the
library's own step on 4 gloo ranks in the layouts the test names for it among flat FSDP2 (``ep 1``), ``ep 2 x efsdp
2`` and ``ep 4``, from rank 0's weights (the other ranks build the model on meta: ``fsdp_cpu_ram_efficient_loading``);
each layout's export (verified); a checkpoint of ``ep 2`` resumed flat and one of flat resumed under ``ep 2``; the
all-to-all calls and bytes of one step counted. Rank 0 writes ``<out>/<family>/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from support.moe import IDLE, LR, STEPS, moe_batches

from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import TrainerState, checkpoint_dir
from hf_fsdp2.config.plans import CompilePlan, MeshPlan, ShardingPlan
from hf_fsdp2.export import export_model
from hf_fsdp2.export.reload_process import shared_reload_process
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.expert_parallel import expert_shards
from hf_fsdp2.parallel.expert_shard import expert_meshes
from hf_fsdp2.parallel.experts import expert_load, find_experts
from hf_fsdp2.parallel.parallelize import ExpertParallel, ParallelPlan, parallelize
from hf_fsdp2.train.loss import plan_loss
from hf_fsdp2.train.optim import build_adamw, param_groups
from hf_fsdp2.train.step import StepSettings, train_step

CHUNK = 16
_MESHES: dict = {}


class Counted:
    """``dist.all_to_all_single`` counted: calls and the bytes of the rows each call passes in."""

    def __init__(self) -> None:
        self.calls, self.bytes, self.real = 0, 0, dist.all_to_all_single

    def __call__(self, output, input, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.bytes += input.numel() * input.element_size()
        return self.real(output, input, *args, **kwargs)


def build(acc, model_dir: str, ep: int, *, ac: bool = False):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = load_model(model_dir, empty_weights=acc.process_index != 0)
    layers = decoder_layer_classes(model)
    plan = None
    if ep > 1:
        if ep not in _MESHES:
            _MESHES[ep] = expert_meshes(MeshPlan(dp_shard=acc.num_processes, ep=ep), "cpu")
        plan = ExpertParallel(_MESHES[ep], rank0_loading=True)
    ac_plan = ShardingPlan(activation_checkpointing=ac).ac
    model = parallelize(model, acc, ParallelPlan(layer_cls=layers, ep=plan, ac=ac_plan))
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    return model, opt, StepSettings(plan_loss(model, CHUNK), max_grad_norm=1.0)


def steps(acc, model, opt, settings, first: int, last: int) -> dict:  # type: ignore[no-untyped-def]
    out: dict = {"losses": [], "aux": [], "grad_norms": []}
    for step in range(first, last):
        done = train_step(model, opt, None, moe_batches(step, acc.process_index), settings, acc.device)
        out["losses"].append(done.loss())
        out["aux"].append(done.aux_loss(2))
        out["grad_norms"].append(float(done.grad_norm))
    return out


def routed(model) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Tokens each expert got from this rank since the last read, per layer, gathered to every rank: [rank][expert]."""
    counts = torch.stack(
        [expert_load(m).take(8, torch.device("cpu")) for m in find_experts(model).values()]
    ).sum(0)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    return [g.tolist() for g in gathered]


def save(acc, model, opt, run: Path, step: int) -> None:  # type: ignore[no-untyped-def]
    saver = Checkpointer(run, keep_last=0, async_save=False, is_main_process=acc.is_main_process)
    state = TrainerState(
        step=step,
        epoch=0,
        batches_in_epoch=step,
        world_size=acc.num_processes,
        scheduler={},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    saver.save(step, model, opt, state, json.dumps({"seed": 1}))


def load(acc, model, opt, run: Path, step: int) -> None:  # type: ignore[no-untyped-def]
    saver = Checkpointer(run, keep_last=0, async_save=False, is_main_process=acc.is_main_process)
    saver.load(checkpoint_dir(run, step), model, opt)


def run_family(acc, family: str, model_dir: str, out: Path, layouts: list[int], resume: bool) -> dict:  # type: ignore[no-untyped-def]
    """Each layout of ``layouts`` trained and exported; with ``resume`` (layouts 1 and 2 among them), each of those
    two runs saves a checkpoint after step 2 on its way, and each checkpoint resumes in the other layout."""
    result: dict = {}
    tokenizer = load_tokenizer(model_dir)
    for ep in layouts:
        model, opt, settings = build(acc, model_dir, ep)
        counted = Counted()
        dist.all_to_all_single = (
            counted  # the exchanges of step 0 (the load-balancing loss and the load apart)
        )
        try:
            first = steps(acc, model, opt, settings, 0, 1)
        finally:
            dist.all_to_all_single = counted.real
        rows = [int(b["input_ids"].numel()) for b in moe_batches(0, acc.process_index)]
        calls = torch.tensor([counted.calls, counted.bytes, sum(rows)])
        everyone = [torch.zeros_like(calls) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, calls)
        result[f"ep{ep}_counted"] = [c.tolist() for c in everyone]
        middle = steps(acc, model, opt, settings, 1, 2)
        if resume and ep in (1, 2):
            save(acc, model, opt, out / f"run_ep{ep}", 2)
        rest = steps(acc, model, opt, settings, 2, STEPS)
        run = {k: first[k] + middle[k] + rest[k] for k in first}
        if ep > 1:
            run["local_experts"] = next(iter(expert_shards(model).values())).local
        run["routed"] = routed(model)
        result[f"ep{ep}"] = run
        done = export_model(
            model,
            out / f"export_ep{ep}",
            config=model.config,
            tokenizer=tokenizer,
            generation_config=None,
            dtype="float32",
            max_shard_bytes=10**9,
        )
        result[f"ep{ep}"]["export"] = done.verify.summary() if done.verify else None
        del model, opt
    if resume:  # ep 2 -> flat and flat -> ep 2, each from the checkpoint its run saved after step 2
        for saved, resumed in ((2, 1), (1, 2)):
            model, opt, settings = build(acc, model_dir, resumed)
            load(acc, model, opt, out / f"run_ep{saved}", 2)
            result[f"resume_ep{saved}_to_ep{resumed}"] = steps(acc, model, opt, settings, 2, STEPS)
            del model, opt
    result["idle"] = list(IDLE)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="folder with one model folder per family")
    ap.add_argument("--families", required=True, help="family:layouts, e.g. qwen3_moe:1.2.4,mixtral:4")
    ap.add_argument("--resume", default="", help="families that also resume across layouts")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    plan = ShardingPlan(cpu_ram_efficient_loading=True)
    acc = build_accelerator(
        plan,
        mixed_precision="no",
        compile_plan=CompilePlan(),
        timeout_s=300,
    )
    for spec in args.families.split(","):
        family, _, layouts = spec.partition(":")
        out = Path(args.out) / family
        try:
            result = run_family(
                acc,
                family,
                str(Path(args.root) / family),
                out,
                [int(ep) for ep in layouts.split(".")],
                family in args.resume.split(","),
            )
        except Exception as err:  # recorded per family: the test names the family that failed
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=1))
    acc.end_training()


if __name__ == "__main__":
    with shared_reload_process():  # the exports are reloaded in one interpreter (not one each)
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
