"""The reward-model recipe end to end: every step's loss, grad norm, accuracy, margin and reward statistics on 2 gloo
ranks with accumulation equal a plain one-process Bradley-Terry loop (plain transformers
``AutoModelForSequenceClassification``, torch AdamW, clipping; per-pair margins and TRL's centering term), and that
loop equals TRL 1.16's own ``RewardTrainer`` on the same pairs. The verified export (score head included) reloads
with plain transformers and ``hf-fsdp2 score`` gives the loop model's accuracy; LoRA over a 4-bit base trains the
score head and the adapter, evaluates, and exports a verified adapter."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.families import make_family_dir
from support.launch import REPO, python, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs
from hf_fsdp2.observe.logs import read_metrics

RM = REPO / "recipes" / "rm.py"
LR, STEPS, CENTER, SEED = 1e-2, 3, 0.05, 0
KEYS = ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm")
    rng = random.Random(4)
    data = root / "pairs.jsonl"
    with data.open("w") as fh:
        for _ in range(32):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            a, b = (" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(2))
            record = {
                "prompt": q,
                "chosen": " " + a,
                "rejected": " " + b,
                "margin": round(rng.uniform(0, 1), 3),
            }
            fh.write(json.dumps(record) + "\n")
    return {"model": make_tiny_llama_dir(root / "model", seed=7), "data": data}


def _run(assets: dict[str, Path], out: Path, *extra: str, accum: int = 2):  # type: ignore[no-untyped-def]
    args = [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        str(accum),
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--learning_rate",
        str(LR),
        "--lr_scheduler_type",
        "constant",
        "--train_sampling_strategy",
        "sequential",
        "--logging_steps",
        "1",
        "--seed",
        str(SEED),
        *extra,
    ]
    return torchrun(RM, args, nproc=2)


def _plain_loop(
    assets: dict[str, Path], per_step: int, center: float, cls: Any = None
) -> tuple[list[dict], torch.nn.Module]:
    """Bradley-Terry by hand: the step's pairs in one batch (sequential order), the score head seeded as TRL seeds
    it; per pair ``-logsigmoid(r_c - r_r - margin) + center (r_c + r_r)^2``, the mean over the step's pairs.
    ``cls``: the model class (default ``AutoModelForSequenceClassification``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    pairs, _ = tokenize_pairs(records, tok, max_length=64)
    collate = PreferenceCollator(pad_token_id=tok.pad_token_id, max_length=64)
    torch.manual_seed(SEED)
    model = (cls or AutoModelForSequenceClassification).from_pretrained(
        assets["model"], num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tok.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = []
    for step in range(STEPS):
        batch = collate(pairs[per_step * step : per_step * (step + 1)])
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(
            -1
        )
        c, r = rewards[:per_step], rewards[per_step:]
        loss = (-F.logsigmoid(c - r - batch["margin"]) + center * (c + r) ** 2).mean()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        rewards = rewards.detach()
        rows.append(
            {
                "step": step + 1,
                "loss": float(loss.detach()),
                "grad_norm": grad_norm,
                "accuracy": float((c > r).float().mean()),
                "margin": float((c - r).mean()),
                "mean_reward": float(rewards.mean()),
                "std_reward": float(rewards.std()),
                "min_reward": float(rewards.min()),
                "max_reward": float(rewards.max()),
            }
        )
    return rows, model


def _differences(got: list[dict], want: list[dict], keys: tuple[str, ...] = KEYS) -> list[tuple]:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    return [
        (w["step"], k, r.get(k), w[k])
        for r, w in zip(got, want, strict=True)
        for k in keys
        if k not in r or abs(r[k] - w[k]) > 1e-4 * abs(w[k]) + 1e-5
    ]


def test_two_ranks_equal_a_plain_bradley_terry_loop_and_trls_reward_trainer(
    assets, tmp_path: Path, capsys
) -> None:
    proc = _run(
        assets, tmp_path / "run", "--center_rewards_coefficient", str(CENTER), "--export_dtype", "float32"
    )
    log = proc.stdout + proc.stderr
    assert "LlamaForSequenceClassification: score head (1, 64)" in log and "export verified" in log, log[
        -3000:
    ]
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")
    want, model = _plain_loop(assets, 8, CENTER)  # 2 ranks x 2 micro-batches x 2 pairs
    keys = (*KEYS, "std_reward")
    assert not _differences(got, want, keys), _differences(got, want, keys)
    assert abs(got[-1]["margin"] - got[0]["margin"]) > 1e-3  # the model moved: the check has teeth
    # The export reloads as a plain AutoModelForSequenceClassification; `hf-fsdp2 score` = the loop model's accuracy.
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert not (tmp_path / "run" / "generation_config.json").exists()  # it cannot generate: none written
    card = (tmp_path / "run" / "README.md").read_text()
    assert "AutoModelForSequenceClassification.from_pretrained" in card and "text-classification" in card
    # The last checkpoint exports offline (one process) to the same verified files as the run's own export.
    offline = tmp_path / "offline"
    python(
        REPO / "hf_fsdp2" / "cli.py",
        ["export", str(tmp_path / "run" / f"checkpoint-{STEPS}"), str(offline), "--dtype", "float32"],
    )
    assert (offline / "model.safetensors").read_bytes() == (
        tmp_path / "run" / "model.safetensors"
    ).read_bytes()
    from transformers import AutoTokenizer

    from hf_fsdp2.cli import main as cli
    from hf_fsdp2.demo.tasks import reward_accuracy

    capsys.readouterr()
    assert cli(["score", "--model", str(tmp_path / "run"), "--data", str(assets["data"])]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    mine = reward_accuracy(
        model,
        AutoTokenizer.from_pretrained(assets["model"]),
        [json.loads(line) for line in assets["data"].read_text().splitlines()],
    )
    assert scored["n"] == 32 and scored["accuracy"] == mine["accuracy"], (scored, mine)
    assert math.isclose(scored["mean_margin"], mine["mean_margin"], rel_tol=1e-4, abs_tol=1e-5)
    # TRL's RewardTrainer, one process, batch 4 (its loss uses the margin column and the centering term).
    trl = tmp_path / "trl.json"
    python(
        REPO / "tests" / "support" / "trl_dpo.py",
        [
            str(assets["model"]),
            str(assets["data"]),
            str(trl),
            "--objective",
            "rm",
            "--batch",
            "4",
            "--steps",
            str(STEPS),
            "--lr",
            str(LR),
            "--center",
            str(CENTER),
        ],
    )
    theirs = json.loads(trl.read_text())
    four, _ = _plain_loop(assets, 4, CENTER)
    assert not _differences(theirs, four), _differences(theirs, four)


def test_a_family_transformers_has_no_score_class_for_trains_as_a_plain_loop_and_exports_its_class(
    assets, tmp_path: Path, capsys
) -> None:
    """Granite (tied, logits scaling) has no ``*ForSequenceClassification`` in transformers: the run's reward model is
    transformers' generic class over GraniteModel, every step equal to a plain loop over that class written here as
    a user would; the export carries the class (modeling_score_head.py, config auto_map), is verified by a fresh
    plain-transformers reload with ``trust_remote_code``, and ``hf-fsdp2 score`` reads it."""
    from transformers import AutoModelForSequenceClassification
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.granite.modeling_granite import GranitePreTrainedModel

    class GraniteForSequenceClassification(GenericForSequenceClassification, GranitePreTrainedModel):
        pass

    model = make_family_dir(tmp_path / "granite", "granite")
    granite = {"model": model, "data": assets["data"]}
    proc = _run(granite, tmp_path / "run", "--export_dtype", "float32")
    log = proc.stdout + proc.stderr
    assert "GraniteForSequenceClassification: score head (1, 64)" in log and "export verified" in log, log[
        -3000:
    ]
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")
    want, loop_model = _plain_loop(granite, 8, 0.0, cls=GraniteForSequenceClassification)
    assert not _differences(got, want), _differences(got, want)
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoModelForSequenceClassification": "modeling_score_head.GraniteForSequenceClassification"
    }
    assert "class GraniteForSequenceClassification(" in (run / "modeling_score_head.py").read_text()
    assert (
        "from_pretrained(" in (card := (run / "README.md").read_text()) and "trust_remote_code=True" in card
    )
    reloaded = AutoModelForSequenceClassification.from_pretrained(
        run, trust_remote_code=True, dtype=torch.float32
    )
    ids = torch.tensor([[5, 9, 14, 3, 7], [8, 2, 11, 0, 0]])
    with torch.no_grad():
        mask = (ids != 0).long()
        mine = loop_model.eval()(input_ids=ids, attention_mask=mask).logits
        theirs = reloaded.eval()(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), (mine, theirs)
    from hf_fsdp2.cli import main as cli

    capsys.readouterr()
    assert cli(["score", "--model", str(run), "--data", str(assets["data"])]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["n"] == 32 and 0 <= scored["accuracy"] <= 1, scored
    # Offline from the last checkpoint (one process): the same weights, class file and auto_map.
    offline = tmp_path / "offline"
    python(
        REPO / "hf_fsdp2" / "cli.py",
        ["export", str(run / f"checkpoint-{STEPS}"), str(offline), "--dtype", "float32"],
    )
    for name in ("model.safetensors", "modeling_score_head.py", "config.json"):
        assert (offline / name).read_bytes() == (run / name).read_bytes(), name


def test_lora_over_a_4bit_base_trains_the_score_head_evaluates_and_exports_a_verified_adapter(
    assets, tmp_path: Path
) -> None:
    """On Granite (tied embeddings, and a score class transformers lacks: the adapter's plain-PEFT reload and the
    merged model's go through the modeling file the folders carry)."""
    pytest.importorskip("torchao")
    overrides = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    model = make_family_dir(tmp_path / "granite", "granite", overrides=overrides)
    proc = _run(
        {"model": model, "data": assets["data"]},
        tmp_path / "run",
        "--use_peft",
        "true",
        "--load_in_4bit",
        "true",
        "--learning_rate",
        "5e-3",
        "--max_steps",
        "3",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "3",
        "--merge_adapter",
        "true",
        accum=1,
    )
    log = proc.stdout + proc.stderr
    assert "4-bit base on this rank after sharding" in log and "ForSequenceClassification: score head" in log
    assert "adapter verified: " in log and "on the 4-bit base (torchao NF4" in log, log[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval_loss" in r]
    assert evals and evals[-1]["eval_pairs"] == 8 and 0 <= evals[-1]["eval_accuracy"] <= 1, evals
    merged = json.loads((tmp_path / "run" / "merged" / "config.json").read_text())  # verified like any export
    assert merged["architectures"] == ["GraniteForSequenceClassification"], merged["architectures"]
    assert (tmp_path / "run" / "merged" / "modeling_score_head.py").is_file()
    assert (tmp_path / "run" / "modeling_score_head.py").is_file()  # beside the adapter: the base's class
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"], adapter
    # Offline from the last checkpoint: the same adapter, bit for bit (the 4-bit base quantised as the run did).
    offline = tmp_path / "offline"
    python(REPO / "hf_fsdp2" / "cli.py", ["export", str(tmp_path / "run" / "checkpoint-3"), str(offline)])
    name = "adapter_model.safetensors"
    assert (offline / name).read_bytes() == (tmp_path / "run" / name).read_bytes()


def test_a_moe_reward_model_trains_and_exports_without_a_router_loss(assets, tmp_path: Path) -> None:
    """Qwen3-MoE with ``output_router_logits``: transformers' sequence-classification model returns no router loss
    (TRL adds none either), so none is planned or logged; the experts shard, train and export verified."""
    model = make_family_dir(tmp_path / "moe", "qwen3_moe", overrides={"output_router_logits": True})
    # Its checkpoint nothing reads (save_steps 0: no end-of-run sharded save).
    proc = _run(
        {"model": model, "data": assets["data"]},
        tmp_path / "run",
        "--max_steps",
        "2",
        "--save_steps",
        "0",
        accum=1,
    )
    log = proc.stdout + proc.stderr
    assert "Qwen3MoeForSequenceClassification: score head" in log and "no router loss" in log, log[-3000:]
    # The start-up line naming the experts' kernel (hf_fsdp2/parallel/grouped_mm.py): fp32 without compile on CPU.
    assert (
        "MoE experts (Qwen3MoeExperts, 2 layers): experts_implementation='grouped_mm', kernel grouped_mm"
        in log
    )
    assert "export verified" in log, log[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and "aux_loss" not in r for r in rows), rows
