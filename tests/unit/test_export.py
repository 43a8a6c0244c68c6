"""Unit tests for hf_fsdp2.export in one process: the folder from_pretrained must load, the file
layout, the assembly of per-rank parts, verification, and the offline export's errors.

The 2-rank (gather-free) path is tested in tests/distributed/test_export_2rank.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.tiny import make_tiny_llama_dir
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

import hf_fsdp2.export.writer as writer_module
from hf_fsdp2.export import (
    STAGE_NAME,
    ExportError,
    ExportVerificationError,
    check_export_dir,
    checkpoint_layout,
    export_model,
    load_checkpoint_model,
    probe_limit,
    tied_targets,
    verify_export,
)
from hf_fsdp2.export.files import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Chunk,
    _write_tensor,
    assemble_file,
    file_names,
    index_parts,
    plan_files,
    read_header,
    read_slice,
)
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


def export(tiny: Tiny, out: Path, *, dtype: str = "float32", max_shard_bytes: int = BIG, **kwargs: object):
    kwargs.setdefault("tokenizer", tiny.tokenizer)
    kwargs.setdefault("generation_config", None)
    kwargs.setdefault("verify", False)  # verification has its own tests (it starts a Python process)
    return export_model(
        tiny.model, out, config=tiny.model.config, dtype=dtype, max_shard_bytes=max_shard_bytes, **kwargs
    )


def weight_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------
# The folder from_pretrained loads
# ---------------------------------------------------------------------------------------------------


def test_fp32_export_reloads_with_identical_weights_and_is_verified(untied: Tiny, tmp_path: Path) -> None:
    out = tmp_path / "export"
    result = export(untied, out, verify=True)
    assert result.files == [WEIGHTS_NAME] and weight_files(out) == [WEIGHTS_NAME]
    assert not (out / INDEX_NAME).exists() and not (out / STAGE_NAME).exists()
    assert result.verify is not None and result.verify.ok
    assert result.verify.tensors == len(untied.state_dict)
    assert result.verify.max_logit_diff <= result.verify.atol
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.float32
    got = reloaded.state_dict()
    assert set(got) == set(untied.state_dict)
    for key, want in untied.state_dict.items():
        torch.testing.assert_close(got[key], want, rtol=0, atol=0, msg=key)
    assert "lm_head.weight" in load_file(str(out / WEIGHTS_NAME))  # untied: its own tensor


def test_files_carry_pt_format_metadata_and_8_byte_aligned_headers(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="bfloat16")
    with safe_open(str(tmp_path / WEIGHTS_NAME), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses files without it
    header_len = int.from_bytes((tmp_path / WEIGHTS_NAME).read_bytes()[:8], "little")
    assert header_len % 8 == 0


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_low_precision_export_equals_the_cast(untied: Tiny, tmp_path: Path, dtype: str, torch_dtype) -> None:
    export(untied, tmp_path, dtype=dtype)
    on_disk = load_file(str(tmp_path / WEIGHTS_NAME))
    for key, want in untied.state_dict.items():
        assert on_disk[key].dtype == torch_dtype
        assert torch.equal(on_disk[key], want.to(torch_dtype)), key
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == dtype
    # The cast really rounds: the export is not the fp32 weights.
    weight = untied.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(weight.to(torch.bfloat16).float(), weight)


def test_training_dtype_keeps_the_weights_dtype(untied: Tiny, tmp_path: Path) -> None:
    result = export(untied, tmp_path, dtype="training")
    assert result.dtype == "float32"
    assert {t.dtype for t in load_file(str(tmp_path / WEIGHTS_NAME)).values()} == {torch.float32}


def test_unknown_dtype_is_refused(untied: Tiny, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="'int8'"):
        export(untied, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_config_generation_config_tokenizer_and_card(untied: Tiny, tmp_path: Path) -> None:
    assert untied.model.config.use_cache is False  # the training model
    export(untied, tmp_path, dtype="bfloat16", model_card="---\nlibrary_name: transformers\n---\n# card\n")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and saved["use_cache"] is True
    assert saved["architectures"] == ["LlamaForCausalLM"]
    assert untied.model.config.use_cache is False and untied.model.config.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template == untied.tokenizer.chat_template
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.encode("alpha bravo") == untied.tokenizer.encode("alpha bravo")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    assert (tmp_path / "README.md").read_text().startswith("---\nlibrary_name: transformers")


# ---------------------------------------------------------------------------------------------------
# Sharded output, tied embeddings, checkpoint names
# ---------------------------------------------------------------------------------------------------


def test_small_max_shard_size_gives_a_correct_index(untied: Tiny, tmp_path: Path) -> None:
    limit = 100_000
    result = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=limit)
    n = len(result.files)
    assert n > 2 and result.files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert weight_files(tmp_path) == result.files
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    sizes = {k: v.numel() * 2 for k, v in untied.state_dict.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values()) == result.total_bytes
    assert set(index["weight_map"]) == set(untied.state_dict)
    for name in result.files:
        keys = [k for k, f in index["weight_map"].items() if f == name]
        with safe_open(str(tmp_path / name), "pt") as f:
            assert sorted(f.keys()) == sorted(keys)
        # Each file is under the limit unless it holds a single larger tensor.
        assert sum(sizes[k] for k in keys) <= limit or len(keys) == 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for key, want in untied.state_dict.items():
        assert torch.equal(reloaded.state_dict()[key], want.to(torch.bfloat16).float()), key


def test_tied_embeddings_are_written_once_and_tied_on_reload(tied: Tiny, tmp_path: Path) -> None:
    assert tied_targets(tied.model) == {"lm_head.weight"}
    result = export(tied, tmp_path, dtype="float32", max_shard_bytes=150_000, verify=True)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert result.verify is not None and result.verify.ok
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.lm_head.weight, tied.state_dict["model.embed_tokens.weight"])


def test_untied_model_has_no_tied_targets(untied: Tiny) -> None:
    assert tied_targets(untied.model) == set()


@pytest.fixture(scope="module")
def neox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-NeoX: its checkpoints call the output head ``embed_out``, its module ``lm_head``."""
    path = tmp_path_factory.mktemp("neox") / "model"
    tokenizer = load_tokenizer(str(make_tiny_llama_dir(path.parent / "tok", seed=3)))
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    GPTNeoXForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_checkpoint_names_differ_from_module_names_and_round_trip(neox: Path, tmp_path: Path) -> None:
    with safe_open(str(neox / WEIGHTS_NAME), "pt") as f:
        assert "embed_out.weight" in f.keys()  # noqa: SIM118 (safe_open has no __contains__) - transformers' own save uses the checkpoint name
    model = load_model(str(neox))
    assert "lm_head.weight" in model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = checkpoint_layout(model, shapes).renames
    assert names["lm_head.weight"] == "embed_out.weight"
    assert sum(k != v for k, v in names.items()) == 1
    result = export_model(
        model,
        tmp_path,
        config=model.config,
        tokenizer=None,
        generation_config=None,
        dtype="float32",
        max_shard_bytes=BIG,
    )
    assert result.verify is not None and result.verify.ok  # the reload maps embed_out back to lm_head
    on_disk = load_file(str(tmp_path / WEIGHTS_NAME))
    assert "embed_out.weight" in on_disk and "lm_head.weight" not in on_disk
    assert torch.equal(on_disk["embed_out.weight"], model.state_dict()["lm_head.weight"])


