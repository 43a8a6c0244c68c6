"""Composite checkpoints on 2 gloo ranks: every rank names the tensors as the folder does under rank-0 loading, the
frozen tower and projector are never all-gathered on text rows (one FSDP2 unit each) and hold no gradient or optimizer
state, and the SFT recipe trains a Gemma 3 composite's language model with the losses of a one-process loop of the
composite class and torch's AdamW.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.composites import MTP_TENSORS, checkpoint_names, composite_tokenizer, make_composite_dir
from support.launch import SFT, torchrun
from support.reference import reference_steps
from support.tiny import write_chat_jsonl
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, get_cosine_schedule_with_warmup

from hf_fsdp2.data.loading import load_raw_dataset
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.observe.logs import read_metrics

WORKER = Path(__file__).parent / "workers" / "composite_worker.py"
WORLD, SEED, LR, STEPS, MAX_LEN = 2, 7, 3e-3, 3, 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composites")
    return {f: make_composite_dir(root / f, f, processor=False) for f in ("gemma3_vlm", "qwen3_5_vlm")}


@pytest.mark.parametrize("family", ["gemma3_vlm", "qwen3_5_vlm"])
def test_every_rank_names_the_tensors_as_the_folder_does(
    folders: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """Rank 0 loads with from_pretrained, rank 1 builds on meta (rank-0 loading): both derive the checkpoint's name
    conversions from the folder, so the names each rank writes its shards under are the folder's (they once differed:
    vision_tower.vision_model.* on rank 0, vision_tower.* on rank 1; model.language_model.* against model.*)."""
    out = tmp_path / "names.json"
    torchrun(WORKER, ["--mode", "names", "--folder", str(folders[family]), "--out", str(out)], nproc=WORLD)
    rank0, rank1 = json.loads(out.read_text())
    assert rank0 == rank1
    unloaded = set(MTP_TENSORS) if family.startswith("qwen3_5") else set()  # the export carries them
    assert set(rank0) == set(checkpoint_names(folders[family])) - unloaded


def test_the_frozen_tower_and_projector_are_never_gathered_on_text_rows(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """The run's units (each decoder layer, the tower, the projector) against the composite's _no_split_modules (the
    layout before them: the tower's blocks one unit each, its post-norm and the projector left in the root unit, which
    is all-gathered every step and kept gathered). Two text steps on 2 ranks: neither unit is all-gathered, the
    all-gathers carry exactly the root's leftovers less, and the frozen parameters have no gradient or AdamW state.
    """
    result = {}
    for units in ("run", "no_split"):
        out = tmp_path / f"{units}.json"
        torchrun(
            WORKER,
            [
                "--mode",
                "gathers",
                "--folder",
                str(folders["gemma3_vlm"]),
                "--units",
                units,
                "--out",
                str(out),
            ],
            nproc=WORLD,
        )
        result[units] = json.loads(out.read_text())[0]
    run, before = result["run"], result["no_split"]
    assert run["sharded_units"]["SiglipVisionModel"][0] == 1
    assert run["sharded_units"]["Gemma3MultiModalProjector"][0] == 1
    for step in run["steps"]:
        assert not [u for u in step["units"] if "vision_tower" in u or "multi_modal_projector" in u], step[
            "units"
        ]
    assert run["frozen_numel"] > 0 and run["optimizer_states_frozen"] == 0 and run["grads_frozen"] == 0
    # The root unit of the layout before held the projector and the tower's post-norm, gathered (fp32) every step.
    leftover = (
        before["sharded_units"]["Gemma3ForConditionalGeneration"][1]
        - (run["sharded_units"]["Gemma3ForConditionalGeneration"][1])
    )
    assert leftover > 0
    for new, old in zip(run["steps"], before["steps"], strict=True):
        assert old["all_gather_bytes"] - new["all_gather_bytes"] == 4 * leftover
        assert old["reduce_scatter_bytes"] == new["reduce_scatter_bytes"]
        assert abs(old["loss"] - new["loss"]) <= 1e-6


def _reference(model_dir: Path, data: list[dict]) -> tuple[list[dict], int]:
    """The composite's own class and torch's AdamW in one process (no hf_fsdp2 code): the tower and the projector
    frozen, every rank's micro-batches of a step, the documented data order. Also MFU's N on text rows: the
    parameters that run (the tied embedding table counted once, as the head)."""
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    for module in (model.model.vision_tower, model.model.multi_modal_projector):
        module.requires_grad_(False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params, "weight_decay": 0.0}], lr=LR, foreach=True)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=STEPS)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    steps = reference_steps(
        model, opt, sched, params, data, pad_id, world=WORLD, batch_size=2, accum=1, seed=SEED, steps=STEPS
    )
    return steps, sum(p.numel() for p in params)


@pytest.mark.parametrize("ce_chunk", [0, 16], ids=["plain-ce", "chunked-ce"])
def test_the_sft_recipe_trains_a_gemma3_composite_like_its_class(
    folders: dict[str, Path], tmp_path: Path, ce_chunk: int
) -> None:
    model_dir = folders["gemma3_vlm"]
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 24, seed=5)
    tokenizer = composite_tokenizer("gemma3_vlm")
    ds, _ = tokenize_dataset(load_raw_dataset(str(data_file)), tokenizer, max_length=MAX_LEN, source="chat")
    expected, running = _reference(model_dir, [ds[i] for i in range(len(ds))])
    assert len({e["target_tokens"] for e in expected}) > 1
    out = tmp_path / "run"
    args = {
        "model_name_or_path": model_dir,
        "dataset_name": data_file,
        "output_dir": out,
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "learning_rate": LR,
        "weight_decay": 0.0,
        "lr_scheduler_type": "cosine",
        "max_grad_norm": 1.0,
        "mixed_precision": "no",
        "max_length": MAX_LEN,
        "seed": SEED,
        "ce_chunk_tokens": ce_chunk,
        "export_dtype": "float32",
        "export_verify": "false",  # the subject is the losses; the export's tests verify it
    }
    run = torchrun(SFT, [a for k, v in args.items() for a in (f"--{k}", str(v))], nproc=WORLD)
    log = run.stdout + run.stderr
    got = read_metrics(out / "metrics.jsonl")
    assert [g["target_tokens"] for g in got] == [e["target_tokens"] for e in expected]
    rel = [abs(g["loss"] - e["loss"]) / e["loss"] for g, e in zip(got, expected, strict=True)]
    print(f"max relative loss difference {max(rel):.2e}")
    assert max(rel) <= 1e-4, (got, expected)
    assert got[-1]["loss"] < got[0]["loss"]
    assert "model Gemma3ForConditionalGeneration" in log
    assert "vision tower 0.03M frozen" in log and "multi-modal projector 0.00M frozen" in log, log[-3000:]
    assert "FSDP units: 1 x SiglipVisionModel" in log and "FSDP units: 2 x Gemma3DecoderLayer" in log
    assert "FSDP units: 1 x Gemma3MultiModalProjector" in log
    assert ("loss: chunked cross entropy" in log) == (ce_chunk > 0), log[-3000:]
    # MFU's N: the language model and the head, the tower and projector left out (they never run on text rows).
    assert f"6N + 12LHQT = {6 * running + 12 * 2 * 4 * 16 * MAX_LEN:.3g} at T=max_length" in log


def test_training_the_tower_on_text_is_refused_by_name_before_the_model_loads(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 8, seed=1)
    argv = [
        "--model_name_or_path",
        str(folders["gemma3_vlm"]),
        "--dataset_name",
        str(data_file),
        "--max_length",
        "64",
    ]
    refused = torchrun(
        SFT,
        [*argv, "--output_dir", str(tmp_path / "run"), "--freeze_vision_tower", "false"],
        nproc=WORLD,
        check=False,
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-3000:]
    assert (
        "freeze_vision_tower=false on Gemma3ForConditionalGeneration with data that has no image" in errors[0]
    )
    assert "FSDP units" not in refused.stdout + refused.stderr  # before the model is loaded
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
