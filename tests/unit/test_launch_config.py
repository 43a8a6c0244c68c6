"""The launch's own accelerate config read back: TRL's FSDP1 and FSDP2 configs mapped key by key, each refusal
(a meaning FSDP2 would change) fired by the key that causes it, the ``accelerate launch`` command line found among
the process's ancestors and parsed by accelerate's parser, and a world smaller than asked named with both numbers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_fsdp2.config import parse_config as _parse
from hf_fsdp2.parallel.launch_config import (
    LaunchRequest,
    find_launch_request,
    fsdp_findings,
    parse_launch_command,
    read_accelerate_config,
    request_from_environment,
    world_findings,
)

DATA = Path(__file__).parents[1] / "data" / "accelerate_configs"


def cfg(*argv: str):  # type: ignore[no-untyped-def]
    return _parse(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o", *argv])


def levels(found) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {f.check: f.level for f in found}


def test_trls_fsdp1_config_maps_every_knob_to_its_fsdp2_meaning() -> None:
    found = fsdp_findings(read_accelerate_config(DATA / "trl_fsdp1.yaml"), cfg("--mixed_precision", "bf16"))
    got = levels(found)
    assert got.pop("fsdp_version") == "warning"  # read as FSDP2, with the converter named
    assert set(got.values()) == {"ok"}, found
    for key in (
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_sync_module_states",
        "fsdp_use_orig_params",
        "fsdp_state_dict_type",
        "fsdp_reshard_after_forward",
        "fsdp_auto_wrap_policy",
    ):
        assert key in got, key
    text = "\n".join(f.line() for f in found)
    assert "accelerate to-fsdp2" in text and "fsdp_cpu_ram_efficient_loading" in text
    assert "gather-free, verified safetensors export" in text and "not needed" in text


def test_trls_fsdp2_config_is_all_ok_and_a_recipe_difference_is_a_warning() -> None:
    settings = read_accelerate_config(DATA / "trl_fsdp2.yaml")
    assert set(levels(fsdp_findings(settings, cfg("--mixed_precision", "bf16"))).values()) == {"ok"}
    found = levels(fsdp_findings(settings, cfg("--mixed_precision", "no", "--fsdp_cpu_offload", "true")))
    assert found["mixed_precision"] == "warning" and found["fsdp_offload_params"] == "warning"


@pytest.mark.parametrize(
    ("settings", "argv", "key", "level", "says"),
    [
        ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, (), "fsdp_sharding_strategy", "error",
         "fsdp_reshard_after_forward: false"),
        ({"fsdp_sharding_strategy": 2}, ("--fsdp_reshard_after_forward", "false"), "fsdp_sharding_strategy", "ok", ""),
        ({"fsdp_reshard_after_forward": "HYBRID_SHARD"}, (), "fsdp_reshard_after_forward", "error",
         "dp_replicate_size"),
        ({"fsdp_reshard_after_forward": "HYBRID_SHARD"}, ("--dp_replicate_size", "2"), "fsdp_reshard_after_forward",
         "ok", ""),
        ({"fsdp_sharding_strategy": "NO_SHARD"}, (), "fsdp_sharding_strategy", "error", "always shards"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, (), "fsdp_auto_wrap_policy", "error", "fsdp_layer_cls_to_wrap"),
        ({"fsdp_backward_prefetch": "NO_PREFETCH"}, (), "fsdp_backward_prefetch", "warning", "always prefetches"),
        ({"distributed_type": "MULTI_GPU"}, (), "distributed_type", "error", "fsdp2.yaml"),
        ({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, ("--fsdp_layer_cls_to_wrap", "Other"),
         "fsdp_transformer_layer_cls_to_wrap", "warning", "['Other'] is used"),
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, (), "fsdp_reshard_after_forward", "warning",
         "true is used"),
    ],
)  # fmt: skip
def test_each_key_whose_meaning_would_change_fires(settings, argv, key, level, says) -> None:  # type: ignore[no-untyped-def]
    found = [f for f in fsdp_findings({"distributed_type": "FSDP", **settings}, cfg(*argv)) if f.check == key]
    assert found and found[0].level == level, found
    assert says in found[0].line(), found[0].line()


def test_the_accelerate_launch_command_line_is_parsed_by_accelerates_parser(tmp_path: Path) -> None:
    config = str(DATA / "trl_fsdp1.yaml")
    argv = [
        "/usr/bin/python3",
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config,
        "--num_processes",
        "2",
        "--cpu",
        "recipes/sft.py",
        "--config",
        "r.yaml",
        "--num_processes",
        "9",
    ]
    request = parse_launch_command(argv)
    assert (
        request is not None and request.num_processes == 2 and request.cpu_flag
    )  # the recipe's args are not read
    assert request.settings["fsdp_version"] == 1 and request.source.endswith("trl_fsdp1.yaml")
    request = parse_launch_command(["/venv/bin/accelerate", "launch", "--config_file", config, "train.py"])
    assert request is not None and request.num_processes == 8 and not request.cpu_flag  # the config's 8
    assert (
        parse_launch_command(["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"])
        is None
    )


def test_the_launch_is_found_among_the_ancestors_or_in_accelerates_variables(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    parent, grandparent = os.getppid(), 4242
    for pid, ppid, argv in (
        (parent, grandparent, ["python", "-m", "torch.distributed.run", "x.py"]),
        (
            grandparent,
            1,
            [
                "accelerate",
                "launch",
                "--config_file",
                str(DATA / "trl_fsdp2.yaml"),
                "--num_processes",
                "2",
                "x.py",
            ],
        ),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
        (proc / str(pid) / "stat").write_text(f"{pid} (py thon) S {ppid} 0 0")
    request = find_launch_request({}, proc)
    assert request is not None and request.num_processes == 2 and request.settings["fsdp_version"] == 2
    (proc / str(grandparent) / "cmdline").write_bytes(b"bash\0")
    assert find_launch_request({}, proc) is None
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    request = find_launch_request(env, proc)
    assert request == request_from_environment(env) and request is not None
    assert (
        request.settings["fsdp_backward_prefetch"] == "BACKWARD_PRE"
        and request.settings["mixed_precision"] == "bf16"
    )
    assert request.settings["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"


def test_a_world_smaller_than_asked_names_both_numbers_and_the_cpu_flag() -> None:
    asked = LaunchRequest(
        source="accelerate launch --config_file f.yaml", settings={}, num_processes=2, cpu_flag=True
    )
    (found,) = world_findings(asked, world=1, local_world=1, devices=0, strict=False)
    assert found.level == "warning" and found.value == "1 of 2 asked" and "--cpu" in found.line()
    assert "drop --cpu" in found.fix and "strict_launch: true" in found.fix
    (found,) = world_findings(asked, world=1, local_world=1, devices=0, strict=True)
    assert found.level == "error"
    (found,) = world_findings(
        LaunchRequest(source="x", num_processes=2), world=2, local_world=2, devices=0, strict=True
    )
    assert found.level == "ok"
    (found,) = world_findings(None, world=1, local_world=1, devices=4, strict=False)
    assert found.level == "warning" and "3 GPU(s) on this node are idle" in found.message
    assert world_findings(None, world=4, local_world=4, devices=4, strict=True) == []
