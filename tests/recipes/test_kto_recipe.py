"""The KTO recipe end to end on unpaired data (string records whose labels, lengths and mixes change every step):
every step's loss, grad norm, KL and rewards/log-probs per kind equal a plain one-process loop written from the KTO
paper's formulas and TRL's KL estimate (plain transformers forward, a frozen reference copy, torch AdamW, clipping),
and that loop equals TRL 1.16's own ``KTOTrainer`` on the same records. Ours runs on 2 ranks with accumulation (the
KL estimate is then per micro-batch over both ranks); the loop deals the examples out as the sampler does. APO-zero
(unpaired) equals TRL's directly; the precomputed reference equals the frozen copy; KTO with QLoRA trains, evaluates
and exports its adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support.families import make_family_dir
from support.launch import REPO, python, torchrun
from support.tiny import make_tiny_llama_dir, write_unpaired_jsonl

from hf_fsdp2.data.unpaired import tokenize_unpaired
from hf_fsdp2.observe.logs import read_metrics

KTO = REPO / "recipes" / "kto.py"
LR, BETA, STEPS = 1e-2, 0.5, 3
# No test here reads a checkpoint: the end-of-run one (save_steps defaults to 500, and the last step always saves) is a
# sharded save per launch that nothing reads. No number depends on it.
NO_SAVE = ("--save_steps", "0")
KEYS = (
    "loss",
    "grad_norm",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kto")
    data = write_unpaired_jsonl(root / "unpaired.jsonl", 40, seed=11, desirable=0.5)
    return {"model": make_tiny_llama_dir(root / "model", seed=5), "data": data}


def _run(assets: dict[str, Path], out: Path, *extra: str, nproc: int = 2, batch: int = 2, accum: int = 2):  # type: ignore[no-untyped-def]
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
        str(batch),
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
        "--beta",
        str(BETA),
        "--export_verify",
        "false",
        *NO_SAVE,
        *extra,
    ]
    return torchrun(KTO, args, nproc=nproc)


def _plain_loop(
    assets: dict[str, Path],
    *,
    world: int,
    batch: int,
    accum: int,
    loss_type: str = "kto",
    w_good: float = 1.0,
    w_bad: float = 1.0,
) -> list[dict[str, float]]:
    """KTO by hand. Rank r's k-th micro-batch holds positions ``r + world (k batch + j)`` of the data (the sequential
    sampler's deal); each example's KL row pairs its prompt with the completion of the one before it in that
    micro-batch (the first: the last's). Per micro-batch index, ``z0 = clamp(mean over every rank's KL rows of
    (policy - reference), 0)`` without gradient; an example's loss ``w_d (1 - sigmoid(beta (r - z0)))`` if desirable,
    ``w_u (1 - sigmoid(beta (z0 - r)))`` if not (APO-zero: ``1 - sigmoid(beta r)`` / ``sigmoid(beta r)``), ``r`` its
    summed completion log-prob minus the reference's; the step's loss is the mean over its examples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    examples, _ = tokenize_unpaired(records, tok, max_length=64)
    policy = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)

    def logps(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        out = []
        for prompt, completion in rows:  # one row at a time: no padding to get wrong
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, :-1].float()
            per_token = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(per_token[len(prompt) - 1 :].sum())
        return torch.stack(out)

    history = []
    for step in range(STEPS):
        losses, kls, kinds = [], [], {True: [], False: []}
        for k in range(step * accum, (step + 1) * accum):
            groups = [[examples[r + world * (k * batch + j)] for j in range(batch)] for r in range(world)]
            kl_terms = []
            for group in groups:
                kl_rows = [(e["prompt_ids"], group[j - 1]["completion_ids"]) for j, e in enumerate(group)]
                with torch.no_grad():
                    kl_terms.append(logps(policy, kl_rows) - logps(reference, kl_rows))
            z0 = torch.cat(kl_terms).mean().clamp(min=0)
            kls.append(float(z0))
            for group in groups:
                rows = [(e["prompt_ids"], e["completion_ids"]) for e in group]
                pi = logps(policy, rows)
                with torch.no_grad():
                    ratio = pi - logps(reference, rows)
                ratio = pi - (pi.detach() - ratio)  # the gradient of pi, the value of pi - ref
                for e, r, p in zip(group, ratio, pi, strict=True):
                    if loss_type == "kto":
                        loss = (
                            1 - torch.sigmoid(BETA * (r - z0))
                            if e["label"]
                            else 1 - torch.sigmoid(BETA * (z0 - r))
                        )
                    else:
                        loss = 1 - torch.sigmoid(BETA * r) if e["label"] else torch.sigmoid(BETA * r)
                    losses.append((w_good if e["label"] else w_bad) * loss)
                    kinds[bool(e["label"])].append((float(BETA * r.detach()), float(p.detach())))
        loss = torch.stack(losses).mean()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        row = {"step": step + 1, "loss": float(loss.detach()), "grad_norm": grad_norm}
        if loss_type == "kto":
            row["kl"] = sum(kls) / len(kls)
        for label, name in ((True, "chosen"), (False, "rejected")):
            if kinds[label]:
                row[f"rewards/{name}"] = sum(r for r, _ in kinds[label]) / len(kinds[label])
                row[f"logps/{name}"] = sum(p for _, p in kinds[label]) / len(kinds[label])
        if kinds[True] and kinds[False]:
            row["rewards/margins"] = row["rewards/chosen"] - row["rewards/rejected"]
        history.append(row)
    return history


