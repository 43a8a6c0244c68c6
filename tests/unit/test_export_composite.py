"""The export of a composite checkpoint (vision tower + projector + language model) in one process: what it carries
from the source folder byte for byte (the frozen tower and projector, what the class does not load), the refusal of
an export that would lack a source tensor, the metadata, and the verification's checks of the carried bytes.

The 2-rank path, the reloads and the offline export are tested in tests/distributed/test_export_composite_2rank.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.composites import MTP_TENSORS, checkpoint_names, make_composite_dir

from hf_fsdp2.composite import composite_spec, freeze_parts
from hf_fsdp2.export import ExportError, ExportVerificationError, export_model, make_plan, verify_export
from hf_fsdp2.export.files import Chunk, assemble_file, read_header
from hf_fsdp2.export.plan import export_config
from hf_fsdp2.export.source import ExportSource
from hf_fsdp2.model import load_model, load_tokenizer

BIG = 10**9


def raw_bytes(folder: Path, name: str) -> bytes:
    """The bytes of tensor ``name`` in ``folder``'s safetensors files (or in the file ``folder``), as stored."""
    for path in [folder] if folder.is_file() else sorted(folder.glob("*.safetensors")):
        header, start = read_header(path)
        if name in header:
            begin, end = header[name]["data_offsets"]
            with open(path, "rb") as fh:
                fh.seek(start + begin)
                return fh.read(end - begin)
    raise KeyError(name)


def frozen_model(folder: Path) -> torch.nn.Module:
    model = load_model(str(folder))
    spec = composite_spec(model.config)
    assert spec is not None
    freeze_parts(model, spec, freeze_vision_tower=True, freeze_multi_modal_projector=True)
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_composite_dir(tmp_path_factory.mktemp("qwen") / "model", "qwen3_5_vlm")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved in bf16: the export dtype casts nothing, so the carried bytes are the trained path's dtype too."""
    folder = make_composite_dir(tmp_path_factory.mktemp("mistral") / "model", "mistral3")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor"}))
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tools.jinja").write_text("{{ messages }}")
    return folder


def test_the_plan_carries_the_frozen_tower_and_what_the_class_does_not_load(qwen: Path) -> None:
    model = frozen_model(qwen)
    plan = make_plan(model, "bfloat16", BIG, source=ExportSource(str(qwen)))
    source = checkpoint_names(qwen)
    assert plan.carried is not None
    tower = sorted(n for n in source if n.startswith("model.visual."))
    assert tower and sorted(plan.carried.frozen) == tower  # the tower, its merger (the projector) inside
    assert sorted(plan.carried.unloaded) == sorted(MTP_TENSORS)
    assert sorted(plan.carried.tensors) == sorted(tower + list(MTP_TENSORS))
    # Every source tensor in the export (written from the shards or carried) but a tied copy: Qwen3.5 dense is tied.
    assert plan.carried.tied == {"lm_head.weight"}
    assert sorted(plan.shapes) == sorted(set(source) - plan.carried.tied)
    assert not set(plan.sources) & set(plan.carried.tensors)  # the tower is not written from the shards too
    assert {plan.dtypes[n] for n in plan.carried.tensors} == {torch.float32}  # the source's dtype, not bf16
    assert {plan.dtypes[n] for n in plan.sources} == {torch.bfloat16}
    assert plan.weights_dtype == torch.bfloat16  # config.json states what trained


def test_without_a_source_every_tensor_is_written_from_the_shards(qwen: Path) -> None:
    plan = make_plan(frozen_model(qwen), "bfloat16", BIG)
    assert plan.carried is None and not any(n.startswith("mtp.") for n in plan.shapes)


def test_an_export_that_would_lack_a_source_tensor_is_refused_by_name(qwen: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for item in qwen.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.visual.extra_head.weight"] = torch.zeros(
        3
    )  # neither in the model nor ignorable by its class
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = frozen_model(qwen)  # the same model; the folder it is exported against holds one tensor more
    with pytest.raises(
        ExportError, match=r"would lack 1 of the \d+ tensors .*model\.visual\.extra_head\.weight"
    ):
        make_plan(model, "bfloat16", BIG, source=ExportSource(str(folder)))


def test_a_carried_tensor_is_its_source_bytes_whatever_the_dtype(tmp_path: Path) -> None:
    source = tmp_path / "source.safetensors"
    values = {
        "a": torch.randn(5, 3).to(torch.bfloat16),
        "b": torch.randn(4, dtype=torch.float32),
        "c": torch.randn(2, 2).to(torch.float8_e4m3fn),
    }
    save_file(values, str(source))
    header, start = read_header(source)
    chunks = {
        k: [
            Chunk(
                path=source,
                start=start + v["data_offsets"][0],
                offsets=[0] * len(v["shape"]),
                shape=v["shape"],
                dtype=v["dtype"],
            )
        ]
        for k, v in header.items()
        if k != "__metadata__"
    }
    out = tmp_path / "out.safetensors"
    assemble_file(
        out,
        ["c", "a", "b"],
        {k: tuple(v.shape) for k, v in values.items()},
        {k: v.dtype for k, v in values.items()},
        chunks,
    )
    for key in values:
        assert raw_bytes(out, key) == raw_bytes(source, key)
        got = load_file(str(out))[key]
        assert got.dtype == values[key].dtype and torch.equal(
            got.view(torch.uint8), values[key].view(torch.uint8)
        )


