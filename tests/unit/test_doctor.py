"""``hf-fsdp2 doctor``: a clean recipe and accelerate config give all ok (exit 0); each finding fires from the
config, environment variable or version string that causes it; TRL's FSDP1 and FSDP2 configs run through it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.cli import main as cli
from hf_fsdp2.doctor import environment, recipe, run_doctor
from hf_fsdp2.launch import packaged_accelerate_config
from hf_fsdp2.methods import get_method

DATA = Path(__file__).parents[1] / "data" / "accelerate_configs"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("doctor") / "model", seed=3)


@pytest.fixture
def clean(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A recipe that can run: a local model, SFT data, a new output folder; no known bug in the installed versions."""
    monkeypatch.setattr(environment, "known_issues", lambda: [])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(8)))
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_length",
        "64",
        "--save_total_limit",
        "2",
    ]


def levels(report, section: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    name = next(k for k in report.sections if k.startswith(section))
    return {f.check: f.level for f in report.sections[name]}


def test_a_clean_recipe_and_config_give_all_ok_and_exit_0(clean, capsys) -> None:  # type: ignore[no-untyped-def]
    report = run_doctor(clean, packaged_accelerate_config("fsdp2_cpu.yaml"), environ={})
    assert report.errors == 0 and report.warnings == 0, report.text()
    found = levels(report, "recipe")
    assert {"memory plan", "wrap", "disk", "output_dir", "data"} <= set(found), found
    assert "prompt_completion records, 8 of the first 50 tokenized" in report.text()
    assert (
        cli(["doctor", "--accelerate_config", str(DATA / "trl_fsdp2.yaml"), "--json", *clean]) == 0
    )  # use_cpu: false on a machine without a GPU: a warning, no error
    out = json.loads(capsys.readouterr().out)
    assert out["errors"] == 0 and out["warnings"] == 1 and "cuda" in str(out["sections"]["environment"])
    capsys.readouterr()
    assert (
        cli(["doctor", "--accelerate_config", str(packaged_accelerate_config("fsdp2_cpu.yaml")), *clean]) == 0
    )


def test_trls_fsdp1_config_runs_through_doctor_with_each_key_mapped(clean) -> None:  # type: ignore[no-untyped-def]
    report = run_doctor([*clean, "--mixed_precision", "bf16"], DATA / "trl_fsdp1.yaml", environ={})
    found = levels(report, "accelerate config")
    assert found["fsdp_version"] == "warning" and found["fsdp_backward_prefetch"] == "ok"
    assert found["fsdp_sync_module_states"] == "ok" and found["fsdp_state_dict_type"] == "ok"
    assert report.errors == 0, report.text()
    report = run_doctor(
        [*clean, "--fsdp_layer_cls_to_wrap", "NoSuchLayer"], DATA / "trl_fsdp1.yaml", environ={}
    )
    assert levels(report, "recipe")["fsdp_layer_cls_to_wrap"] == "error"


def test_versions_below_the_floor_and_known_bugs_fire(monkeypatch: pytest.MonkeyPatch) -> None:
    have = {
        "torch": "2.9.0+cu128",
        "transformers": "5.24.0",
        "accelerate": "1.16.0",
        "peft": None,
        "datasets": "5.2.0",
        "safetensors": "0.8.0",
    }
    found = {f.check: f for f in environment.version_findings(have)}
    assert found["torch"].level == "error" and "older than 2.11" in found["torch"].message
    assert found["peft"].level == "error" and "pip install 'peft>=" in found["peft"].fix
    assert (
        found["torch known bug"].level == "warning"
        and "pytorch/pytorch/issues/169349" in found["torch known bug"].line()
    )
    assert "accelerate known bug" not in found  # 1.16.0 is past every listed accelerate range
    for issue in environment.known_issues():  # the data file: every entry has its upstream thread and a range
        assert issue["url"].startswith("https://github.com/") and issue["package"] in environment.PACKAGES
        from packaging.specifiers import SpecifierSet

        SpecifierSet(issue["affected"])


def test_debug_variables_are_listed_with_what_they_cost() -> None:
    env = {
        "CUDA_LAUNCH_BLOCKING": "1",
        "NCCL_DEBUG": "INFO",
        "TORCH_LOGS": "+dynamo",
        "NCCL_P2P_DISABLE": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "HOME": "/root",
    }
    found = {f.check: f for f in environment.debug_findings(env)}
    assert set(found) == {
        "CUDA_LAUNCH_BLOCKING",
        "NCCL_DEBUG",
        "TORCH_LOGS",
        "NCCL_P2P_DISABLE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
    }
    assert [found[k].level for k in ("CUDA_LAUNCH_BLOCKING", "TORCH_LOGS", "NCCL_P2P_DISABLE")] == [
        "warning"
    ] * 3
    assert found["NCCL_DEBUG"].level == "ok" and found["TORCH_NCCL_TRACE_BUFFER_SIZE"].level == "ok"
    assert environment.debug_findings({"NCCL_DEBUG": "TRACE"})[0].level == "warning"
    # The article's single-node advice: NCCL_IB_DISABLE=1 costs nothing on one node, and InfiniBand across nodes.
    assert environment.debug_findings({"NCCL_IB_DISABLE": "1"})[0].level == "ok"
    assert environment.debug_findings({"NCCL_IB_DISABLE": "1"}, machines=2)[0].level == "warning"


def test_gpus_against_the_processes_asked_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    assert environment.cuda_findings(2)[0].level == "ok"  # this CPU machine: gloo
    assert environment.cuda_findings(2, use_cpu=False)[0].level == "warning"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    for asked, level in ((8, "error"), (2, "warning"), (4, "ok")):
        found = {f.check: f for f in environment.cuda_findings(asked)}
        assert found["processes"].level == level and found["nccl"].value == "2.27.3", found


def test_each_recipe_finding_fires(clean, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from hf_fsdp2.checkpoint.run_dir import LOCK_NAME

    def recipe_levels(*extra: str) -> dict[str, str]:
        return levels(run_doctor([*clean, *extra], None, environ={}), "recipe")

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"})
    )
    assert recipe_levels()["output_dir"] == "error"  # locked by a live run (this one)
    (run / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7, "started": "then"})
    )
    assert recipe_levels()["output_dir"] == "warning"  # a dead run's lock: taken over
    (run / LOCK_NAME).unlink()
    (run / "checkpoint-5").mkdir()
    assert recipe_levels()["output_dir"] == "error"  # another run's checkpoints
    (run / "checkpoint-5").rmdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    from huggingface_hub import constants as hub_constants

    monkeypatch.setattr(
        hub_constants, "HF_HUB_OFFLINE", False
    )  # the token, not offline mode, is what is missing
    found = run_doctor([*clean, "--push_to_hub", "true", "--hub_model_id", "me/model"], None, environ={})
    assert levels(found, "recipe")["hub"] == "error" and "token" in found.text().lower(), found.text()
    assert recipe_levels("--dataset_name", str(tmp_path / "missing.jsonl"))["data"] == "error"
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(clean[1])
    plain.chat_template = None  # a base model's tokenizer: no chat template
    plain.save_pretrained(tmp_path / "plain")
    assert recipe_levels("--dataset_name", str(chat))["data"] == "ok"
    found = run_doctor(
        [*clean, "--dataset_name", str(chat), "--tokenizer_name_or_path", str(tmp_path / "plain")],
        None,
        environ={},
    )
    assert levels(found, "recipe")["data"] == "error" and "chat template" in found.text(), found.text()
    monkeypatch.setattr(recipe.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**6))
    assert recipe_levels()["disk"] == "error"


