"""Composite checkpoints (vision tower + projector + language model) on text: loaded with their own class under the
checkpoint's names on rank 0 and on meta alike, their parts found and frozen, their FSDP2 units, the config-level
reads (text config), and what a composite run refuses before any work."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from support.composites import COMPOSITE_FAMILIES, MTP_TENSORS, checkpoint_names, make_composite_dir

from hf_fsdp2.attention_layout import choose_attention_layout
from hf_fsdp2.checkpoint.layout import CheckpointError
from hf_fsdp2.checkpoint.resume import check_config_compatible
from hf_fsdp2.composite import (
    COMPOSITES,
    check_composite_run,
    composite_spec,
    describe_parts,
    freeze_parts,
    partition,
    vision_parameters,
)
from hf_fsdp2.config import ConfigError, parse_config
from hf_fsdp2.export.naming import checkpoint_layout, tied_targets
from hf_fsdp2.model import (
    auto_class_name,
    check_max_length,
    decoder_layer_classes,
    fsdp_unit_classes,
    load_model,
    load_model_config,
)
from hf_fsdp2.padding_free_probe import _shrunk_config, padding_free_matches
from hf_fsdp2.plan import build_meta_model, check_plannable, fsdp_units
from hf_fsdp2.plan.experts import expert_plan
from hf_fsdp2.plan.settings import PlanSettings
from hf_fsdp2.train.loss import router_aux_coef
from hf_fsdp2.vision.grain import choose_grain, tower_blocks, tower_sizes

ARCH = {
    family: spec[0].removesuffix("Config") + "ForConditionalGeneration"
    for family, spec in COMPOSITE_FAMILIES.items()
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("composites")
    return {f: make_composite_dir(root / f, f, processor=False) for f in COMPOSITE_FAMILIES}


def _export_names(model: torch.nn.Module) -> list[str]:
    """The names the export writes (ties dropped), from the model's checkpoint layout."""
    drop = tied_targets(model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in drop}
    return list(checkpoint_layout(model, shapes).shapes(shapes))


@pytest.mark.parametrize("family", list(COMPOSITE_FAMILIES))
def test_a_composite_loads_with_its_own_class_under_the_checkpoints_names_on_rank_0_and_on_meta(
    folders: dict[str, Path], family: str
) -> None:
    """Rank 0 (from_pretrained) and the other ranks of rank-0 loading (from_config on meta) build the composite's own
    class (Llama 4 and Qwen3.5 once loaded their text class only, Mistral 3 not at all) and name every tensor as the
    folder does (Gemma 3's and Qwen3.5's names once differed between the two)."""
    folder = folders[family]
    loaded = load_model(str(folder))
    meta = load_model(str(folder), empty_weights=True)
    assert type(loaded).__name__ == type(meta).__name__ == ARCH[family]
    assert auto_class_name(loaded.config) == "AutoModelForImageTextToText"
    assert loaded.config.get_text_config().use_cache is False
    names = _export_names(loaded)
    assert _export_names(meta) == names
    # The folder's names, but the ties the export drops and the tensors the class does not load (Qwen3.5's mtp.*,
    # which the export carries from the source).
    unloaded = set(MTP_TENSORS) if family.startswith("qwen3_5") else set()
    assert set(names) == set(checkpoint_names(folder)) - unloaded


