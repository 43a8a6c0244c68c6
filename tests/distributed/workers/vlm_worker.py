"""Worker for tests/distributed/test_vlm_2rank.py: each vision-language family trains on the image records of
tests/support/vlm.py through the library's own data path (tokenize_dataset with the family's processor, the vision
collator) and step on 2 gloo ranks, in fp32, padded and (where the family allows it) padding-free; the padded run is
exported and its logits on an image batch saved. Rank 0 writes ``<out>/<family>/result.json``. With ``--grains``,
one step of each family there with its tower as one FSDP2 unit and per block, its all-gathers and unsharded
parameters measured (``<out>/grain_<family>.json``). Then, with ``--recipe``, the SFT recipe runs in the same
processes (one launch instead of two). Run under torchrun; the families share one process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from support.comm_count import CommCounter
from support.composites import vlm_processor
from support.unshard_peak import UnshardPeak
from support.vlm import LR, SCHEDULE, STEPS, vlm_records

from hf_fsdp2.composite import composite_spec, freeze_parts
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.data.vision_collate import vision_collator
from hf_fsdp2.export import export_model
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.model import decoder_layer_classes, fsdp_unit_classes, load_model, load_model_config
from hf_fsdp2.parallel.accelerator import build_accelerator, mixed_precision_policy
from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
from hf_fsdp2.train.loss import plan_loss
from hf_fsdp2.train.optim import build_adamw, param_groups
from hf_fsdp2.train.step import StepSettings, train_step
from hf_fsdp2.vision.grain import block_unit, tower_blocks, tower_sizes
from hf_fsdp2.vision.processor import dummy_image_inputs
from hf_fsdp2.vision.tower import run_tower_always

CHUNK = 16


def train(
    acc, model_dir: str, processor, examples, *, padding_free: bool, freeze: tuple[bool, bool], chunk: int
):  # type: ignore[no-untyped-def]
    acc.state.fsdp_plugin.mixed_precision_policy = mixed_precision_policy("no", "float32")
    config = load_model_config(model_dir)
    collator = vision_collator(
        processor,
        config,
        pad_token_id=processor.tokenizer.pad_token_id,
        packing=False,
        padding_free=padding_free,
    )
    torch.manual_seed(0)
    model = load_model(model_dir)
    spec = composite_spec(model.config)
    freeze_parts(model, spec, freeze_vision_tower=freeze[0], freeze_multi_modal_projector=freeze[1])
    tower = model.get_submodule(spec.tower[0])
    runs = [0]
    tower.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    layers = decoder_layer_classes(model)
    model = parallelize(model, acc, ParallelPlan(layer_cls=layers, units=fsdp_unit_classes(model, layers)))
    hooks = run_tower_always(model, dummy_image_inputs(processor, model))
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
    plan = plan_loss(model, chunk)
    settings = StepSettings(plan, max_grad_norm=1.0)
    losses, images = [], []
    for step in range(STEPS):
        batches = [collator([examples[i] for i in micro]) for micro in SCHEDULE[step][acc.process_index]]
        images.append([int(b["pixel_values"].shape[0]) if "pixel_values" in b else 0 for b in batches])
        losses.append(train_step(model, opt, None, batches, settings, acc.device).loss())
    counts: list = [None, None]
    dist.all_gather_object(counts, {"tower_runs": runs[0], "dummy_runs": hooks.dummy_runs, "images": images})
    return model, collator, {"losses": losses, "ranks": counts, "chunked": plan.chunk_tokens > 0}


def measure_grains(acc, family: str, model_dir: str, freeze: tuple[bool, bool]) -> dict:  # type: ignore[no-untyped-def]
    """One step (SCHEDULE[0]) with the tower as one unit and per block: the loss, every all-gather (dispatch-level
    count and bytes), each unit's all-gathers and bytes, the peak of unsharded parameter bytes (all units, the
    tower's), the tower's sizes and the library's own choice; every rank's."""
    processor = vlm_processor(family)
    examples, _ = tokenize_dataset(
        datasets.Dataset.from_list(vlm_records()), processor.tokenizer, max_length=512, processor=processor
    )
    acc.state.fsdp_plugin.mixed_precision_policy = mixed_precision_policy("no", "float32")
    collator = vision_collator(
        processor, load_model_config(model_dir), pad_token_id=processor.tokenizer.pad_token_id, packing=False,
        padding_free=False,
    )  # fmt: skip
    result: dict = {}
    for grain in ("tower", "blocks"):
        torch.manual_seed(0)
        model = load_model(model_dir)
        spec = composite_spec(model.config)
        freeze_parts(model, spec, freeze_vision_tower=freeze[0], freeze_multi_modal_projector=freeze[1])
        layers = decoder_layer_classes(model)
        block = type(tower_blocks(model.get_submodule(spec.tower[0]))[0]).__name__
        sizes = tower_sizes(model, spec, layers)
        chosen = "blocks" if block_unit(model, spec, layers) else "tower"
        units = tuple(u for u in fsdp_unit_classes(model, layers) if u != block)
        model = parallelize(
            model, acc, ParallelPlan(layer_cls=layers, units=(*units, block) if grain == "blocks" else units)
        )
        run_tower_always(model, dummy_image_inputs(processor, model))
        opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")
        peak = UnshardPeak(prefixes=(spec.tower[0],)).watch(model)
        batches = [collator([examples[i] for i in micro]) for micro in SCHEDULE[0][acc.process_index]]
        with CommCounter() as comms:
            loss = train_step(
                model, opt, None, batches, StepSettings(plan_loss(model, 0), max_grad_norm=1.0), acc.device
            ).loss()
        count, nbytes = comms.all_gathers()
        mine = {
            "loss": loss, "all_gathers": count, "bytes": nbytes, "peak": peak.peak, "tower_peak": peak.peak_under,
            "gathers": peak.gathers, "sizes": peak.sizes, "micro_batches": len(batches),
        }  # fmt: skip
        ranks: list = [None, None]
        dist.all_gather_object(ranks, mine)
        result[grain] = ranks
        result["tower_sizes"], result["chosen"], result["tower_path"] = (
            dataclasses.asdict(sizes),
            chosen,
            spec.tower[0],
        )
        del model, opt
    return result


def run_family(
    acc, family: str, model_dir: str, out: Path, freeze: tuple[bool, bool], padding_free: bool
) -> dict:  # type: ignore[no-untyped-def]
    processor = vlm_processor(family)
    records = vlm_records()
    examples, stats = tokenize_dataset(
        datasets.Dataset.from_list(records), processor.tokenizer, max_length=512, processor=processor
    )
    result: dict = {"stats": stats.describe()}
    layouts = [("padded", False, CHUNK)] + ([("padding_free", True, 0)] if padding_free else [])
    for name, flat, chunk in layouts:
        model, collator, result[name] = train(
            acc, model_dir, processor, examples, padding_free=flat, freeze=freeze, chunk=chunk
        )
        if name == "padded":
            export_model(
                model,
                out / "export",
                config=model.config,
                tokenizer=processor.tokenizer,
                generation_config=None,
                dtype="float32",
                max_shard_bytes=10**9,
                source=ExportSource(model_dir),
                verify=False,  # the test reloads every export itself (a verification is a fresh process each)
            )
            result["export"] = "written"
            batch = collator([examples[i] for i in (0, 3, 2)])
            model.eval()
            with torch.no_grad():
                logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
            if acc.is_main_process:
                torch.save({"batch": batch, "logits": logits.float()}, out / "image_batch.pt")
        del model
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="folder with one model folder per family")
    ap.add_argument("--families", required=True, help="family:tower:projector:padding_free, comma-separated")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--grains", default="", help="family:tower:projector, comma-separated: measure both grains"
    )
    ap.add_argument(
        "--recipe", default="", help="then the SFT recipe with this config, in the same processes"
    )
    args = ap.parse_args()
    acc = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan(), timeout_s=120)
    for entry in args.families.split(","):
        family, tower, projector, flat = entry.split(":")
        out = Path(args.out) / family
        out.mkdir(parents=True, exist_ok=True)
        try:
            freeze = (tower == "frozen", projector == "frozen")
            result = run_family(acc, family, str(Path(args.root) / family), out, freeze, flat == "pf")
        except Exception as err:  # recorded per family: the test names the family that failed
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(f"rank {acc.process_index} {family}: {traceback.format_exc()[-3000:]}", file=sys.stderr)
        if acc.is_main_process:
            (out / "result.json").write_text(json.dumps(result, indent=1))
    for entry in filter(None, args.grains.split(",")):
        family, tower, projector = entry.split(":")
        start = time.perf_counter()
        try:
            result = measure_grains(
                acc, family, str(Path(args.root) / family), (tower == "frozen", projector == "frozen")
            )
        except Exception as err:
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            print(
                f"rank {acc.process_index} grains {family}: {traceback.format_exc()[-3000:]}", file=sys.stderr
            )
        if acc.is_main_process:
            result["seconds"] = time.perf_counter() - start
            (Path(args.out) / f"grain_{family}.json").write_text(json.dumps(result, indent=1))
    if (
        args.recipe
    ):  # the whole recipe (its own session and accelerator over the same process group), which ends it
        from hf_fsdp2.methods import get_method, parse_method_config
        from hf_fsdp2.run.loop import run

        run(parse_method_config(get_method("sft"), ["--config", args.recipe]), get_method("sft"))
    else:
        acc.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
