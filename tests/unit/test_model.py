"""Unit tests for hf_fsdp2.model: tokenizer and model loading, length check, decoder-layer classes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import build_llama2_test_tokenizer, llama2_tokenizer_file
from safetensors.torch import load_file
from support.tiny import make_tiny_llama_dir
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast

from hf_fsdp2.model import (
    check_max_length,
    count_parameters,
    decoder_layer_classes,
    load_model,
    load_model_config,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> torch.nn.Module:
    return load_model(str(tiny_dir))


# ---------------------------------------------------------------------------------------------------
# load_tokenizer
# ---------------------------------------------------------------------------------------------------


def test_load_tokenizer_uses_eos_as_pad_when_missing(tmp_path: Path) -> None:
    tokenizer = build_llama2_test_tokenizer()
    assert tokenizer.pad_token is None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "</s>"
    assert loaded.pad_token_id == loaded.eos_token_id == 2


def test_load_tokenizer_keeps_an_existing_pad(tmp_path: Path) -> None:
    tokenizer = build_llama2_test_tokenizer()
    tokenizer.pad_token = "<unk>"
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<unk>"
    assert loaded.pad_token_id == 0
    assert loaded.eos_token_id == 2


def test_load_tokenizer_without_pad_and_eos(tmp_path: Path) -> None:
    PreTrainedTokenizerFast(tokenizer_file=str(llama2_tokenizer_file())).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_of_tiny_model_keeps_chat_template(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.pad_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("loader", [load_tokenizer, load_model_config, load_model])
def test_missing_local_folder_names_the_path(tmp_path: Path, loader: Callable[[str], object]) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        loader(str(missing))
    assert str(missing) in str(err.value)
    assert "no such folder" in str(err.value)


@pytest.mark.parametrize("name", ["./no-such-model", "a/b/no-such-model"])
def test_relative_paths_are_local_not_hub_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model_config(name)


def test_tilde_path_is_expanded(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tiny_dir.parent))
    tokenizer = load_tokenizer("~/model")
    assert tokenizer.eos_token == "</s>"
    config = load_model_config("~/model")
    assert config.hidden_size == 64
    with pytest.raises(FileNotFoundError, match="~/nothing"):
        load_model_config("~/nothing")


@pytest.mark.parametrize("loader", [load_model_config, load_model])
def test_folder_without_config_json(tmp_path: Path, loader: Callable[[str], object]) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")  # a folder, but no config.json
    with pytest.raises(FileNotFoundError) as err:
        loader(str(tmp_path))
    assert "config.json" in str(err.value)
    assert str(tmp_path) in str(err.value)


# ---------------------------------------------------------------------------------------------------
# check_max_length
# ---------------------------------------------------------------------------------------------------


def test_check_max_length_names_both_numbers() -> None:
    config = LlamaConfig(max_position_embeddings=256)
    check_max_length(256, config)
    check_max_length(1, config)
    with pytest.raises(ValueError) as err:
        check_max_length(257, config)
    assert "max_length=257" in str(err.value)
    assert "max_position_embeddings=256" in str(err.value)


def test_check_max_length_without_a_limit() -> None:
    config = PretrainedConfig()
    assert not hasattr(config, "max_position_embeddings")
    check_max_length(10**6, config)


# ---------------------------------------------------------------------------------------------------
# load_model
# ---------------------------------------------------------------------------------------------------


def test_load_model_for_training(tiny_dir: Path, tiny_model: torch.nn.Module) -> None:
    model = tiny_model
    assert model.training
    assert all(m.training for m in model.modules())
    assert model.config.use_cache is False
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    saved = load_file(str(tiny_dir / "model.safetensors"))
    torch.testing.assert_close(
        model.state_dict()["model.layers.1.mlp.up_proj.weight"],
        saved["model.layers.1.mlp.up_proj.weight"],
        rtol=0,
        atol=0,
    )


def test_load_model_in_bfloat16(tiny_dir: Path) -> None:
    model = load_model(str(tiny_dir), dtype="bfloat16", attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.use_cache is False
    assert model.training
    assert model.config._attn_implementation == "eager"
    saved = load_file(str(tiny_dir / "model.safetensors"))
    torch.testing.assert_close(
        model.state_dict()["model.embed_tokens.weight"],
        saved["model.embed_tokens.weight"].to(torch.bfloat16),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(
    "family, ends",
    [
        ("llama", [2, 2096, 2097]),  # ChatML's <|im_end|> and <|im_start|> beside </s>, as Qwen lists two
        ("gemma2", [1, 106]),  # Gemma's <end_of_turn>
        ("qwen3", None),  # no generation_config.json: derived from config.json, on every rank alike
    ],
)
def test_a_model_built_from_its_config_reads_the_generation_config_beside_it(
    tmp_path: Path, family: str, ends: list[int] | None
) -> None:
    """The ranks other than 0 under fsdp_cpu_ram_efficient_loading build the model from config.json
    (empty_weights): its generation_config (GRPO's stop ids, the export's generation_config.json) must be the
    folder's, as from_pretrained reads it on rank 0, not one derived from config.json."""
    import json

    from support.families import make_family_dir

    folder = (
        make_tiny_llama_dir(tmp_path / family)
        if family == "llama"
        else make_family_dir(tmp_path / family, family)
    )
    (folder / "generation_config.json").unlink(missing_ok=True)
    if ends is not None:
        (folder / "generation_config.json").write_text(
            json.dumps(
                {"bos_token_id": 1, "eos_token_id": ends, "do_sample": True, "top_k": 20, "temperature": 0.6}
            )
        )
    loaded = load_model(str(folder))
    built = load_model(str(folder), empty_weights=True)
    assert next(built.parameters()).is_meta
    want = ends if ends is not None else loaded.config.eos_token_id
    assert loaded.generation_config.eos_token_id == built.generation_config.eos_token_id == want
    assert built.generation_config.to_dict() == loaded.generation_config.to_dict()


