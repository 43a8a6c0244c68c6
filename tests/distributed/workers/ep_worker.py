"""Worker for tests/distributed/test_expert_parallel.py: every MoE family of tests/support/moe.py trained through the
library's own step on 4 gloo ranks in the layouts the test names for it among flat FSDP2 (``1``), ``ep 2 x efsdp 2``
(``2``), ``ep 4`` (``4``), and the compositions of :data:`COMPOSED`: HSDP 2 x 2 with ``ep 2`` and regional compile
(``hsdp2``; run last, under an accelerator built with the HSDP mesh), context parallel 2 x dp_shard 2 with ``ep 2``
(``cp2``: each cp pair reads the micro-batches of two ranks of the flat run, so its losses are the flat run's), from
rank 0's weights (the other ranks build the model on meta: ``fsdp_cpu_ram_efficient_loading``); each plain layout's
export (verified); a checkpoint of ``ep 2`` resumed flat and one of flat resumed under ``ep 2``; the all-to-all calls
and bytes of one step counted. Rank 0 writes ``<out>/<family>/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from support.moe import IDLE, LR, STEPS, WORLD, moe_batches

from hf_fsdp2 import collectives
from hf_fsdp2.checkpoint.checkpointer import Checkpointer
from hf_fsdp2.checkpoint.layout import TrainerState, checkpoint_dir
from hf_fsdp2.config.plans import CompilePlan, MeshPlan, ShardingPlan
from hf_fsdp2.export import export_model
from hf_fsdp2.export.reload_process import shared_reload_process
from hf_fsdp2.model import decoder_layer_classes, load_model, load_tokenizer
from hf_fsdp2.parallel.accelerator import build_accelerator, context_parallel_group
from hf_fsdp2.parallel.compiling import CompileWatch
from hf_fsdp2.parallel.expert_parallel import expert_shards
from hf_fsdp2.parallel.expert_shard import expert_meshes
from hf_fsdp2.parallel.experts import expert_load, find_experts
from hf_fsdp2.parallel.parallelize import ContextParallel, ExpertParallel, ParallelPlan, parallelize
from hf_fsdp2.train.loss import plan_loss
from hf_fsdp2.train.optim import build_adamw, param_groups
from hf_fsdp2.train.step import StepSettings, train_step

CHUNK = 16
_MESHES: dict = {}
# The layouts other than flat / ep N: the mesh, and whether the decoder layers are compiled (regional).
COMPOSED = {
    "hsdp2": (MeshPlan(dp_replicate=2, dp_shard=2, ep=2), True),
    "cp2": (MeshPlan(dp_shard=2, cp=2, ep=2), False),
}


class _Compile(CompilePlan):
    """Regional compile under dynamo's eager backend: dynamo's frames, graph breaks and guards as inductor gets them
    (the exchange runs eagerly between the compiled parts of each layer), without AOT autograd and inductor's C++
    builds (minutes on this CPU); inductor's numerics: tests/distributed/test_perf_modes.py."""

    def kwargs(self) -> dict:
        return {**super().kwargs(), "backend": "eager"}


def mesh_of(layout: str) -> MeshPlan:
    return COMPOSED[layout][0] if layout in COMPOSED else MeshPlan(dp_shard=WORLD, ep=int(layout))


