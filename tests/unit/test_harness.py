"""hf-fsdp2 eval-harness on tiny models: an export, a LoRA adapter over its base (before/after), a checkpoint exported
on the fly; lm-eval's numbers against a direct computation with transformers on the same items."""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from support.harness import direct_scores, harness_answers, harness_logliks
from support.tiny import make_tiny_llama_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_fsdp2.cli import main
from hf_fsdp2.harness.evaluate import evaluate_and_report
from hf_fsdp2.harness.models import HarnessError
from hf_fsdp2.harness.report import CARD_BEGIN, update_model_card
from hf_fsdp2.harness.run import choose_backend
from hf_fsdp2.harness.tasks import DATES_MC_TASK, DATES_TASK

pytest.importorskip("lm_eval")
N = 4  # items per local task
TASKS = f"{DATES_TASK},{DATES_MC_TASK}"


def _direct(folder: Path, adapter: Path | None = None) -> dict:  # type: ignore[type-arg]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return direct_scores(model, tokenizer, N)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("harness") / "base", seed=1)


def test_export_folder_numbers_equal_transformers_item_by_item(base: Path, tmp_path: Path) -> None:
    model = tmp_path / "export"
    shutil.copytree(base, model)
    (model / "README.md").write_text("# card\n")
    report = evaluate_and_report(
        model, [DATES_TASK, DATES_MC_TASK], local_items=N, log_samples=True, device="cpu"
    )
    direct = _direct(base)
    assert harness_answers(report.after["samples"][DATES_TASK]) == direct["answers"]
    got = harness_logliks(report.after["samples"][DATES_MC_TASK])
    assert [x for row in got for x in row] == pytest.approx(
        [x for row in direct["logliks"] for x in row], abs=1e-4
    )
    assert report.after["tasks"][DATES_TASK]["exact_match"] == direct["exact_match"]
    assert report.after["tasks"][DATES_MC_TASK]["acc"] == direct["acc"]
    assert report.after["tasks"][DATES_MC_TASK]["n"] == N
    assert report.after["backend"] == "hf" and "vllm" in report.after["backend_reason"]
    saved = json.loads((model / "eval_harness.json").read_text())
    assert saved["after"]["tasks"] == report.after["tasks"] and "samples" not in saved["after"]
    card = (model / "README.md").read_text()
    assert card.startswith("# card") and CARD_BEGIN in card and f"| {DATES_MC_TASK} | acc |" in card


def test_adapter_over_its_base_with_a_before_after_table(base: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    (adapter / "README.md").write_text("# adapter card\n")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    status = main(
        [
            "eval-harness",
            str(adapter),
            "--tasks",
            TASKS,
            "--base",
            str(base),
            "--local-items",
            str(N),
            "--device",
            "cpu",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "| task | metric | before | after | change | items |" in out
    saved = json.loads((adapter / "eval_harness.json").read_text())
    # Under the table, for a person (scripts/demo.sh prints all but the JSON line): where the figures are, how long.
    note = out.splitlines()[-2]
    assert note == (
        f"results: {adapter / 'eval_harness.json'} (every metric with its stderr, the items, the settings); "
        f"model card: {adapter / 'README.md'}; lm-eval {saved['after']['seconds']:.0f} s on the model + "
        f"{saved['before']['seconds']:.0f} s on the base"
    )
    assert json.loads(out.splitlines()[-1])["results"] == str(adapter / "eval_harness.json")
    after, before = _direct(base, adapter), _direct(base)
    assert after["logliks"] != before["logliks"]  # the adapter changes the model
    assert saved["after"]["tasks"][DATES_MC_TASK]["acc"] == after["acc"]
    assert saved["before"]["tasks"][DATES_MC_TASK]["acc"] == before["acc"]
    assert saved["after"]["adapter"] == str(adapter) and saved["after"]["base_model"] == str(base)
    assert "Before: `" in (adapter / "README.md").read_text()


def test_the_vllm_backend_is_given_the_adapters_lora_rank(base: Path, tmp_path: Path) -> None:
    """lm-eval's vLLM backend defaults max_lora_rank to 16, and vLLM refuses an adapter above it: the model_args
    carry the adapter's rank (r, or the largest rank_pattern value), rounded up to a value vLLM accepts; a rank
    above all of them is refused before vLLM starts, naming the way out."""
    from peft import LoraConfig, get_peft_model
    from support.vllm_models import VLLM_LORA_RANKS

    from hf_fsdp2.harness.models import resolve_model
    from hf_fsdp2.harness.run import _model_args

    adapter = tmp_path / "adapter"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj", "v_proj"]),
    ).save_pretrained(adapter)
    model = resolve_model(adapter)

    def args(backend: str = "vllm") -> dict:  # type: ignore[type-arg]
        return _model_args(model, backend, device="cpu", dtype="auto", lora_ranks=VLLM_LORA_RANKS)

    assert args() == {
        "pretrained": str(base),
        "dtype": "float32",
        "enable_lora": True,
        "lora_local_path": str(adapter),
        "max_lora_rank": 32,
    }
    config = json.loads((adapter / "adapter_config.json").read_text())
    for r, pattern, want in ((24, {}, 32), (8, {"q_proj": 100}, 128), (4, {"v_proj": 1}, 8), (300, {}, 320)):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": r, "rank_pattern": pattern}))
        assert args()["max_lora_rank"] == want, (r, pattern)
    assert "max_lora_rank" not in args("hf")  # transformers' PEFT loading needs no bound
    (adapter / "adapter_config.json").write_text(
        json.dumps({**config, "r": 8, "rank_pattern": {"q_proj": 600}})
    )
    with pytest.raises(
        HarnessError, match=r"LoRA rank 600, above the largest max_lora_rank vLLM accepts \(512 of"
    ):
        args()
    with pytest.raises(HarnessError, match="--backend hf"):
        args()


def test_checkpoint_is_exported_on_the_fly_and_removed_after(base: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    trained = make_tiny_llama_dir(tmp_path / "trained", seed=5)
    state = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).state_dict()
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that one process is saving
        dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3}))
    cfg = {"model_name_or_path": str(base), "export_dtype": "float32"}
    (ckpt / "hf_fsdp2_config.yaml").write_text(yaml.safe_dump(cfg))
    status = main(
        ["eval-harness", str(ckpt), "--tasks", DATES_MC_TASK, "--local-items", str(N), "--device", "cpu"]
    )
    assert status == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "run" / "eval_harness-checkpoint-3.json").read_text())
    assert saved["after"]["kind"] == "checkpoint"
    assert saved["after"]["tasks"][DATES_MC_TASK]["acc"] == _direct(trained)["acc"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "checkpoint-3",
        "eval_harness-checkpoint-3.json",
    ]