def _differences(got: list[dict], want: list[dict]) -> list[tuple]:
    """Every key of ``want`` (the keys a step logs depend on its mix of labels) within 1e-4 rel + 1e-5; rewards and
    kl + 1e-4: they are beta x differences of summed log-probs near -100, whose fp32 rounding moves with the
    summation order (measured: 3e-5 between TRL's padded batch and the loop's single rows under OMP_NUM_THREADS=1)."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    out = []
    for r, w in zip(got, want, strict=True):
        for k in KEYS:
            floor = 1e-4 if k.startswith("rewards/") or k == "kl" else 1e-5
            if (k in r) != (k in w) or (k in w and abs(r[k] - w[k]) > 1e-4 * abs(w[k]) + floor):
                out.append((w["step"], k, r.get(k), w.get(k)))
    return out


def _trl(assets: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    python(
        REPO / "tests" / "support" / "trl_dpo.py",
        [
            str(assets["model"]),
            str(assets["data"]),
            str(out),
            "--objective",
            "kto",
            "--batch",
            "4",
            "--steps",
            str(STEPS),
            "--lr",
            str(LR),
            "--beta",
            str(BETA),
            *extra,
        ],
    )
    return json.loads(out.read_text())


def test_two_ranks_equal_the_papers_formulas_and_trls_kto_trainer_step_by_step(
    assets, tmp_path: Path
) -> None:
    weights = ("--desirable_weight", "1.5", "--undesirable_weight", "0.8")
    proc = _run(assets, tmp_path / "run", *weights)
    log = proc.stdout + proc.stderr
    assert "loss: KTO, beta 0.5, desirable_weight 1.5, undesirable_weight 0.8" in log, log[-3000:]
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")
    want = _plain_loop(assets, world=2, batch=2, accum=2, w_good=1.5, w_bad=0.8)
    assert not _differences(got, want), _differences(got, want)
    assert any(r["kl"] > 0 for r in got), got  # the KL reference point took part (it is clamped at 0)
    assert (
        abs(got[-1]["logps/chosen"] - got[0]["logps/chosen"]) > 1e-2
    )  # the policy moved: the check has teeth
    # The precomputed reference (one pass over every example and its KL row before training) is the same reference.
    _run(assets, tmp_path / "pre", *weights, "--precompute_ref_log_probs", "true")
    pre = read_metrics(tmp_path / "pre" / "metrics.jsonl")
    assert not _differences(pre, want), _differences(pre, want)
    # TRL's KTOTrainer on one process, batch 4 (its KL rows rotate within each batch of 4 consecutive records).
    theirs = _trl(
        assets,
        tmp_path / "trl.json",
        "--loss_type",
        "kto",
        "--desirable_weight",
        "1.5",
        "--undesirable_weight",
        "0.8",
    )
    mine = _plain_loop(assets, world=1, batch=4, accum=1, w_good=1.5, w_bad=0.8)
    assert not _differences(theirs, mine), _differences(theirs, mine)


def test_apo_zero_unpaired_on_two_ranks_equals_trls_kto_trainer(assets, tmp_path: Path) -> None:
    """No KL term: 2 ranks x batch 2 hold the same 4 records a step as TRL's one batch of 4."""
    proc = _run(assets, tmp_path / "run", "--loss_type", "apo_zero_unpaired", accum=1)
    assert "APO-zero" in proc.stdout + proc.stderr
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all("kl" not in r for r in got)
    want = _plain_loop(assets, world=1, batch=4, accum=1, loss_type="apo_zero_unpaired")
    assert not _differences(got, want), _differences(got, want)
    theirs = _trl(assets, tmp_path / "trl.json", "--loss_type", "apo_zero_unpaired")
    assert all(
        r.pop("kl") == 0 for r in theirs
    )  # TRL logs a constant 0 where there is no KL term; we log none
    assert not _differences(theirs, want), _differences(theirs, want)


def test_kto_with_qlora_trains_evaluates_and_exports_the_adapter(assets, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    wide = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = make_family_dir(tmp_path / "wide", "llama3_untied", overrides=wide)
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
        "4",
        "--eval_split_fraction",
        "0.2",
        "--eval_steps",
        "4",
    )
    log = proc.stdout + proc.stderr
    assert (
        "4-bit base on this rank after sharding" in log
        and "KTO reference: the base model with the LoRA" in log
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    assert len(train) == 4 and all(math.isfinite(r["loss"]) for r in train)
    evals = [r for r in rows if "eval_loss" in r]
    assert evals and evals[-1]["eval_examples"] == 8 and math.isfinite(evals[-1]["eval_kl"]), evals
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
