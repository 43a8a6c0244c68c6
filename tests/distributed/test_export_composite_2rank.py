"""2-rank gloo tests of a composite checkpoint's export (Gemma 3, Qwen3.5 with its unloaded ``mtp.*``, Llama 4,
Mistral 3 saved in bf16): loaded by rank 0 (the other rank on meta), trained on text with the tower and projector
frozen, exported gather-free against the folder it was loaded from. The export holds every tensor of the source under its name, the tower and projector
byte-identical to the source's; it reloads with the composite's own class and with AutoModelForImageTextToText, both
equal to the trained model on text. An export that would lack a source tensor is refused (by the recipe before
training, by the export on every rank); the offline export of a
2-rank checkpoint (which holds what trains, not the frozen tower) equals the live one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file, save_file
from support.composites import checkpoint_names, make_composite_dir
from support.launch import SFT, python, torchrun
from support.tiny import write_chat_jsonl

from hf_fsdp2.composite import composite_spec
from hf_fsdp2.export.files import read_header

WORKER = Path(__file__).parent / "workers" / "composite_export_worker.py"
FAMILIES = ("gemma3_vlm", "qwen3_5_vlm", "llama4_vlm", "mistral3")
EXTRA = "model.visual.extra_head.weight"  # in the lacking source only: neither the model's nor ignorable


def raw(folder: Path) -> dict[str, bytes]:
    """Every tensor's bytes in ``folder``'s safetensors files, as stored."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, start = read_header(path)
        data = path.read_bytes()
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                out[name] = data[start + begin : start + end]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path, dict]:
    root = tmp_path_factory.mktemp("composites")
    folders = {f: make_composite_dir(root / "models" / f, f, processor=False) for f in FAMILIES}
    lacking = root / "models" / "lacking"
    shutil.copytree(folders["qwen3_5_vlm"], lacking)
    tensors = load_file(str(lacking / "model.safetensors"))
    save_file(
        {**tensors, EXTRA: torch.zeros(3)}, str(lacking / "model.safetensors"), metadata={"format": "pt"}
    )
    out = root / "out"
    out.mkdir()
    args = [a for f, d in folders.items() for a in ("--family", f"{f}={d}")]
    args += [
        "--out",
        str(out),
        "--checkpoint",
        "qwen3_5_vlm",
        "--lacking",
        f"{folders['qwen3_5_vlm']}={lacking}",
    ]
    torchrun(WORKER, args, nproc=2)
    return folders, out, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_holds_every_source_tensor_with_the_tower_and_projector_byte_identical(
    run, family
) -> None:
    folders, out, report = run
    assert report[family]["verify"].startswith("verified"), report[family]["verify"]
    assert report[family]["on_meta"] == [
        False,
        True,
    ]  # rank-0 loading: rank 1's names come from the folder too
    assert len(report[family]["files"]) > 1
    source, exported = raw(folders[family]), raw(out / family / "export")
    assert sorted(exported) == checkpoint_names(folders[family])  # every name, none renamed, none added
    vision = [
        n
        for n in source
        if n.startswith(("vision_tower.", "vision_model.", "multi_modal_projector.", "model.visual."))
    ]
    assert vision and all(exported[n] == source[n] for n in vision), family
    text = [n for n in source if n not in vision and not n.startswith("mtp.")]
    assert sum(exported[n] != source[n] for n in text) > len(text) // 2  # the language model trained
    if family == "qwen3_5_vlm":
        assert all(exported[n] == source[n] for n in source if n.startswith("mtp."))
    config = json.loads((out / family / "export" / "config.json").read_text())
    assert (
        config["architectures"] == json.loads((folders[family] / "config.json").read_text())["architectures"]
    )
    assert (out / family / "export" / "generation_config.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_reloads_with_its_class_and_the_auto_class_equal_to_the_trained_model(run, family) -> None:
    folders, out, _ = run
    folder = out / family / "export"
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    # The trained model as the export holds it: the language model rounded to bf16, the frozen parts the source's.
    trained = getattr(transformers, arch).from_pretrained(folders[family], dtype=torch.float32)
    spec = composite_spec(trained.config)
    assert spec is not None
    frozen = (*spec.tower, *spec.projector)
    state = torch.load(out / family / "trained.pt")
    state = {
        k: v if k.startswith(frozen) or not v.is_floating_point() else v.to(torch.bfloat16).float()
        for k, v in state.items()
    }
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trained.eval()(input_ids=ids).logits
    for cls in (getattr(transformers, arch), transformers.AutoModelForImageTextToText):
        model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        assert type(model).__name__ == arch
        assert not any(info.values()), info  # no missing, unexpected or mismatched key
        with torch.no_grad():
            got = model.eval()(input_ids=ids).logits
        assert torch.equal(got, want), (cls.__name__, float((got - want).abs().max()))


def test_an_export_that_would_lack_a_source_tensor_is_refused_and_publishes_nothing(run) -> None:
    _, _, report = run
    assert report["lacking"]["published"] is False
    assert EXTRA in report["lacking"]["error"] and "would lack 1 of" in report["lacking"]["error"]


def test_the_offline_export_of_a_composite_checkpoint_equals_the_live_export(run) -> None:
    folders, out, _ = run
    checkpoint = out / "qwen3_5_vlm" / "run" / "checkpoint-1"
    stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert not any(
        ".visual." in k for k in stored
    )  # the checkpoint holds what trains: the tower is the source's
    target = out / "offline"
    proc = python("-m", ["hf_fsdp2.cli", "export", str(checkpoint), str(target), "--dtype", "bfloat16"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["verified"].startswith("verified"), summary
    live, offline = raw(out / "qwen3_5_vlm" / "export"), raw(target)
    assert sorted(offline) == checkpoint_names(folders["qwen3_5_vlm"])
    assert all(offline[n] == live[n] for n in live)
    card = (target / "README.md").read_text()
    assert "AutoModelForImageTextToText.from_pretrained(" in card and "byte for byte (frozen)" in card


def test_the_recipe_refuses_a_checkpoint_its_export_would_not_hold_whole_before_training(
    run, tmp_path
) -> None:
    folders, _, _ = run
    lacking = folders["qwen3_5_vlm"].parent / "lacking"
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 8, seed=1)
    argv = ["--model_name_or_path", str(lacking), "--dataset_name", str(data_file), "--max_length", "64"]
    argv += ["--per_device_train_batch_size", "2"]
    refused = torchrun(SFT, [*argv, "--output_dir", str(tmp_path / "run")], nproc=2, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-3000:]
    assert "would lack 1 of" in errors[0] and EXTRA in errors[0], errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step