def test_bad_inputs_name_the_value_and_the_fix(base: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["eval-harness", str(base), "--tasks", "hf_fsdp2_datez", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "hf_fsdp2_datez" in err and "--include-path" in err
    (tmp_path / "empty").mkdir()
    assert main(["eval-harness", str(tmp_path / "empty"), "--tasks", DATES_TASK]) == 2
    assert "is not a model folder" in capsys.readouterr().err
    with pytest.raises(HarnessError, match="--backend vllm: vllm does not import"):
        choose_backend("vllm")


def test_a_new_card_section_replaces_the_old_one(tmp_path: Path) -> None:
    card = tmp_path / "README.md"
    card.write_text("# m\n")
    update_model_card(card, f"{CARD_BEGIN}\nold\n<!-- /hf_fsdp2:eval-harness -->")
    update_model_card(card, f"{CARD_BEGIN}\nnew\n<!-- /hf_fsdp2:eval-harness -->")
    text = card.read_text()
    assert "new" in text and "old" not in text and text.count(CARD_BEGIN) == 1
    assert not update_model_card(tmp_path / "none.md", "x")


def test_a_recipes_eval_harness_tasks_run_on_its_export_and_a_failure_keeps_it(
    base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_fsdp2.harness.evaluate import evaluate_after_export

    run = tmp_path / "run"
    shutil.copytree(base, run)
    # A rank of a 2-process launch: the evaluation must run as one plain process all the same.
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    result = evaluate_after_export(run, f" {DATES_MC_TASK} ,", limit=2)
    assert result is not None and result["tasks"][DATES_MC_TASK]["n"] == 2
    assert json.loads((run / "eval_harness.json").read_text())["after"]["tasks"] == result["tasks"]
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    # A crashed evaluation (out of memory, a task that needs the hub on an offline node): exit status 1.
    crashed = subprocess.CompletedProcess(args=[], returncode=1, stdout="")
    monkeypatch.setattr("hf_fsdp2.harness.evaluate.subprocess.run", lambda *a, **k: crashed)
    with caplog.at_level("ERROR", logger="hf_fsdp2"):
        assert evaluate_after_export(run, DATES_MC_TASK, limit=2) is None
    assert "the evaluation failed (exit status" in caplog.text and "complete and unchanged" in caplog.text
    assert f"hf-fsdp2 eval-harness {run} --tasks {DATES_MC_TASK} --limit 2" in caplog.text
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files


def test_eval_harness_keys_are_checked_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from hf_fsdp2.config import ConfigError
    from hf_fsdp2.config.outputs import ExportArgs

    with pytest.raises(ConfigError, match="eval_harness_limit=0 must be > 0"):
        ExportArgs(eval_harness_limit=0).validate(save_steps=0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "lm_eval" else real(n, *a))
    with pytest.raises(
        ConfigError, match=r"needs lm-evaluation-harness, which is not installed; pip install"
    ):
        ExportArgs(eval_harness_tasks="arc_easy").validate(save_steps=0)
