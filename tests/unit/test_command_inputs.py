"""What the commands that take a model, an export or a data file do with a bad one:
one line naming the path, the problem and the fix, exit status 2, before anything loads, never a traceback or
a wait on hub retries; ``hf-fsdp2 push`` (dry run or not) refuses a folder that is not a verified export."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from support.tiny import make_tiny_llama_dir, write_pairs_jsonl

from hf_fsdp2.cli import main

RECORD_NAME = ".hf_fsdp2_export.json"  # hf_fsdp2.export.folder.RECORD_NAME (imported where the tests need it)


def one_line(capsys: pytest.CaptureFixture[str], status: int, command: str) -> str:
    """The command's single error line (exit 2, no traceback, nothing else on stderr but log lines)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"hf-fsdp2 {command}: error:")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # an empty cache
    monkeypatch.chdir(tmp_path)


def checkpoint(path: Path) -> Path:
    """A training checkpoint folder as hf_fsdp2 writes it: DCP shards and .metadata, trainer state, config."""
    import torch.distributed.checkpoint as dcp

    from hf_fsdp2.checkpoint.layout import CONFIG_FILE, STATE_FILE, TrainerState

    dcp.save({"model": {"w": torch.zeros(8)}}, checkpoint_id=str(path))
    (path / STATE_FILE).write_text(
        TrainerState(
            step=2,
            epoch=0,
            batches_in_epoch=2,
            world_size=1,
            scheduler={},
            per_device_train_batch_size=1,
            gradient_accumulation_steps=1,
        ).to_json()
    )
    (path / CONFIG_FILE).write_text("seed: 1\n")
    return path


# ---------------------------------------------------------------------------------------------------
# One check of every model argument
# ---------------------------------------------------------------------------------------------------

MODEL_COMMANDS = {
    "eval-task": lambda model, data: ["eval-task", model, data],
    "eval-preference": lambda model, data: ["eval-preference", model, data],
    "score": lambda model, data: ["score", "--model", model, "--data", data],
}


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_a_missing_model_folder_is_one_line_at_once_offline(
    command: str, offline: None, tmp_path: Path, capsys
) -> None:
    """A bare missing name was taken for a hub id: with HF_HUB_OFFLINE=1 ~100 lines and 3 tracebacks (54 s of
    retries online)."""
    data = write_pairs_jsonl(tmp_path / "pairs.jsonl", 2)
    start = time.perf_counter()
    line = one_line(capsys, main(MODEL_COMMANDS[command]("missing_model", str(data))), command)
    assert time.perf_counter() - start < 5
    assert "missing_model: no such folder" in line and "config.json" in line


def test_a_hub_id_offline_and_not_cached_is_one_line(offline: None, tmp_path: Path, capsys) -> None:
    data = write_pairs_jsonl(tmp_path / "pairs.jsonl", 2)
    line = one_line(capsys, main(["eval-preference", "some-org/some-model", str(data)]), "eval-preference")
    assert (
        "some-org/some-model: no such folder, and HF_HUB_OFFLINE=1" in line and "unset HF_HUB_OFFLINE" in line
    )
    line = one_line(capsys, main(["score", "--model", "some-org/some-model", "--data", str(data)]), "score")
    assert "HF_HUB_OFFLINE=1" in line


def test_a_hub_id_goes_to_the_hub_when_online_or_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    from hf_fsdp2.commands.common import BadInput, model_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert model_path("some-org/some-model", what="MODEL_DIR") == "some-org/some-model"
    with pytest.raises(BadInput, match="no such folder"):  # a command that reads folders only
        model_path("some-org/some-model", what="MODEL_DIR", hub=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    snapshot = tmp_path / "cache" / "models--some-org--some-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    assert (
        model_path("some-org/some-model", what="MODEL_DIR") == "some-org/some-model"
    )  # cached: loads offline


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
def test_a_checkpoint_given_for_a_model_says_how_to_export_it(command: str, tmp_path: Path, capsys) -> None:
    data = write_pairs_jsonl(tmp_path / "pairs.jsonl", 2)
    ckpt = checkpoint(tmp_path / "run" / "checkpoint-2")
    line = one_line(capsys, main(MODEL_COMMANDS[command](str(ckpt), str(data))), command)
    assert f"{ckpt} is a training checkpoint" in line and f"`hf-fsdp2 export {ckpt} OUT_DIR`" in line
    checkpoint(tmp_path / "run" / "checkpoint-10")
    line = one_line(capsys, main(MODEL_COMMANDS[command](str(tmp_path / "run"), str(data))), command)
    assert "holds checkpoints but no export" in line
    assert f"`hf-fsdp2 export {tmp_path / 'run' / 'checkpoint-10'} OUT_DIR`" in line