# ---------------------------------------------------------------------------------------------------
# Re-export into the same folder, staging, refusing a non-empty folder
# ---------------------------------------------------------------------------------------------------


def test_reexport_with_fewer_shards_removes_stale_files(untied: Tiny, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a run file that is not the export's
    many = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=50_000).files
    fewer = export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=200_000).files
    assert 1 < len(fewer) < len(many)
    assert weight_files(tmp_path) == fewer
    assert set(json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"].values()) == set(fewer)
    assert export(untied, tmp_path, dtype="bfloat16").files == [WEIGHTS_NAME]
    assert weight_files(tmp_path) == [WEIGHTS_NAME] and not (tmp_path / INDEX_NAME).exists()
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"
    AutoModelForCausalLM.from_pretrained(tmp_path)  # no stale index pointing at removed shards


def test_leftover_staging_folder_of_a_crashed_export_is_replaced(untied: Tiny, tmp_path: Path) -> None:
    stage = tmp_path / STAGE_NAME
    stage.mkdir()
    (stage / "model-00001-of-00009.safetensors").write_bytes(b"half written")
    export(untied, tmp_path)
    assert not stage.exists()
    assert weight_files(tmp_path) == [WEIGHTS_NAME]


def test_check_export_dir(tmp_path: Path) -> None:
    check_export_dir(tmp_path / "new", overwrite=False)
    check_export_dir(tmp_path, overwrite=False)  # empty
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        check_export_dir(tmp_path, overwrite=False)
    check_export_dir(tmp_path, overwrite=True)
    with pytest.raises(ExportError, match="is a file"):
        check_export_dir(tmp_path / "config.json", overwrite=True)


# ---------------------------------------------------------------------------------------------------
# Verification catches what is wrong, and nothing is published then
# ---------------------------------------------------------------------------------------------------


def flip_bytes(path: Path, key: str, count: int = 16) -> None:
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]
    raw[start : start + count] = bytes(b ^ 0xFF for b in raw[start : start + count])
    path.write_bytes(bytes(raw))