# ---------------------------------------------------------------------------------------------------
# decoder_layer_classes, count_parameters
# ---------------------------------------------------------------------------------------------------


def test_decoder_layer_classes_from_no_split_modules(tiny_model: torch.nn.Module) -> None:
    assert decoder_layer_classes(tiny_model) == ("LlamaDecoderLayer",)
    assert decoder_layer_classes(tiny_model, []) == ("LlamaDecoderLayer",)  # empty override = default


def test_decoder_layer_classes_valid_override(tiny_model: torch.nn.Module) -> None:
    assert decoder_layer_classes(tiny_model, ["LlamaMLP"]) == ("LlamaMLP",)
    assert decoder_layer_classes(tiny_model, ["LlamaDecoderLayer", "LlamaMLP"]) == (
        "LlamaDecoderLayer",
        "LlamaMLP",
    )


def test_decoder_layer_classes_override_matching_nothing(tiny_model: torch.nn.Module) -> None:
    with pytest.raises(ValueError) as err:
        decoder_layer_classes(tiny_model, ["MistralDecoderLayer"])
    assert "MistralDecoderLayer" in str(err.value)
    assert "LlamaDecoderLayer" in str(err.value)  # lists what the model does hold


def test_decoder_layer_classes_override_with_a_typo(tiny_model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="LlamaMpl"):
        decoder_layer_classes(tiny_model, ["LlamaDecoderLayer", "LlamaMpl"])


def test_decoder_layer_classes_without_no_split_modules() -> None:
    with pytest.raises(ValueError, match="fsdp_layer_cls_to_wrap"):
        decoder_layer_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert decoder_layer_classes(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["Linear"]) == ("Linear",)


def test_count_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)
    assert count_parameters(model) == (4 * 3 + 3 + 3 * 2 + 2, 4 * 3 + 3 + 2)


def test_default_attention_is_what_the_model_supports(tmp_path) -> None:
    """The default ``auto`` lets transformers choose, as a plain ``from_pretrained`` does: Gemma-2 gets eager in
    transformers 5.24 (it refuses sdpa there) and sdpa in 5.17 (the floor); Llama gets sdpa in both."""
    from support.families import make_family_dir
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.model import load_model

    for name, family in (("gemma2", "gemma2"), ("llama", "llama_tied")):
        path = make_family_dir(tmp_path / name, family)
        plain = AutoModelForCausalLM.from_pretrained(path).config._attn_implementation
        assert load_model(str(path)).config._attn_implementation == plain, name
        assert plain in (("eager", "sdpa") if name == "gemma2" else ("sdpa",)), (name, plain)


def test_a_tokenizer_larger_than_the_embedding_is_refused_or_resized(tmp_path) -> None:
    from support.families import make_family_dir
    from transformers import AutoConfig

    from hf_fsdp2.model import check_vocab, load_model, resize_embeddings

    path = make_family_dir(tmp_path / "m", "llama3_untied")
    config = AutoConfig.from_pretrained(path)
    rows = config.vocab_size
    assert check_vocab(rows, config, resize=False) is None
    with pytest.raises(
        ValueError,
        match=f"the tokenizer has {rows + 3} tokens but the model's embedding has {rows} rows.*resize_token_embeddings=true",
    ):
        check_vocab(rows + 3, config, resize=False)
    assert f"from {rows} to {rows + 3} rows" in (check_vocab(rows + 3, config, resize=True) or "")
    model = load_model(str(path))
    resize_embeddings(model, rows + 3)
    assert model.get_input_embeddings().weight.shape[0] == rows + 3
    assert model.get_output_embeddings().weight.shape[0] == rows + 3 and model.config.vocab_size == rows + 3