def test_the_memory_plan_against_a_gpu_names_the_cheapest_fix(clean, model: Path) -> None:  # type: ignore[no-untyped-def]
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.plan import read_model_config

    cfg, config = parse_config(clean), read_model_config(str(model))
    (fits,), plan = recipe.memory_findings(
        cfg, config, method=get_method("sft"), world=2, budget=80 * 10**9, device="cuda"
    )
    assert fits.level == "ok" and plan.total_params > 0
    (tight,), _ = recipe.memory_findings(
        cfg, config, method=get_method("sft"), world=2, budget=int(plan.peak * 1.02), device="cuda"
    )
    assert tight.level == "error" and tight.fix.startswith("set ") and "peak" in tight.fix, tight.line()


def test_the_rest_of_the_findings_fire(clean, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """An unreadable accelerate config, a recipe that does not parse, a missing model, a wrap class that exists but
    is not the model's decoder layer, disk with under 20% to spare, a hub target with a token, and preference /
    unpaired data read as the DPO and KTO recipes read it."""
    report = run_doctor(None, tmp_path / "nope.yaml", environ={})
    assert levels(report, "accelerate config")["accelerate config"] == "error" and report.errors == 1
    assert levels(run_doctor([*clean, "--no_such_key", "1"], None, environ={}), "recipe")["recipe"] == "error"
    missing = [*clean, "--model_name_or_path", str(tmp_path / "no_model")]
    assert levels(run_doctor(missing, None, environ={}), "recipe")["model"] == "error"
    odd = tmp_path / "odd.yaml"
    odd.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_transformer_layer_cls_to_wrap: LlamaMLP\n"
    )
    report = run_doctor(clean, odd, environ={})
    assert levels(report, "recipe")["fsdp_transformer_layer_cls_to_wrap"] == "warning", report.text()
    need = recipe.disk_findings
    monkeypatch.setattr(
        recipe.shutil, "disk_usage", lambda path: SimpleNamespace(free=13 * 2**20)
    )  # ~12.4 MiB needed
    assert levels(run_doctor(clean, None, environ={}), "recipe")["disk"] == "warning"
    monkeypatch.undo()
    assert recipe.disk_findings is need
    monkeypatch.setattr(environment, "known_issues", lambda: [])
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    from huggingface_hub import constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)  # scripts/test.sh sets HF_HUB_OFFLINE=1
    assert (
        levels(
            run_doctor([*clean, "--push_to_hub", "true", "--hub_model_id", "me/model"], None, environ={}),
            "recipe",
        )["hub"]
        == "ok"
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "chosen": " yes", "rejected": " no"}) + "\n" for i in range(4))
    )
    dpo = run_doctor([*clean, "--dataset_name", str(pairs)], None, recipe="dpo", environ={})
    assert "preference pairs, 4 of the first 50" in dpo.text() and dpo.errors == 0, dpo.text()
    kto = run_doctor([*clean, "--dataset_name", str(pairs)], None, recipe="kto", environ={})
    assert "unpaired examples, 8 of the first 50" in kto.text() and kto.errors == 0, kto.text()


def test_each_recipe_reads_its_keys_as_its_launch_would(clean, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """GRPO's reward functions resolved and its prompts tokenized; DPO's and KTO's refusals fire."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi", "answer": "hi"}) + "\n")
    grpo = [
        *clean,
        "--dataset_name",
        str(prompts),
        "--max_completion_length",
        "16",
        "--reward_funcs",
        "exact_match",
    ]
    report = run_doctor(grpo, None, recipe="grpo", environ={})
    assert report.errors == 0 and "prompts, 1 of the first 50 records tokenized" in report.text(), (
        report.text()
    )
    bad = run_doctor([*grpo[:-1], "no_such_module:f"], None, recipe="grpo", environ={})
    assert levels(bad, "recipe")["recipe"] == "error" and "cannot be imported" in bad.text()
    assert (
        levels(run_doctor([*clean, "--loss_type", "dapo"], None, recipe="dpo", environ={}), "recipe")[
            "recipe"
        ]
        == "error"
    )