def test_merge_adapter_checks_its_folders_as_the_other_commands(
    offline: None, tmp_path: Path, capsys
) -> None:
    ckpt = checkpoint(tmp_path / "checkpoint-3")
    line = one_line(capsys, main(["merge-adapter", str(ckpt), str(tmp_path / "out")]), "merge-adapter")
    assert "no adapter_config.json" in line and f"`hf-fsdp2 export {ckpt} OUT_DIR`" in line
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": "gone"})
    )
    line = one_line(capsys, main(["merge-adapter", str(adapter), str(tmp_path / "out")]), "merge-adapter")
    assert "the base model gone: no such folder" in line


# ---------------------------------------------------------------------------------------------------
# Damaged model folders, data files and adapters
# ---------------------------------------------------------------------------------------------------


def test_score_on_a_garbled_model_folder_is_one_line_naming_the_file(
    tiny: Path, tmp_path: Path, capsys
) -> None:
    import shutil

    data = write_pairs_jsonl(tmp_path / "pairs.jsonl", 2)
    config = shutil.copytree(tiny, tmp_path / "config")
    (config / "config.json").write_bytes(os.urandom(200))
    line = one_line(capsys, main(["score", "--model", str(config), "--data", str(data)]), "score")
    assert f"{config / 'config.json'} is not" in line and "restore the file" in line
    weights = shutil.copytree(tiny, tmp_path / "weights")
    (weights / "model.safetensors").write_bytes(os.urandom(5000))
    line = one_line(capsys, main(["score", "--model", str(weights), "--data", str(data)]), "score")
    assert f"{weights / 'model.safetensors'} is not a safetensors file" in line
    short = shutil.copytree(tiny, tmp_path / "short")
    (short / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes()[:-100])
    line = one_line(capsys, main(["score", "--model", str(short), "--data", str(data)]), "score")
    assert "truncated" in line and "model.safetensors" in line
    tokenizer = shutil.copytree(tiny, tmp_path / "tokenizer")
    (tokenizer / "tokenizer.json").write_bytes(os.urandom(3000))
    line = one_line(capsys, main(["score", "--model", str(tokenizer), "--data", str(data)]), "score")
    assert f"{tokenizer / 'tokenizer.json'} is not a text file" in line