def test_verification_catches_a_corrupted_shard(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=200_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    flip_bytes(tmp_path / index["model.layers.1.mlp.down_proj.weight"], "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ExportVerificationError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: the bytes"):
        verify_export(untied.model, tmp_path, dtype="bfloat16")


def test_verification_catches_a_truncated_file_and_a_wrong_index(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="bfloat16", max_shard_bytes=200_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    data = (tmp_path / first).read_bytes()
    (tmp_path / first).write_bytes(data[:-10])
    key = next(k for k, v in index["weight_map"].items() if v != first)
    index["weight_map"][key] = first
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ExportVerificationError) as err:
        verify_export(untied.model, tmp_path, dtype="bfloat16")
    assert f"{first} is {len(data) - 10} bytes, its header says {len(data)}" in str(err.value)
    assert "does not match the files" in str(err.value)


def test_verification_catches_a_config_that_changes_the_model(untied: Tiny, tmp_path: Path) -> None:
    export(untied, tmp_path, dtype="float32")
    config = json.loads((tmp_path / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # same tensors, another function
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ExportVerificationError, match="config.json differs from the live config: .*rms_norm_eps"
    ):
        verify_export(untied.model, tmp_path, dtype="float32")


def test_a_failed_verification_publishes_nothing(untied: Tiny, tmp_path: Path, monkeypatch) -> None:
    export(untied, tmp_path, dtype="float32")  # an earlier, good export
    before = (tmp_path / WEIGHTS_NAME).read_bytes()
    write_metadata = writer_module._write_metadata

    def write_then_corrupt(plan, stage, **kwargs):
        write_metadata(plan, stage, **kwargs)
        flip_bytes(stage / WEIGHTS_NAME, "model.norm.weight")

    monkeypatch.setattr(writer_module, "_write_metadata", write_then_corrupt)
    with pytest.raises(ExportVerificationError, match="Nothing was published"):
        export(untied, tmp_path, dtype="bfloat16", verify=True)
    assert (tmp_path / WEIGHTS_NAME).read_bytes() == before  # the earlier export is untouched
    assert (tmp_path / STAGE_NAME / WEIGHTS_NAME).is_file()  # the rejected files, kept to inspect


def test_verification_streams_a_model_larger_than_its_ram_budget_from_disk(
    untied: Tiny, tmp_path: Path
) -> None:
    export(untied, tmp_path / "export", dtype="bfloat16")
    small = verify_export(untied.model, tmp_path / "export", dtype="bfloat16", reload_ram_bytes=500_000)
    assert small.ok and "disk" in small.reload_devices  # 8 MB of fp32 weights, 0.5 MB in RAM
    whole = verify_export(untied.model, tmp_path / "export", dtype="bfloat16")
    assert whole.reload_devices == ["cpu"]
    assert small.max_logit_diff == whole.max_logit_diff  # the same numbers, streamed or not
    assert not (tmp_path / "export.verify-offload").exists()  # the offload folder is removed


def test_probe_limit_is_relative_to_the_logit_scale_and_the_compute_dtype() -> None:
    assert probe_limit(torch.float32, 30.0) == pytest.approx(0.03)
    assert probe_limit(torch.float32, 0.2) == pytest.approx(1e-3)  # scale at least 1
    assert probe_limit(torch.bfloat16, 30.0) == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------------------
# File layout and assembly from per-rank parts
# ---------------------------------------------------------------------------------------------------


def test_plan_files_greedy_split_by_hand() -> None:
    sizes = {"a": 40, "b": 60, "c": 200, "d": 20, "e": 20}
    # a+b = 100 fits exactly; c (200 B) is over the limit and alone; d+e = 40.
    assert plan_files(sizes, 100) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_files({"big": 400, "small": 4, "huge": 4000}, 10) == [["big"], ["small"], ["huge"]]
    assert plan_files({"a": 40, "b": 60}, 99) == [["a"], ["b"]]
    assert plan_files({"a": 40, "b": 60}, 100) == [["a", "b"]]


def test_file_names() -> None:
    assert file_names(1) == [WEIGHTS_NAME]
    assert file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def write_part(path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> None:
    """A part file as DCP's HuggingFaceStorageWriter writes it: chunks tagged with their offsets."""
    info = {k: {"saved_offsets": v} for k, v in offsets.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "DCP_SHARDING_INFO": json.dumps(info)})


def test_assemble_row_and_column_chunks_and_an_int_tensor(tmp_path: Path) -> None:
    rows = torch.arange(35, dtype=torch.float32).reshape(7, 5).to(torch.bfloat16)
    cols = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    steps = torch.tensor([3, 1, 4], dtype=torch.int64)
    scalar = torch.tensor(2.5)
    parts = tmp_path / "parts"
    parts.mkdir()
    # Rank 0: rows 0-3 and columns 0-1; rank 1: rows 4-6, columns 2-3, and the unsharded tensors.
    write_part(
        parts / "r0.safetensors",
        {"rows": rows[:4], "cols": cols[:, :2].contiguous()},
        {"rows": [0, 0], "cols": [0, 0]},
    )
    write_part(
        parts / "r1.safetensors",
        {"rows": rows[4:], "cols": cols[:, 2:].contiguous(), "steps": steps, "scalar": scalar},
        {"rows": [4, 0], "cols": [0, 2], "steps": [0], "scalar": []},
    )
    chunks = index_parts(parts)
    shapes = {"rows": (7, 5), "cols": (3, 4), "steps": (3,), "scalar": ()}
    dtypes = {"rows": torch.bfloat16, "cols": torch.float32, "steps": torch.int64, "scalar": torch.float32}
    assemble_file(tmp_path / "out.safetensors", list(shapes), shapes, dtypes, chunks)
    got = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(got["rows"], rows) and torch.equal(got["cols"], cols)
    assert torch.equal(got["steps"], steps) and torch.equal(got["scalar"], scalar)


def test_read_slice_rows_and_columns(tmp_path: Path) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    save_file({"a": torch.zeros(3), "w": full}, str(tmp_path / "f.safetensors"))
    header, start = read_header(tmp_path / "f.safetensors")
    rows = (slice(1, 3), slice(0, 6))  # a dim-0 shard: one plain read
    cols = (slice(0, 4), slice(2, 5))  # a column shard: through safetensors
    for where in (rows, cols):
        got = read_slice(tmp_path / "f.safetensors", header, start, "w", where)
        assert torch.equal(got, full[where]), where


def test_assemble_refuses_a_missing_shard(tmp_path: Path) -> None:
    rows = torch.zeros(6, 2)
    write_part(tmp_path / "r0.safetensors", {"w": rows[:3]}, {"w": [0, 0]})  # rank 1 never wrote rows 3-5
    chunks = index_parts(tmp_path)
    with open(tmp_path / "out", "wb") as dst, pytest.raises(ExportError, match="hold 6 of its 12 elements"):
        _write_tensor("w", (6, 2), "F32", chunks["w"], dst)


def test_assemble_refuses_shards_that_do_not_tile(tmp_path: Path) -> None:
    chunk = Chunk(path=tmp_path / "x", start=0, offsets=[2, 0], shape=[2, 2], dtype="F32")
    other = Chunk(
        path=tmp_path / "x", start=0, offsets=[2, 0], shape=[2, 2], dtype="F32"
    )  # both claim rows 2-3, none rows 0-1
    with open(tmp_path / "out", "wb") as dst, pytest.raises(ExportError, match="do not tile"):
        _write_tensor("w", (4, 2), "F32", [chunk, other], dst)


# ---------------------------------------------------------------------------------------------------
# Offline export: errors on a bad checkpoint (the happy path runs in tests/distributed/test_export_2rank.py)
# ---------------------------------------------------------------------------------------------------


def fake_checkpoint(tmp_path: Path, model_dir: Path, state: dict[str, torch.Tensor]) -> Path:
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that one process is saving
        dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3}))
    (ckpt / "hf_fsdp2_config.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(model_dir)}))
    return ckpt


@pytest.mark.parametrize("missing", ["trainer_state.json", ".metadata", "hf_fsdp2_config.yaml"])
def test_incomplete_checkpoint_is_a_clear_error(untied: Tiny, tmp_path: Path, missing: str) -> None:
    ckpt = fake_checkpoint(tmp_path, untied.path, untied.state_dict)
    (ckpt / missing).unlink()
    with pytest.raises(ExportError, match=rf"is incomplete \(no {missing}\)"):
        load_checkpoint_model(ckpt)


def test_checkpoint_of_another_model_is_a_clear_error(untied: Tiny, tied: Tiny, tmp_path: Path) -> None:
    other = make_tiny_llama_dir(tmp_path / "wide", seed=3, layers=3)
    ckpt = fake_checkpoint(tmp_path, other, untied.state_dict)  # names a 3-layer model, holds 2 layers
    with pytest.raises(ExportError) as err:
        load_checkpoint_model(ckpt)
    message = str(err.value)
    assert "does not hold weights of" in message and str(other) in message
    assert "the model has 9 tensors the checkpoint lacks" in message


def test_checkpoint_loads_into_the_named_model(tied: Tiny, tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path, tied.path, tied.state_dict)
    model, cfg, step = load_checkpoint_model(ckpt)
    assert step == 3 and cfg["model_name_or_path"] == str(tied.path)
    for key, want in tied.state_dict.items():
        assert torch.equal(model.state_dict()[key], want), key
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again after loading