class Counted:
    """``dist.all_to_all_single`` counted: calls and the bytes of the rows each call passes in."""

    def __init__(self) -> None:
        self.calls, self.bytes, self.real = 0, 0, dist.all_to_all_single

    def __call__(self, output, input, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.bytes += input.numel() * input.element_size()
        return self.real(output, input, *args, **kwargs)


def build(acc, model_dir: str, layout: str, *, ac: bool = False):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    torch._dynamo.reset()
    mesh = mesh_of(layout)
    model = load_model(model_dir, empty_weights=acc.process_index != 0)
    layers = decoder_layer_classes(model)
    plan = cp = None
    if mesh.ep > 1:
        if mesh not in _MESHES:
            _MESHES[mesh] = expert_meshes(mesh, "cpu")
        plan = ExpertParallel(_MESHES[mesh], rank0_loading=True)
    if mesh.cp > 1:
        cp = ContextParallel(collectives.cp_group(), mesh.cp)
    ac_plan = ShardingPlan(activation_checkpointing=ac).ac
    compiled = (
        _Compile(enabled=True, scope="regional") if COMPOSED.get(layout, (None, False))[1] else CompilePlan()
    )
    model = parallelize(
        model, acc, ParallelPlan(layer_cls=layers, ep=plan, cp=cp, ac=ac_plan, compile=compiled)
    )
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    return model, opt, StepSettings(plan_loss(model, CHUNK), max_grad_norm=1.0)


def batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches: the flat run's of its rank; under context parallel (``cp`` ranks per data rank), its
    data rank's pair of ranks' of the flat run (the same step's data, each row split over the pair)."""
    cp = collectives.cp_size()
    if cp == 1:
        return moe_batches(step, collectives.rank())
    first = collectives.data_rank() * cp
    return [b for rank in range(first, first + cp) for b in moe_batches(step, rank)]


def steps(acc, model, opt, settings, first: int, last: int) -> dict:  # type: ignore[no-untyped-def]
    out: dict = {"losses": [], "aux": [], "grad_norms": []}
    for step in range(first, last):
        done = train_step(model, opt, None, batches(step), settings, acc.device)
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


def key(layout: str) -> str:
    """A layout's key in the result: ``ep1``, ``ep2``, ``ep4``, or the composed layout's name."""
    return f"ep{layout}" if layout.isdigit() else layout


def placements(model) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The placements and mesh dimensions of the first expert tensor and of the first dense decoder-layer tensor."""
    experts = {id(p) for m in find_experts(model).values() for p in m.parameters(recurse=False)}
    out = {}
    for name, p in model.named_parameters():
        kind = "experts" if id(p) in experts else "dense" if ".layers." in name else None
        if kind and kind not in out:
            out[kind] = f"{tuple(p.placements)} on {p.device_mesh.mesh_dim_names}"
    return out


def run_layout(
    acc, model_dir: str, out: Path, layout: str, *, save_at: int | None, tokenizer
) -> tuple[dict, list]:  # type: ignore[no-untyped-def]
    """One layout trained ``STEPS`` steps (its step-0 all-to-alls counted; saved after step ``save_at`` when given;
    a plain layout exported and verified). Returns its record and the counted calls, bytes and tokens of every
    rank."""
    mesh = mesh_of(layout)
    if mesh.cp > 1:
        if ("cp", mesh) not in _MESHES:
            _MESHES["cp", mesh] = context_parallel_group(mesh, acc.device)
        collectives.set_layout(cp=mesh.cp, cp_group=_MESHES["cp", mesh])
    start = time.perf_counter()
    try:
        model, opt, settings = build(acc, model_dir, layout)
        watch = CompileWatch(enabled=COMPOSED.get(layout, (mesh, False))[1]).start()
        counted = Counted()
        dist.all_to_all_single = (
            counted  # the exchanges of step 0 (the load-balancing loss and the load apart)
        )
        try:
            first = steps(acc, model, opt, settings, 0, 1)
        finally:
            dist.all_to_all_single = counted.real
        # The tokens this rank's experts' exchanges carried: its part of each (padded) row under context parallel.
        tokens = sum(-(-b["input_ids"].size(1) // mesh.cp) * b["input_ids"].size(0) for b in batches(0))
        calls = torch.tensor([counted.calls, counted.bytes, tokens, len(batches(0))])
        everyone = [torch.zeros_like(calls) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, calls)
        middle = steps(acc, model, opt, settings, 1, 2)
        if save_at is not None:
            save(acc, model, opt, out / f"run_{key(layout)}", save_at)
        rest = steps(acc, model, opt, settings, 2, STEPS)
        run = {k: first[k] + middle[k] + rest[k] for k in first}
        if mesh.ep > 1:
            run["local_experts"] = next(iter(expert_shards(model).values())).local
        run["routed"] = routed(model)
        run["compile"] = watch.take()
        run["placements"] = placements(model)
        if layout.isdigit():
            done = export_model(
                model,
                out / f"export_{key(layout)}",
                config=model.config,
                tokenizer=tokenizer,
                generation_config=None,
                dtype="float32",
                max_shard_bytes=10**9,
            )
            run["export"] = done.verify.summary() if done.verify else None
        del model, opt
    finally:
        collectives.set_layout()
    run["seconds"] = round(time.perf_counter() - start, 1)  # what the layout costs the launch
    return run, [c.tolist() for c in everyone]


def run_family(acc, model_dir: str, out: Path, layouts: list[str], resume: bool, result: dict) -> None:  # type: ignore[no-untyped-def]
    """Each layout of ``layouts`` trained (into ``result``); with ``resume`` (layouts 1 and 2 among them), each of
    those two runs saves a checkpoint after step 2 on its way, and each checkpoint resumes in the other layout."""
    tokenizer = load_tokenizer(model_dir)
    for layout in layouts:
        save_at = 2 if resume and layout in ("1", "2") else None
        run, counted = run_layout(acc, model_dir, out, layout, save_at=save_at, tokenizer=tokenizer)
        result[key(layout)], result[f"{key(layout)}_counted"] = run, counted
    if resume:  # ep 2 -> flat and flat -> ep 2, each from the checkpoint its run saved after step 2
        for saved, resumed in (("2", "1"), ("1", "2")):
            model, opt, settings = build(acc, model_dir, resumed)
            load(acc, model, opt, out / f"run_ep{saved}", 2)
            result[f"resume_ep{saved}_to_ep{resumed}"] = steps(acc, model, opt, settings, 2, STEPS)
            del model, opt
    result["idle"] = list(IDLE)


def hsdp_accelerator(plan: ShardingPlan, mesh: MeshPlan):  # type: ignore[no-untyped-def]
    """The accelerator of an HSDP run (Accelerate's 2-D mesh), in place of the flat one: Accelerate keeps one state
    per process, so the flat one's is dropped (the process group stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    return build_accelerator(plan, mixed_precision="no", compile_plan=CompilePlan(), timeout_s=300, mesh=mesh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="folder with one model folder per family")
    ap.add_argument(
        "--families", required=True, help="family:layouts, e.g. qwen3_moe:1.2.4.hsdp2,mixtral:4.cp2"
    )
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
    results: dict[str, dict] = {}
    specs = [
        (f, layouts.split(".")) for f, _, layouts in (s.partition(":") for s in args.families.split(","))
    ]
    # The HSDP layouts last, under an accelerator of their own.
    phases = [
        (None, [(f, [x for x in ls if mesh_of(x).dp_replicate == 1]) for f, ls in specs]),
        (mesh_of("hsdp2"), [(f, [x for x in ls if mesh_of(x).dp_replicate > 1]) for f, ls in specs]),
    ]
    for mesh, todo in phases:
        if not any(ls for _, ls in todo):
            continue
        if mesh is not None:
            acc = hsdp_accelerator(plan, mesh)
        for family, layouts in todo:
            result = results.setdefault(family, {})
            if not layouts or "error" in result:
                continue
            try:
                run_family(
                    acc,
                    str(Path(args.root) / family),
                    Path(args.out) / family,
                    layouts,
                    family in args.resume.split(",") and mesh is None,
                    result,
                )
            except Exception as err:  # recorded per family: the test names the family that failed
                result["error"] = f"{type(err).__name__}: {err}"
                result["traceback"] = traceback.format_exc()[-3000:]
    if acc.is_main_process:
        for family, result in results.items():
            out = Path(args.out) / family
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result, indent=1))
    acc.end_training()


if __name__ == "__main__":
    with shared_reload_process():  # the exports are reloaded in one interpreter (not one each)
        main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
