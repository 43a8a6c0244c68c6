"""Bad input to the commands is one line naming the file, the problem and the fix, exit status 2, never a
traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.parse import load_yaml


def test_a_binary_or_invalid_recipe_yaml_is_named(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xb4\x00")
    with pytest.raises(ConfigError, match=rf"--config {binary} is not a text file \(byte 0: not UTF-8\)"):
        load_yaml(binary)
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1e-5\nmax_length: [64\n  seed: : 1\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(bad)
    assert str(err.value).startswith(f"--config {bad} is not valid YAML at line 3") and "\n" not in str(
        err.value
    )


def _one_line(capsys: pytest.CaptureFixture[str], status: int, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"hf-fsdp2 {command}: error:")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_eval_commands_on_a_missing_folder_are_one_line(tmp_path: Path, capsys) -> None:
    from hf_fsdp2.cli import main

    records = tmp_path / "e.jsonl"
    records.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n')
    line = _one_line(capsys, main(["eval-task", str(tmp_path / "missing"), str(records)]), "eval-task")
    assert str(tmp_path / "missing") in line and "no such folder" in line
    line = _one_line(
        capsys, main(["eval-preference", str(tmp_path / "missing"), str(records)]), "eval-preference"
    )
    assert str(tmp_path / "missing") in line and "no such folder" in line
    line = _one_line(capsys, main(["eval-task", str(tmp_path), str(tmp_path / "none.jsonl")]), "eval-task")
    assert "none.jsonl" in line


def test_plan_with_a_binary_config_is_one_line(tmp_path: Path, capsys) -> None:
    from hf_fsdp2.cli import main

    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(bytes(range(128, 256)))
    line = _one_line(capsys, main(["plan", "--config", str(binary)]), "plan")
    assert f"--config {binary} is not a text file" in line


def test_export_of_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path: Path, capsys) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from hf_fsdp2.checkpoint.layout import CONFIG_FILE, STATE_FILE, TrainerState
    from hf_fsdp2.cli import main

    def checkpoint(name: str) -> Path:
        path = tmp_path / name
        dcp.save({"model": {"w": torch.zeros(4096)}}, checkpoint_id=str(path))
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

    bad_yaml = checkpoint("yaml")
    (bad_yaml / CONFIG_FILE).write_text("model_name_or_path: [unclosed\n  x: : :\n")
    line = _one_line(capsys, main(["export", str(bad_yaml), str(tmp_path / "o1")]), "export")
    assert "hf_fsdp2_config.yaml is not valid YAML (line 2" in line and "Restore the file" in line
    bad_index = checkpoint("index")
    (bad_index / ".metadata").write_bytes((bad_index / ".metadata").read_bytes()[:50])
    line = _one_line(capsys, main(["export", str(bad_index), str(tmp_path / "o2")]), "export")
    assert ".metadata cannot be read (UnpicklingError" in line
    short = checkpoint("short")
    shard = next(short.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    line = _one_line(capsys, main(["export", str(short), str(tmp_path / "o3")]), "export")
    assert f"{shard.name} is 100 bytes" in line and "truncated" in line