@pytest.mark.parametrize("family", list(COMPOSITE_FAMILIES))
def test_parts_units_and_freezing(folders: dict[str, Path], family: str) -> None:
    """Every parameter lies in one part; the decoder layers are the language model's only (the tower's blocks are
    in the composite's _no_split_modules too); the tower and the projector are one FSDP2 unit each; freezing them
    leaves the language model and the head trainable."""
    model = load_model(str(folders[family]))
    spec = composite_spec(model.config)
    assert spec is not None and spec.architecture == ARCH[family]
    parts = partition(model, spec)
    assert sum(len(v) for v in parts.values()) == len(list(model.named_parameters(remove_duplicate=False)))
    assert parts["tower"] and parts["language_model"]
    assert decoder_layer_classes(model) == (spec.text_layer,)
    assert set(model._no_split_modules) - {spec.text_layer}  # what the old units also took
    units = fsdp_unit_classes(model, decoder_layer_classes(model))
    # The tower's blocks are units of their own where hf_fsdp2.vision.grain chooses it (Qwen3.5's tiny tower is
    # larger than a decoder layer).
    sizes = tower_sizes(model, spec, decoder_layer_classes(model))
    block = type(tower_blocks(model.get_submodule(spec.tower[0]))[0]).__name__
    assert units == (*spec.fsdp_units(), *([block] if choose_grain(sizes) == "blocks" else []))
    frozen = freeze_parts(model, spec, freeze_vision_tower=True, freeze_multi_modal_projector=True)
    assert set(frozen) == set(parts["tower"]) | set(parts["projector"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()} - set(frozen)
    tower = sum(p.numel() for n, p in model.named_parameters() if n in frozen)
    assert vision_parameters(model, spec) == tower > 0
    line = describe_parts(model, spec)
    assert f"composite {spec.architecture}: language model" in line and "vision tower" in line, line
    assert "vision tower " in line and line.count("frozen") >= 1, line


def test_freezing_only_the_tower_leaves_the_projector_trainable(folders: dict[str, Path]) -> None:
    model = load_model(str(folders["gemma3_vlm"]))
    spec = COMPOSITES["Gemma3ForConditionalGeneration"]
    frozen = freeze_parts(model, spec, freeze_vision_tower=True, freeze_multi_modal_projector=False)
    assert frozen and all(n.startswith("model.vision_tower.") for n in frozen)
    assert all(
        p.requires_grad for n, p in model.named_parameters() if n.startswith("model.multi_modal_projector.")
    )


def test_a_composite_run_is_refused_before_any_work_where_it_cannot_run(folders: dict[str, Path]) -> None:
    config = load_model_config(str(folders["gemma3_vlm"]))
    ok = dict(tp_size=1, cp_size=1)
    assert check_composite_run(config, **ok) is COMPOSITES["Gemma3ForConditionalGeneration"]
    for key, value, words in (
        ("tp_size", 2, "tp_size=2 on Gemma3ForConditionalGeneration"),
        ("cp_size", 2, "cp_size=2 on Gemma3ForConditionalGeneration"),
    ):
        with pytest.raises(ConfigError, match=words):
            check_composite_run(config, **{**ok, key: value})
    # A text model: nothing to check.
    assert check_composite_run(transformers.LlamaConfig(), **{**ok, "tp_size": 2}) is None
    # An image-text-to-text family outside the table, named; remote code refused.
    other = transformers.PaliGemmaConfig()
    with pytest.raises(ConfigError, match="PaliGemmaForConditionalGeneration|'paligemma'"):
        composite_spec(other)
    remote = copy.deepcopy(config)
    remote.auto_map = {"AutoModelForImageTextToText": "modeling.Custom"}
    with pytest.raises(ConfigError, match="remote code"):
        composite_spec(remote)
    # Gemma 3's composite has no flash path in transformers: refused by name, on any device.
    with pytest.raises(ConfigError, match="Gemma3ForConditionalGeneration does not support it"):
        choose_attention_layout(
            config,
            device_type="cuda",
            attn_implementation="flash_attention_2",
            installed=frozenset({"flash_attention_2"}),
        )


def test_config_level_reads_take_the_text_config(folders: dict[str, Path]) -> None:
    """A composite keeps max_position_embeddings, vocab_size and the MoE keys in its text config only: the
    max-length check, the router loss and the planner's experts read them there."""
    config = load_model_config(str(folders["mistral3"]))
    assert not hasattr(config, "max_position_embeddings")
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        check_max_length(1024, config)
    moe = load_model_config(str(folders["qwen3_5_moe_vlm"]))
    moe.text_config.output_router_logits, moe.text_config.router_aux_loss_coef = True, 0.01
    assert router_aux_coef(moe) == 0.01
    # The planner reads the experts' top-k there (the composite's experts are transformers' fused ones: planned).
    settings = PlanSettings(world_size=2, device_type="cpu")
    meta = build_meta_model(moe, settings)
    check_plannable(moe, meta)
    experts = expert_plan(meta, moe, settings)
    assert experts is not None and experts.shapes.top_k == moe.text_config.num_experts_per_tok


def test_the_padding_free_probe_builds_the_composite_shrunk(folders: dict[str, Path]) -> None:
    """The probe builds the composite's own class (Mistral 3 has no causal-LM class: the probe failed), its language
    model shrunk as a text model's and its tower to one block (a full-size config kept every text layer and the
    vocabulary)."""
    assert padding_free_matches(load_model_config(str(folders["mistral3"])))[0]
    big = transformers.Gemma3Config(
        text_config={"num_hidden_layers": 62, "vocab_size": 262208, "hidden_size": 64, "head_dim": 16}
    )
    small = _shrunk_config(big)
    assert small.text_config.num_hidden_layers == 2 and small.text_config.vocab_size == 64
    assert len(small.text_config.layer_types) == 2
    assert small.vision_config.num_hidden_layers == 1 and small.vision_config.intermediate_size == 32
    assert big.text_config.num_hidden_layers == 62  # a copy


def test_the_memory_plan_builds_the_composite_with_its_frozen_units(folders: dict[str, Path]) -> None:
    config = load_model_config(str(folders["gemma3_vlm"]))
    settings = PlanSettings(world_size=2, device_type="cpu", seq_len=64)
    model = build_meta_model(config, settings)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert not any(
        p.requires_grad for n, p in model.named_parameters() if n.startswith("model.vision_tower.")
    )
    units = {u.name: u for u in fsdp_units(model, settings)}
    for name in ("model.vision_tower", "model.multi_modal_projector"):
        assert units[name].numel > 0 and units[name].trainable_numel == 0 and units[name].gathered_bytes == 0
    assert units["model.language_model.layers.0"].gathered_bytes > 0


def test_resume_takes_the_freeze_keys_as_must_match_and_old_checkpoints_as_frozen() -> None:
    now = {"freeze_vision_tower": True, "freeze_multi_modal_projector": True, "load_in_4bit": False}
    check_config_compatible({"load_in_4bit": False}, now)  # from before the keys: the tower never moved there
    with pytest.raises(CheckpointError, match="freeze_vision_tower: checkpoint False vs now True"):
        check_config_compatible({**now, "freeze_vision_tower": False}, now)
    with pytest.raises(CheckpointError, match="freeze_multi_modal_projector: checkpoint True vs now False"):
        check_config_compatible(now, {**now, "freeze_multi_modal_projector": False})


def test_doctor_reports_the_units_and_refuses_what_the_run_refuses(folders: dict[str, Path]) -> None:
    from hf_fsdp2.doctor.recipe import wrap_findings

    config = load_model_config(str(folders["llama4_vlm"]))
    argv = [
        "--model_name_or_path",
        str(folders["llama4_vlm"]),
        "--dataset_name",
        "d.jsonl",
        "--output_dir",
        "o",
    ]
    cfg = parse_config(argv)
    found = wrap_findings(config, {}, cfg)
    composite = [f for f in found if f.check == "composite"]
    assert composite and composite[0].level == "ok", found
    assert (
        "each Llama4TextDecoderLayer, the Llama4VisionModel, the Llama4MultiModalProjector"
        in composite[0].message
    )
    cfg.fsdp.tp_size = 2
    found = wrap_findings(config, {}, cfg)
    assert [f.level for f in found] == ["error"] and "tp_size=2" in found[0].message, found


def test_rows_of_several_documents_follow_the_composites_own_class(folders: dict[str, Path]) -> None:
    """The batch layout asks the composite's class: Qwen3.5's linear attention refuses packing by its name, and with
    padding_free unset keeps padded batches; Gemma 3's composite passes its own probe (padding-free on CPU)."""
    qwen = load_model_config(str(folders["qwen3_5_vlm"]))
    with pytest.raises(
        ConfigError, match=r"Qwen3_5ForConditionalGeneration \(model_type qwen3_5\): 1 of its 2"
    ):
        choose_attention_layout(qwen, device_type="cpu", packing=True)
    assert not choose_attention_layout(qwen, device_type="cpu").padding_free
    gemma = choose_attention_layout(load_model_config(str(folders["gemma3_vlm"])), device_type="cpu")
    assert gemma.padding_free and "a probe forward with sdpa attention" in gemma.reason, gemma.reason


def test_the_checkpoint_names_are_read_from_any_weight_format_without_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Safetensors headers, an index, a PyTorch .bin (mapped on meta), a hub repo through the cache; none: named."""
    import json

    import huggingface_hub
    from safetensors.torch import save_file

    from hf_fsdp2.conversions import checkpoint_tensor_names

    tensors = {"a.weight": torch.zeros(2, 2), "b.bias": torch.zeros(2)}
    (tmp_path / "st").mkdir()
    save_file(tensors, str(tmp_path / "st" / "model.safetensors"))
    (tmp_path / "bin").mkdir()
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "index").mkdir()
    index = tmp_path / "index" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": "x-1.safetensors", "b.bias": "x-2.safetensors"}}))
    for folder in ("st", "bin", "index"):
        assert sorted(checkpoint_tensor_names(str(tmp_path / folder))) == ["a.weight", "b.bias"]
    cached = {"model.safetensors.index.json": str(index)}
    monkeypatch.setattr(
        huggingface_hub, "try_to_load_from_cache", lambda repo, name, revision=None: cached.get(name)
    )
    assert sorted(checkpoint_tensor_names("org/model")) == ["a.weight", "b.bias"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot read the tensor names of"):
        checkpoint_tensor_names(str(tmp_path / "empty"))
