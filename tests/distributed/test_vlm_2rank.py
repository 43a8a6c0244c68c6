"""Vision-language SFT on 2 gloo ranks: each family trains on image records exactly as its own class does in one
process on TRL's batches of the same raw records, exports whole, and keeps the ranks' collectives alike.

* Qwen2.5-VL, Qwen3-VL, Qwen3.5 (padded only: its gated DeltaNet layers refuse rows of several documents), Idefics3
  and LLaVA (tiny random composites with processors built in code, tests/support/composites.py), one launch through
  the library's data path and step (workers/vlm_worker.py): fp32 losses of 3 steps, padded and padding-free (Qwen:
  per-document 3-D mRoPE positions), equal within 1e-4 to TRL's DataCollatorForVisionLanguageModeling (assistant-only
  loss) + the composite class + torch AdamW in one process on every rank's micro-batches; the vision tower trained
  (Qwen2.5-VL, Idefics3) or frozen (Qwen3-VL with its mergers trained, Qwen3.5 with its merger trained, LLaVA with its
  projector frozen too). The data differ per rank and step in image count, image size and length, and step 0 starts
  rank 0 on a text-only micro-batch while rank 1's has images: every rank runs the tower in every forward (a dummy
  image where it has none), counted.
* Gemma 3 through the SFT recipe (the data builder, the processor loaded from the folder, image paths in JSONL),
  its tower frozen and projector trained, padded (its images cannot share a row: refused); the same reference.
* The exports reload with AutoModelForImageTextToText and give the trained model's logits on an image
  batch; a frozen tower is byte-identical to the checkpoint's.
* The tower's FSDP2 grain, measured in the same launch: one step of Qwen2.5-VL (tower and merger frozen), Qwen3-VL
  (tower frozen, mergers trained) and Idefics3 (tower and connector trained) with the tower as one unit and per
  block: the same loss, every all-gather counted at dispatch and by unit against hf_fsdp2.vision.grain's formulas,
  the peak of unsharded parameters measured; the library shards per block exactly where that lowered the measured
  peak or the bytes all-gathered.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from support.composites import VLM_FAMILIES, checkpoint_names, make_composite_dir, vlm_processor
from support.launch import torchrun
from support.vlm import LR, reference_losses, vlm_records, write_records
from transformers import AutoModelForImageTextToText

from hf_fsdp2.vision.grain import TowerSizes, tower_gather_bytes, tower_gathers, tower_peak

WORKER = Path(__file__).parent / "workers" / "vlm_worker.py"
# family -> (tower, projector, padding-free too): what trains in the run, and its layouts.
SCENARIOS = {
    "qwen2_5_vl": ("trained", "trained", True),
    "qwen3_vl": ("frozen", "trained", True),
    # Padded only: its gated DeltaNet layers refuse rows of several documents (as for its text).
    "qwen3_5_vlm": ("frozen", "trained", False),
    "idefics3": ("trained", "trained", True),
    "llava": ("frozen", "frozen", True),
}
# family -> (tower, projector): the grains measured (one step each with the tower as one unit and per block).
GRAINS = {
    "qwen2_5_vl": ("frozen", "frozen"),
    "qwen3_vl": ("frozen", "trained"),
    "idefics3": ("trained", "trained"),
}
# Module paths of each family's tower and projector (the reference freezes by them; the checkpoint names differ).
PARTS = {
    "gemma3_vlm": ("model.vision_tower.", "model.multi_modal_projector."),
    "qwen2_5_vl": ("model.visual.", "model.visual.merger."),
    "qwen3_vl": ("model.visual.", ("model.visual.merger.", "model.visual.deepstack_merger_list.")),
    "qwen3_5_vlm": ("model.visual.", "model.visual.merger."),
    "idefics3": ("model.vision_model.", "model.connector."),
    "llava": ("model.vision_tower.", "model.multi_modal_projector."),
}
# Checkpoint names of what the run leaves frozen (the export carries them from the checkpoint's files).
FROZEN_NAMES = {
    "qwen3_vl": ("model.visual.blocks.", "model.visual.patch_embed.", "model.visual.pos_embed."),
    "llava": ("vision_tower.", "multi_modal_projector."),
    "qwen3_5_vlm": ("model.visual.blocks.", "model.visual.patch_embed.", "model.visual.pos_embed."),
    "gemma3_vlm": ("vision_tower.",),
}
# The Gemma 3 recipe run's micro-batches (per_device_train_batch_size 2, 2 accumulation steps): rank -> step -> rows.
GEMMA_SCHEDULE = [
    [[[2, 5], [0, 1]], [[0, 3], [4, 6]]],
    [[[6, 7], [11, 9]], [[8, 9], [10, 1]]],
    [[[3, 4], [4, 8]], [[5, 6], [9, 10]]],
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vlm_models")
    for family in VLM_FAMILIES:
        make_composite_dir(root / family, family)
    return root


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One launch: the families through the library's step, then the SFT recipe on Gemma 3 (``out/gemma_run``)."""
    root = tmp_path_factory.mktemp("vlm")
    families = ",".join(f"{f}:{t}:{p}:{'pf' if pf else 'no'}" for f, (t, p, pf) in SCENARIOS.items())
    recipe = _gemma_recipe(models, root)
    grains = ",".join(f"{f}:{t}:{p}" for f, (t, p) in GRAINS.items())
    torchrun(
        WORKER,
        [
            "--root",
            str(models),
            "--families",
            families,
            "--out",
            str(root / "out"),
            "--recipe",
            str(recipe),
            "--grains",
            grains,
        ],  # fmt: skip
        nproc=2,
        timeout=900,
    )
    return models, root / "out"