def test_export_config_states_the_dtype_on_every_sub_config() -> None:
    config = transformers.Gemma3Config()
    out = export_config(config, torch.bfloat16, "Gemma3ForConditionalGeneration")
    saved = out.to_dict()
    assert saved["dtype"] == saved["text_config"]["dtype"] == saved["vision_config"]["dtype"] == "bfloat16"
    assert saved["text_config"]["use_cache"] is True


def test_the_written_export_holds_the_source_whole_with_its_files(mistral: Path, tmp_path: Path) -> None:
    model = frozen_model(mistral)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.5)  # "trained": the language model differs from the source
    export_model(
        model,
        tmp_path / "out",
        config=model.config,
        tokenizer=load_tokenizer(str(mistral)),
        generation_config=model.generation_config,
        dtype="bfloat16",
        max_shard_bytes=200_000,  # several files: carried tensors are assembled by the file's rank like the others
        verify=False,
        source=ExportSource(str(mistral)),
    )
    out = tmp_path / "out"
    source = checkpoint_names(mistral)
    assert checkpoint_names(out) == source
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == source
    for name in source:
        frozen = name.startswith(("vision_tower.", "multi_modal_projector."))
        assert (raw_bytes(out, name) == raw_bytes(mistral, name)) == frozen, name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Mistral3ForConditionalGeneration"]
    assert config["text_config"]["dtype"] == config["vision_config"]["dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file()
    for name in ("processor_config.json", "additional_chat_templates/tools.jinja"):
        assert (out / name).read_bytes() == (mistral / name).read_bytes(), name


def test_verification_catches_a_carried_tensor_changed_on_disk(mistral: Path, tmp_path: Path) -> None:
    model = frozen_model(mistral)
    source = ExportSource(str(mistral))
    export_model(
        model,
        tmp_path,
        config=model.config,
        tokenizer=None,
        generation_config=None,
        dtype="bfloat16",
        max_shard_bytes=BIG,
        verify=False,
        source=source,
    )
    path = tmp_path / "model.safetensors"
    header, start = read_header(path)
    name = "vision_tower.transformer.layers.0.feed_forward.down_proj.weight"
    raw = bytearray(path.read_bytes())
    at = start + header[name]["data_offsets"][0]
    raw[at : at + 8] = bytes(b ^ 0xFF for b in raw[at : at + 8])
    path.write_bytes(bytes(raw))
    with pytest.raises(ExportVerificationError, match=rf"{name}: its bytes in model\.safetensors differ"):
        verify_export(model, tmp_path, dtype="bfloat16", source=source)
    # Without the source (every tensor compared with the shards; the bf16 tower is the export dtype): caught too.
    with pytest.raises(ExportVerificationError, match=rf"{name}: the bytes on disk differ"):
        verify_export(model, tmp_path, dtype="bfloat16")


def test_verification_catches_a_frozen_tensor_the_live_model_does_not_hold(
    mistral: Path, tmp_path: Path
) -> None:
    model = frozen_model(mistral)
    source = ExportSource(str(mistral))
    export_model(
        model,
        tmp_path,
        config=model.config,
        tokenizer=None,
        generation_config=None,
        dtype="bfloat16",
        max_shard_bytes=BIG,
        verify=False,
        source=source,
    )
    with (
        torch.no_grad()
    ):  # the frozen tower moved: the export (the source's bytes) is not what the model computes
        model.get_parameter("model.vision_tower.ln_pre.weight").add_(1.0)
    with pytest.raises(ExportVerificationError, match=r"vision_tower\.ln_pre\.weight: the model's values"):
        verify_export(model, tmp_path, dtype="bfloat16", source=source)


def test_the_model_card_of_a_composite_says_what_trained_and_how_to_load_it() -> None:
    from hf_fsdp2.export.card import render_model_card

    config = {"model_name_or_path": "google/gemma-3-4b-it", "dataset_name": "org/chat"}
    card = render_model_card(config, metrics=None, image_text=True)
    assert "pipeline_tag: image-text-to-text" in card
    assert "AutoModelForImageTextToText.from_pretrained(" in card and "AutoModelForCausalLM" not in card
    assert "the vision tower and the multi-modal projector are the base model's, byte for byte" in card
    text = render_model_card(config, metrics=None)
    assert "pipeline_tag: text-generation" in text and "AutoModelForCausalLM.from_pretrained(" in text