def test_score_on_a_bad_data_file_is_one_line_naming_the_file(tiny: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": oops}\n')
    line = one_line(capsys, main(["score", "--model", str(tiny), "--data", str(bad)]), "score")
    assert f"{bad}:2 is not valid JSON" in line
    binary = tmp_path / "random.jsonl"
    binary.write_bytes(b"\x8b\x1f" + os.urandom(300))
    line = one_line(capsys, main(["score", "--model", str(tiny), "--data", str(binary)]), "score")
    assert f"--data {binary} is not a text file" in line
    line = one_line(capsys, main(["eval-preference", str(tiny), str(binary)]), "eval-preference")
    assert str(binary) in line


def _adapter(tiny: Path, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    model.save_pretrained(out)
    return out


def test_merge_adapter_with_a_bad_config_or_damaged_weights_is_one_line(
    tiny: Path, tmp_path: Path, capsys
) -> None:
    from safetensors.torch import load_file, save_file

    bad_config = _adapter(tiny, tmp_path / "config")
    (bad_config / "adapter_config.json").write_text('{"peft_type": "LORA", ')
    line = one_line(capsys, main(["merge-adapter", str(bad_config), str(tmp_path / "o1")]), "merge-adapter")
    assert f"{bad_config / 'adapter_config.json'} is not valid JSON" in line and "restore it" in line
    nan = _adapter(tiny, tmp_path / "nan")
    weights = nan / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights)
    line = one_line(capsys, main(["merge-adapter", str(nan), str(tmp_path / "o2")]), "merge-adapter")
    assert f"{weights} holds NaN or inf in 1 tensor(s)" in line and "differ" not in line
    random = _adapter(tiny, tmp_path / "random")
    (random / "adapter_model.safetensors").write_bytes(os.urandom(3000))
    line = one_line(capsys, main(["merge-adapter", str(random), str(tmp_path / "o3")]), "merge-adapter")
    assert "adapter_model.safetensors is not a safetensors file" in line
    assert (
        not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    )


# ---------------------------------------------------------------------------------------------------
# The push checks what it uploads, dry run or not
# ---------------------------------------------------------------------------------------------------


def test_push_dry_run_refuses_a_corrupt_export(tiny: Path, tmp_path: Path, capsys, caplog) -> None:
    import shutil

    corrupt = shutil.copytree(tiny, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(os.urandom(300_000))
    (corrupt / "config.json").write_text('{"model_type": "llama",')
    line = one_line(capsys, main(["push", str(corrupt), "me/tiny", "--dry-run"]), "push")
    assert f"{corrupt} is not a verified export" in line and "Nothing was uploaded" in line
    assert f"{corrupt / 'config.json'} is not valid JSON" in line
    assert f"{corrupt / 'model.safetensors'} is not a safetensors file" in line and "--force" in line
    # Forced: the dry run lists the files and says what is wrong.
    assert main(["push", str(corrupt), "me/tiny", "--dry-run", "--force"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["verified_export"] is False
    assert "would upload model.safetensors (300000 bytes)" in err
    warned = [r.getMessage() for r in caplog.records if "pushing anyway (--force)" in r.getMessage()]
    assert len(warned) == 2 and "config.json is not valid JSON" in warned[0]


def test_push_refuses_a_folder_with_no_record_of_verification(tiny: Path, tmp_path: Path, capsys) -> None:
    import shutil

    from hf_fsdp2.export.folder import write_record

    folder = shutil.copytree(tiny, tmp_path / "hand-made")  # sound files, but nothing verified them
    line = one_line(capsys, main(["push", str(folder), "me/tiny", "--dry-run"]), "push")
    assert f"has no record of a verified export ({RECORD_NAME}" in line
    write_record(folder, verified="verified: ...")
    assert main(["push", str(folder), "me/tiny", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["verified_export"] is True and RECORD_NAME not in out["paths"]  # the record is not uploaded
    shutil.copy(tiny / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    line = one_line(capsys, main(["push", str(folder), "me/tiny", "--dry-run"]), "push")
    assert "model-00001-of-00002.safetensors is not part of the verified export" in line
    ckpt = checkpoint(tmp_path / "checkpoint-4")
    line = one_line(capsys, main(["push", str(ckpt), "me/tiny", "--dry-run"]), "push")
    assert f"`hf-fsdp2 export {ckpt} OUT_DIR`" in line


def test_an_export_records_its_verification_and_push_checks_it(tiny: Path, tmp_path: Path, capsys) -> None:
    from hf_fsdp2.export import export_model
    from hf_fsdp2.model import load_model, load_tokenizer

    model, tokenizer = load_model(str(tiny)), load_tokenizer(str(tiny))

    def export(out: Path, verify: bool) -> Path:
        export_model(
            model,
            out,
            config=model.config,
            tokenizer=tokenizer,
            generation_config=None,
            dtype="float32",
            max_shard_bytes=10**9,
            verify=verify,
        )
        return out

    verified = export(tmp_path / "verified", True)
    assert json.loads((verified / RECORD_NAME).read_text())["verified"].startswith("verified:")
    assert main(["push", str(verified), "me/tiny", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["verified_export"] is True
    # A weights file replaced after the export (another size) is no longer the verified one.
    (verified / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes()[:-8] + b"\0" * 4)
    line = one_line(capsys, main(["push", str(verified), "me/tiny", "--dry-run"]), "push")
    assert "model.safetensors is" in line
    unverified = export(tmp_path / "unverified", False)
    line = one_line(capsys, main(["push", str(unverified), "me/tiny", "--dry-run"]), "push")
    assert "exported without verification (--no-verify or export_verify=false)" in line