def _result(out: Path, family: str) -> dict:
    result = json.loads((out / family / "result.json").read_text())
    assert "error" not in result, f"{family}: {result.get('error')}\n{result.get('traceback')}"
    return result


def _reference(
    model_dir: Path, family: str, tower: str, projector: str, schedule: list
) -> tuple[list, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    tower_path, projector_paths = PARTS[family]
    projector_paths = projector_paths if isinstance(projector_paths, tuple) else (projector_paths,)
    for name, param in model.named_parameters():
        in_projector = name.startswith(projector_paths)
        if (in_projector and projector == "frozen") or (
            not in_projector and name.startswith(tower_path) and tower == "frozen"
        ):
            param.requires_grad_(False)
    losses = reference_losses(model, vlm_processor(family), vlm_records(), schedule, LR)
    return losses, model.eval()


def _close(got: list[float], want: list[float]) -> float:
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert rel <= 1e-4, (got, want)
    return rel


def _same_bytes(source: Path, export: Path, prefixes: tuple[str, ...]) -> int:
    """The tensors under ``prefixes`` in ``export`` equal ``source``'s (dtype and bytes); how many."""
    names = [n for n in checkpoint_names(source) if n.startswith(prefixes)]
    with (
        safe_open(str(source / "model.safetensors"), "pt") as a,
        safe_open(str(export / "model.safetensors"), "pt") as b,
    ):
        for name in names:
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x, y), name
    return len(names)


@pytest.mark.parametrize("family", list(SCENARIOS))
def test_family_trains_on_images_like_its_class_on_trl_batches(runs: tuple[Path, Path], family: str) -> None:
    models, out = runs
    result = _result(out, family)
    tower, projector, padding_free = SCENARIOS[family]
    from support.vlm import SCHEDULE

    want, trained = _reference(models / family, family, tower, projector, SCHEDULE)
    print(family, "padded", _close(result["padded"]["losses"], want))
    if padding_free:
        print(family, "padding-free", _close(result["padding_free"]["losses"], want))
    # Every rank ran the tower in every forward; rank 0's text-only micro-batches on a dummy image.
    ranks = result["padded"]["ranks"]
    assert ranks[0]["tower_runs"] == ranks[1]["tower_runs"], ranks
    assert ranks[0]["images"][0][0] == 0 and ranks[1]["images"][0][0] > 0, ranks
    assert ranks[0]["dummy_runs"] > ranks[1]["dummy_runs"], ranks
    # The export: the whole checkpoint, verified, reloading with the auto class to the trained model's logits.
    assert result["export"] == "written", result["export"]
    export = out / family / "export"
    assert checkpoint_names(export) == checkpoint_names(models / family)
    saved = torch.load(out / family / "image_batch.pt")
    reloaded = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        inputs = {k: v for k, v in saved["batch"].items() if k != "labels"}
        logits = reloaded(**inputs, use_cache=False).logits.float()
    assert torch.allclose(logits, saved["logits"], atol=1e-5, rtol=1e-5), float(
        (logits - saved["logits"]).abs().max()
    )
    if tower == "frozen":  # what did not train is the checkpoint's, byte for byte
        assert _same_bytes(models / family, export, FROZEN_NAMES[family]) > 0


def _gemma_recipe(models: Path, root: Path) -> Path:
    """The SFT recipe of Gemma 3's composite: image paths in JSONL in GEMMA_SCHEDULE's order (sequential sampling:
    rank r reads rows r, r + 2, ...), the tower frozen and the projector trained; its run folder ``out/gemma_run``."""
    records = vlm_records()
    rows = [
        records[GEMMA_SCHEDULE[s][r][m][k]]
        for s in range(3)
        for m in range(2)
        for k in range(2)
        for r in range(2)
    ]
    data = write_records(rows, root / "data")
    recipe = root / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(models / "gemma3_vlm"),
                "dataset_name": str(data),
                "output_dir": str(root / "out" / "gemma_run"),
                "max_steps": 3,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "train_sampling_strategy": "sequential",
                "max_length": 256,
                "logging_steps": 1,
                "learning_rate": LR,
                "lr_scheduler_type": "constant",
                "weight_decay": 0.0,
                "max_grad_norm": 1.0,
                "mixed_precision": "no",
                "export_dtype": "float32",
                "export_verify": False,
                "freeze_vision_tower": True,
                "freeze_multi_modal_projector": False,
            }
        )
    )
    return recipe


