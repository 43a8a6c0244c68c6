"""The reference-free preference objectives of the DPO recipe, SimPO and ORPO (``loss_type``), end to end on 2 gloo
ranks: every step's loss and logged metrics equal a plain one-process loop written from the papers' formulas
(plain transformers forward, torch AdamW, clipping) on the same pairs, each rank with its own pairs, and that loop
equals TRL 1.16's own trainers on the same data (``trl.experimental``: CPOTrainer with loss_type simpo,
ORPOTrainer); no reference is built. Per pair, the formulas equal TRL's own loss functions (tests/unit/test_preference.py). ORPO over a 4-bit base
with LoRA trains too (each objective runs with LoRA and QLoRA through the same model builder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.families import make_family_dir
from support.launch import REPO, python, torchrun
from support.tiny import make_tiny_llama_dir, write_pairs_jsonl

from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs
from hf_fsdp2.observe.logs import read_metrics

DPO = REPO / "recipes" / "dpo.py"
LR, BETA, GAMMA, STEPS = 1e-2, 0.5, 0.3, 3
COMMON = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "loss",
    "grad_norm",
)
EXTRA = {"simpo": ("nll_loss",), "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen")}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference")
    pairs = write_pairs_jsonl(root / "pairs.jsonl", 16, seed=2)
    return {"model": make_tiny_llama_dir(root / "model", seed=5), "pairs": pairs}


def _run(model: Path, data: Path, out: Path, loss_type: str, *extra: str):  # type: ignore[no-untyped-def]
    args = [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        "1",
        "--gradient_accumulation_steps",
        "2",
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
        "--beta",
        str(BETA),
        "--loss_type",
        loss_type,
        "--export_verify",
        "false",
        *extra,
    ]
    return torchrun(DPO, args, nproc=2)


def _plain_loop(assets: dict[str, Path], loss_type: str, cpo_alpha: float) -> list[dict[str, float]]:
    """The papers' formulas by hand on the global step (4 pairs: ranks x micro-batches x 1): per-token mean
    log-probs; SimPO ``-logsigmoid(beta (a_c - a_r) - gamma)`` + cpo_alpha x the NLL of the chosen completions;
    ORPO the NLL of the chosen sequences + ``-beta logsigmoid(log odds)``; an NLL is the mean over the step's tokens
    it covers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["pairs"].read_text().splitlines()]
    pairs, _ = tokenize_pairs(records, tok, max_length=64)
    collate = PreferenceCollator(pad_token_id=tok.pad_token_id, max_length=64)
    policy = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    rows = []
    for step in range(STEPS):
        batch = collate(pairs[4 * step : 4 * step + 4])
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        per_token = logits.float().log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        mask = batch["completion_mask"][:, 1:].float()
        sums, n = (per_token * mask).sum(1), mask.sum(1)
        mean = sums / n
        c, r = mean[:4], mean[4:]
        nll = -sums[:4].sum() / n[:4].sum()  # SimPO (CPO): the chosen completions
        if (
            loss_type == "orpo"
        ):  # ORPO: the chosen sequences, prompt and completion (TRL, the ORPO authors' code)
            real = batch["attention_mask"][:4, 1:].float()
            nll = -(per_token[:4] * real).sum() / real.sum()
        if loss_type == "simpo":
            pair = -F.logsigmoid(BETA * (c - r) - GAMMA)
            loss = pair.mean() + cpo_alpha * nll
            extra = {"nll_loss": float(nll)}
        else:
            log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
            pair = -BETA * F.logsigmoid(log_odds)
            loss = pair.mean() + nll
            extra = {
                "nll_loss": float(nll),
                "log_odds_ratio": float(F.logsigmoid(log_odds).mean()),
                "log_odds_chosen": float(log_odds.mean()),
            }
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        rc, rr = (BETA * c).detach(), (BETA * r).detach()
        rows.append(
            {
                "step": step + 1,
                "loss": float(loss),
                "grad_norm": grad_norm,
                "rewards/chosen": float(rc.mean()),
                "rewards/rejected": float(rr.mean()),
                "rewards/accuracies": float((rc > rr).float().mean()),
                "rewards/margins": float((rc - rr).mean()),
                "logps/chosen": float(c.mean()),
                "logps/rejected": float(r.mean()),
                **extra,
            }
        )
    return rows


def _differences(got: list[dict], want: list[dict], keys: tuple[str, ...]) -> list[tuple]:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    return [
        (r["step"], k, r.get(k), w[k])
        for r, w in zip(got, want, strict=True)
        for k in keys
        if k not in r or abs(r[k] - w[k]) > 1e-4 * abs(w[k]) + 1e-5
    ]


@pytest.mark.parametrize("loss_type, cpo_alpha", [("simpo", 0.5), ("orpo", 0.0)])
def test_two_ranks_equal_the_papers_formulas_and_trls_trainer_step_by_step(
    assets, tmp_path: Path, loss_type: str, cpo_alpha: float
) -> None:
    """Ours on 2 ranks with accumulation (1 pair x 2 micro-batches x 2 ranks a step) = the plain loop (4 pairs in
    one batch) = TRL's own trainer on one process (``CPOTrainer(loss_type="simpo")`` / ``ORPOTrainer``, batch 4,
    one micro-batch: there TRL's per-micro-batch means are the step's)."""
    extra = ("--simpo_gamma", str(GAMMA), "--cpo_alpha", str(cpo_alpha)) if loss_type == "simpo" else ()
    proc = _run(assets["model"], assets["pairs"], tmp_path / "run", loss_type, *extra)
    log = proc.stdout + proc.stderr
    assert "reference-free" in log and "DPO reference" not in log, log[-3000:]
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")
    want = _plain_loop(assets, loss_type, cpo_alpha)
    keys = COMMON + EXTRA[loss_type]
    assert not _differences(got, want, keys), _differences(got, want, keys)
    assert (
        abs(got[-1]["rewards/margins"] - got[0]["rewards/margins"]) > 1e-3
    )  # the policy moved: the check has teeth
    trl = tmp_path / "trl.json"
    python(
        REPO / "tests" / "support" / "trl_dpo.py",
        [
            str(assets["model"]),
            str(assets["pairs"]),
            str(trl),
            "--objective",
            loss_type,
            "--batch",
            "4",
            "--steps",
            str(STEPS),
            "--lr",
            str(LR),
            "--beta",
            str(BETA),
            "--simpo_gamma",
            str(GAMMA),
            "--cpo_alpha",
            str(cpo_alpha),
        ],
    )
    theirs = json.loads(trl.read_text())
    assert not _differences(theirs, want, keys), _differences(theirs, want, keys)


def test_orpo_with_qlora_trains_the_adapter_over_the_sharded_4bit_base(assets, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    wide = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = make_family_dir(tmp_path / "wide", "llama3_untied", overrides=wide)
    proc = _run(
        model,
        assets["pairs"],
        tmp_path / "run",
        "orpo",
        "--use_peft",
        "true",
        "--load_in_4bit",
        "true",
        "--learning_rate",
        "5e-3",
        "--max_steps",
        "4",
    )
    log = proc.stdout + proc.stderr
    assert "4-bit base on this rank after sharding" in log and "reference-free" in log, log[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["nll_loss"] < rows[0]["nll_loss"], [r["nll_loss"] for r in rows]
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
