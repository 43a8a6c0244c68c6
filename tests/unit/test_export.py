"""Unit tests for hf_fsdp2.export, in one process: the HF folder that from_pretrained must load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.tiny import make_tiny_llama_dir
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.generation import GenerationConfig

from hf_fsdp2.export import INDEX_NAME, WEIGHTS_NAME, export_model, shard_state_dict, write_hf_folder
from hf_fsdp2.model import load_model, load_tokenizer

BIG = 10**9


class Tiny:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.model = load_model(str(path))
        self.tokenizer = load_tokenizer(str(path))
        self.state_dict = {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(make_tiny_llama_dir(tmp_path_factory.mktemp("untied") / "model", seed=1))


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(
        make_tiny_llama_dir(tmp_path_factory.mktemp("tied") / "model", tie_word_embeddings=True, seed=2)
    )


def export(
    tiny: Tiny, out: Path, *, dtype: str = "float32", max_shard_bytes: int = BIG, **kwargs: object
) -> list[str]:
    kwargs.setdefault("tokenizer", tiny.tokenizer)
    kwargs.setdefault("generation_config", None)
    return write_hf_folder(
        tiny.state_dict, out, config=tiny.model.config, dtype=dtype, max_shard_bytes=max_shard_bytes, **kwargs
    )


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------
# A single-file export that from_pretrained loads
# ---------------------------------------------------------------------------------------------------


def test_fp32_export_reloads_with_identical_weights(untied: Tiny, tmp_path: Path) -> None:
    out = tmp_path / "export"
    names = export(untied, out)
    assert names == [WEIGHTS_NAME]
    assert weight_files(out) == [WEIGHTS_NAME]
    assert not (out / INDEX_NAME).exists()
    assert not (out / ".export-incomplete").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.float32
    got = reloaded.state_dict()
    assert set(got) == set(untied.state_dict)
    for key, want in untied.state_dict.items():
        torch.testing.assert_close(got[key], want, rtol=0, atol=0, msg=key)
    # The untied head is its own tensor and is written.
    assert "lm_head.weight" in load_file(str(out / WEIGHTS_NAME))
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()


def test_bf16_export_equals_the_bf16_cast(untied: Tiny, tmp_path: Path) -> None:
    out = tmp_path / "export"
    export(untied, out, dtype="bfloat16")
    on_disk = load_file(str(out / WEIGHTS_NAME))
    assert {t.dtype for t in on_disk.values()} == {torch.bfloat16}
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    got = reloaded.state_dict()
    for key, want in untied.state_dict.items():
        torch.testing.assert_close(got[key], want.to(torch.bfloat16), rtol=0, atol=0, msg=key)
    # The cast really rounds: the export is not the fp32 weights.
    weight = untied.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(weight.to(torch.bfloat16).float(), weight)


def test_float16_export_dtype(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="float16")
    assert {t.dtype for t in load_file(str(tmp_path / WEIGHTS_NAME)).values()} == {torch.float16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"


def test_config_json_states_export_dtype_and_cache_without_touching_the_live_config(
    untied: Tiny, tmp_path: Path
) -> None:
    assert untied.model.config.use_cache is False  # the training model
    export(untied, tmp_path, dtype="bfloat16")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dtype"] == "bfloat16"
    assert saved["use_cache"] is True  # inference default restored in the export
    assert saved["architectures"] == ["LlamaForCausalLM"]
    assert saved["hidden_size"] == 64
    assert untied.model.config.use_cache is False
    assert untied.model.config.dtype == torch.float32


def test_tokenizer_chat_template_and_generation_config_are_written(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template == untied.tokenizer.chat_template
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.encode("alpha bravo") == untied.tokenizer.encode("alpha bravo")
    assert tokenizer.pad_token == "</s>"
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)  # derived from the model config


def test_given_generation_config_is_saved(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, generation_config=GenerationConfig(max_new_tokens=7, eos_token_id=2))
    assert json.loads((tmp_path / "generation_config.json").read_text())["max_new_tokens"] == 7


def test_without_tokenizer_no_tokenizer_files(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, tokenizer=None)
    assert not (tmp_path / "tokenizer.json").exists()
    assert not (tmp_path / "tokenizer_config.json").exists()
    assert (tmp_path / WEIGHTS_NAME).is_file()


# ---------------------------------------------------------------------------------------------------
# Tied embeddings
# ---------------------------------------------------------------------------------------------------


def test_tied_head_is_not_written_and_is_tied_on_reload(tied: Tiny, tmp_path: Path) -> None:
    assert tied.model.config.tie_word_embeddings
    assert "lm_head.weight" in tied.state_dict  # the state dict has it; the export must drop it
    export(tied, tmp_path)
    on_disk = load_file(str(tmp_path / WEIGHTS_NAME))
    assert "lm_head.weight" not in on_disk
    assert set(on_disk) == set(tied.state_dict) - {"lm_head.weight"}

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(
        reloaded.lm_head.weight, tied.state_dict["model.embed_tokens.weight"], rtol=0, atol=0
    )


# ---------------------------------------------------------------------------------------------------
# Sharded export and re-export
# ---------------------------------------------------------------------------------------------------


def check_sharded_folder(tiny: Tiny, out: Path, names: list[str], limit: int, dtype: torch.dtype) -> None:
    n = len(names)
    assert n > 1
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert weight_files(out) == names
    index = json.loads((out / INDEX_NAME).read_text())
    expected_keys = set(tiny.state_dict) - (
        {"lm_head.weight"} if tiny.model.config.tie_word_embeddings else set()
    )
    assert set(index["weight_map"]) == expected_keys
    assert set(index["weight_map"].values()) == set(names)
    total = 0
    for name in names:
        with safe_open(str(out / name), framework="pt") as fh:
            keys = list(fh.keys())
            assert keys, name
            sizes = [nbytes(fh.get_tensor(k)) for k in keys]
            assert all(fh.get_tensor(k).dtype == dtype for k in keys)
        assert all(index["weight_map"][k] == name for k in keys)
        assert sum(sizes) <= limit or len(keys) == 1, (name, sum(sizes))
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert total == sum(nbytes(tiny.state_dict[k].to(dtype)) for k in expected_keys)


def test_sharded_export_with_index_reloads(untied: Tiny, tmp_path: Path) -> None:
    limit = 100_000
    names = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=limit)
    # The two 32002 x 64 matrices (4 MB in bf16) are over the limit: each gets a shard of its own.
    assert len(names) >= 4
    check_sharded_folder(untied, tmp_path, names, limit, torch.bfloat16)
    assert not (tmp_path / WEIGHTS_NAME).exists()
    assert not (tmp_path / ".export-incomplete").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    got = reloaded.state_dict()
    for key, want in untied.state_dict.items():
        torch.testing.assert_close(got[key], want.to(torch.bfloat16), rtol=0, atol=0, msg=key)


def test_sharded_tied_export(tied: Tiny, tmp_path: Path) -> None:
    names = export(tied, tmp_path, max_shard_bytes=150_000)
    check_sharded_folder(tied, tmp_path, names, 150_000, torch.float32)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(
        reloaded.model.layers[1].mlp.down_proj.weight,
        tied.state_dict["model.layers.1.mlp.down_proj.weight"],
        rtol=0,
        atol=0,
    )


def test_reexport_with_fewer_shards_removes_stale_files(untied: Tiny, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a run file that is not the export's
    many = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=50_000)
    fewer = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=200_000)
    assert 1 < len(fewer) < len(many)
    assert weight_files(tmp_path) == fewer
    assert set(json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"].values()) == set(fewer)

    single = export(untied, tmp_path, dtype="bfloat16")
    assert single == [WEIGHTS_NAME]
    assert weight_files(tmp_path) == [WEIGHTS_NAME]
    assert not (tmp_path / INDEX_NAME).exists()
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"
    assert not (tmp_path / ".export-incomplete").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path)  # loads: no stale index pointing at gone shards


def test_reexport_from_single_to_sharded_removes_single_file(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="bfloat16")
    names = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=100_000)
    assert weight_files(tmp_path) == names
    assert WEIGHTS_NAME not in names


def test_leftover_staging_folder_of_a_crashed_export_is_replaced(untied: Tiny, tmp_path: Path) -> None:
    stage = tmp_path / ".export-incomplete"
    stage.mkdir()
    (stage / "model-00001-of-00009.safetensors").write_bytes(b"half written")
    export(untied, tmp_path)
    assert not stage.exists()
    assert weight_files(tmp_path) == [WEIGHTS_NAME]


def test_export_model_single_process(tied: Tiny, tmp_path: Path) -> None:
    names = export_model(
        tied.model,
        tmp_path,
        config=tied.model.config,
        tokenizer=tied.tokenizer,
        generation_config=None,
        dtype="float32",
        max_shard_bytes=BIG,
        is_main_process=True,
    )
    assert names == [WEIGHTS_NAME]
    on_disk = load_file(str(tmp_path / WEIGHTS_NAME))
    assert set(on_disk) == set(tied.state_dict) - {"lm_head.weight"}
    for key, tensor in on_disk.items():
        torch.testing.assert_close(tensor, tied.state_dict[key], rtol=0, atol=0, msg=key)


def test_export_model_on_a_non_main_process_writes_nothing(tied: Tiny, tmp_path: Path) -> None:
    out = tmp_path / "export"
    names = export_model(
        tied.model,
        out,
        config=tied.model.config,
        tokenizer=tied.tokenizer,
        generation_config=None,
        dtype="float32",
        max_shard_bytes=BIG,
        is_main_process=False,
    )
    assert names == []
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# Small hand-made state dicts: shard_state_dict, dtype handling, errors
# ---------------------------------------------------------------------------------------------------


def fp32(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)  # 4 bytes per element


def test_shard_state_dict_greedy_split_by_hand() -> None:
    sd = {"a": fp32(10), "b": fp32(15), "c": fp32(50), "d": fp32(5), "e": fp32(5)}  # 40, 60, 200, 20, 20 B
    shards = shard_state_dict(sd, max_shard_bytes=100)
    # a+b = 100 fits exactly; c (200 B) is over the limit and alone; d+e = 40.
    assert [list(s) for s in shards] == [["a", "b"], ["c"], ["d", "e"]]
    assert all(s[k] is sd[k] for s in shards for k in s)


def test_shard_state_dict_oversize_first_and_last() -> None:
    sd = {"big": fp32(100), "small": fp32(1), "huge": fp32(1000)}
    assert [list(s) for s in shard_state_dict(sd, max_shard_bytes=10)] == [["big"], ["small"], ["huge"]]


def test_shard_state_dict_all_in_one_when_limit_is_large() -> None:
    sd = {"a": fp32(10), "b": fp32(15)}
    assert [list(s) for s in shard_state_dict(sd, max_shard_bytes=100)] == [["a", "b"]]
    assert [list(s) for s in shard_state_dict(sd, max_shard_bytes=99)] == [["a"], ["b"]]


def test_shard_state_dict_counts_bytes_by_element_size() -> None:
    sd = {"a": torch.zeros(25, dtype=torch.bfloat16), "b": torch.zeros(25, dtype=torch.bfloat16)}  # 50 B each
    assert [list(s) for s in shard_state_dict(sd, max_shard_bytes=100)] == [["a", "b"]]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
    )


def test_non_float_tensors_keep_their_dtype(tmp_path: Path) -> None:
    sd = {"w": torch.full((2, 2), 1.5), "steps": torch.tensor([3, 4], dtype=torch.int64)}
    write_hf_folder(
        sd,
        tmp_path,
        config=tiny_config(),
        tokenizer=None,
        generation_config=None,
        dtype="bfloat16",
        max_shard_bytes=BIG,
    )
    on_disk = load_file(str(tmp_path / WEIGHTS_NAME))
    assert on_disk["w"].dtype == torch.bfloat16
    assert on_disk["steps"].dtype == torch.int64
    assert on_disk["steps"].tolist() == [3, 4]


def test_non_contiguous_tensor_is_written(tmp_path: Path) -> None:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    write_hf_folder(
        {"t": base.t()},
        tmp_path,
        config=tiny_config(),
        tokenizer=None,
        generation_config=None,
        dtype="float32",
        max_shard_bytes=BIG,
    )
    assert load_file(str(tmp_path / WEIGHTS_NAME))["t"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_bad_dtype_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'int8'"):
        write_hf_folder(
            {"w": fp32(2)},
            tmp_path,
            config=tiny_config(),
            tokenizer=None,
            generation_config=None,
            dtype="int8",
            max_shard_bytes=BIG,
        )
    assert not any(tmp_path.iterdir())


def test_empty_state_dict_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        write_hf_folder(
            {},
            tmp_path,
            config=tiny_config(),
            tokenizer=None,
            generation_config=None,
            dtype="float32",
            max_shard_bytes=BIG,
        )
    assert not any(tmp_path.iterdir())