def test_gemma3_recipe_trains_on_image_paths_like_its_class(runs: tuple[Path, Path]) -> None:
    models, out = runs
    gemma_run = out / "gemma_run"
    metrics = [json.loads(line) for line in (gemma_run / "metrics.jsonl").read_text().splitlines()]
    got = [m["loss"] for m in metrics if "loss" in m and "step" in m]
    want, trained = _reference(models / "gemma3_vlm", "gemma3_vlm", "frozen", "trained", GEMMA_SCHEDULE)
    print("gemma3_vlm recipe", _close(got, want))
    # The export: the whole checkpoint (processor files too), the frozen tower byte-identical, the reference's logits.
    assert checkpoint_names(gemma_run) == checkpoint_names(models / "gemma3_vlm")
    assert _same_bytes(models / "gemma3_vlm", gemma_run, FROZEN_NAMES["gemma3_vlm"]) > 0
    assert (gemma_run / "processor_config.json").is_file()
    from support.vlm import trl_batch

    batch = trl_batch(vlm_processor("gemma3_vlm"), [vlm_records()[i] for i in (0, 3, 2)])
    batch.pop("labels")
    reloaded = AutoModelForImageTextToText.from_pretrained(gemma_run, dtype=torch.float32).eval()
    with torch.no_grad():
        got_logits = reloaded(**batch, use_cache=False).logits
        want_logits = trained(**batch, use_cache=False).logits
    assert float((got_logits - want_logits).abs().max()) <= 1e-3 * max(1.0, float(want_logits.abs().max()))


@pytest.mark.parametrize("family", list(GRAINS))
def test_the_tower_grain_follows_the_measured_peak(runs: tuple[Path, Path], family: str) -> None:
    """Per block where that lowers the peak of unsharded parameters or the bytes all-gathered, one unit where it
    does not; the all-gathers of each grain as the formulas say, the same bytes where the whole tower trains, the
    loss unchanged."""
    result = json.loads((runs[1] / f"grain_{family}.json").read_text())
    assert "error" not in result, result.get("traceback")
    sizes, tower = TowerSizes(**result["tower_sizes"]), result["tower_path"]
    tower_bytes: dict[str, list[int]] = {"tower": [], "blocks": []}
    for grain in ("tower", "blocks"):
        for rank in result[grain]:
            units = {k: n for k, n in rank["gathers"].items() if k.startswith(tower)}
            micro = rank["micro_batches"]
            # The units' count equals every all-gather seen at dispatch (the tracker misses none).
            assert sum(rank["gathers"].values()) == rank["all_gathers"], rank
            assert sum(units.values()) == micro * tower_gathers(sizes, grain), (grain, units)
            got_bytes = sum(n * rank["sizes"][k] for k, n in units.items())
            assert got_bytes == micro * tower_gather_bytes(sizes, grain), (grain, units)
            tower_bytes[grain].append(got_bytes)
            assert rank["tower_peak"] == tower_peak(sizes, grain), (grain, rank["tower_peak"])
    one, per_block = result["tower"], result["blocks"]
    for a, b in zip(one, per_block, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["loss"], b["loss"])
        if sizes.blocks_train and sizes.rest_trains:  # every parameter gathered in both passes: padding alike
            assert a["bytes"] == b["bytes"], (a["bytes"], b["bytes"])
    lower = all(b["peak"] < a["peak"] for a, b in zip(one, per_block, strict=True)) or all(
        b < a for a, b in zip(tower_bytes["tower"], tower_bytes["blocks"], strict=True)
    )
    assert result["chosen"] == ("blocks" if lower else "tower"), (
        result["chosen"],
        [r["peak"] for r in one],
        [r["peak"] for r in per_block],
    )
    print(family, "peak", [r["peak"] for r in one], "->", [r["peak"] for r in per_block], "chosen", result["chosen"],
          "all-gathers", [r["all_gathers"] for r in one], "->", [r["all_gathers"] for r in per_block],
          "bytes", [r["bytes"] for r in one], "->", [r["bytes"] for r in per_block], "tower bytes",
          tower_bytes["tower"], "->", tower_bytes["blocks"], f"{result['seconds']:.1f} s")  # fmt: skip
