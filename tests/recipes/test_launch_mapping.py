"""TRL's own accelerate configs (tests/data/accelerate_configs, copied from TRL 1.16) under ``accelerate launch``: the
FSDP1 config trains on 2 processes with every FSDP1 key's FSDP2 meaning in one log block; the FSDP2 config the
same; and ``--cpu``, with which accelerate's launcher starts one process for an FSDP config, is named with both
numbers (refused under ``strict_launch: true``, before any work)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.launch import SFT, accelerate_launch
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics

CONFIGS = "tests/data/accelerate_configs"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("launch")
    return make_tiny_llama_dir(root / "model", seed=5), write_chat_jsonl(root / "chat.jsonl", 16, seed=3)


def _args(assets: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    model, data = assets
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--export_verify",
        "false",
        *extra,
    ]


@pytest.mark.parametrize("name", ["trl_fsdp1.yaml", "trl_fsdp2.yaml"])
def test_trls_config_launches_two_processes_with_each_key_read_as_fsdp2(
    assets, tmp_path: Path, name: str
) -> None:
    # TRL's configs ask for 8 processes: 2 here, as a user of a 2-GPU node would ask.
    proc = accelerate_launch(
        f"{CONFIGS}/{name}", SFT, _args(assets, tmp_path / "run"), launcher_args=["--num_processes", "2"]
    )
    log = proc.stdout + proc.stderr
    assert "accelerate launch read as FSDP2 (accelerate launch --config_file" in log and name in log, log[
        -4000:
    ]
    assert "world size 2" in log and "warning world size" not in log
    keys = [
        "fsdp_reshard_after_forward",
        "fsdp_state_dict_type",
        "fsdp_auto_wrap_policy",
        "mixed_precision: bf16",
    ]
    if name == "trl_fsdp1.yaml":
        keys += [
            "fsdp_version: 1",
            "fsdp_backward_prefetch: BACKWARD_PRE",
            "fsdp_sync_module_states: True",
            "fsdp_use_orig_params: True",
            "fsdp_forward_prefetch: True",
        ]
    missing = [k for k in keys if k not in log]
    assert not missing, (missing, log[-4000:])
    assert "the recipe's mixed_precision: no is used" in log  # the config's bf16, the recipe's no
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_accelerates_cpu_flag_gives_one_process_named_with_both_numbers(assets, tmp_path: Path) -> None:
    """``accelerate launch --cpu`` with an FSDP config runs accelerate's single-process launcher: asked 2, got 1.
    Refused under ``strict_launch: true`` before the folder is written."""
    config = f"{CONFIGS}/trl_fsdp1.yaml"
    args = _args(assets, tmp_path / "run", "--strict_launch", "true")
    proc = accelerate_launch(config, SFT, args, launcher_args=["--num_processes", "2", "--cpu"], check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "world size: 1 of 2 asked" in log and "drop --cpu" in log, log[-4000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
