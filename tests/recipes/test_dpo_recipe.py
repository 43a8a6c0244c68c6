"""The DPO recipe end to end: per-step loss, rewards, accuracy and margins equal TRL's ``DPOTrainer`` (string and
chat pairs, sigmoid and IPO) and a plain single-process loop (cDPO); 2 ranks equal 1 process; the three references
agree (frozen sharded copy, precomputed log-probs, the LoRA base with the adapter disabled); a resumed run with
precomputed log-probs repeats the same losses; LoRA exports (adapter and merge) verified through
``accelerate launch``; bad records named."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from support.launch import REPO, accelerate_launch, elastic, python, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs
from hf_fsdp2.observe.logs import read_metrics

DPO = REPO / "recipes" / "dpo.py"
METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
LR, BETA = 1e-2, 0.1
# No checkpoint unless a test asks for one (a later --save_steps wins): the end-of-run checkpoint (save_steps defaults
# to 500, and the last step always saves) is a sharded save per launch that nothing reads. No number depends on it.
NO_SAVE = ("--save_steps", "0")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    rng = random.Random(1)
    strings, messages = root / "strings.jsonl", root / "messages.jsonl"
    with strings.open("w") as s, messages.open("w") as m:
        for _ in range(16):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            a, b = (" ".join(rng.choices(WORDS, k=rng.randint(1, 8))) for _ in range(2))
            s.write(json.dumps({"prompt": q, "chosen": " " + a, "rejected": " " + b}) + "\n")
            m.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": q}],
                        "chosen": [{"role": "assistant", "content": a}],
                        "rejected": [{"role": "assistant", "content": b}],
                    }
                )
                + "\n"
            )
    return {"model": make_tiny_llama_dir(root / "model", seed=3), "strings": strings, "messages": messages}


def _dpo(
    assets: dict[str, Path],
    data: str,
    out: Path,
    *extra: str,
    nproc: int = 1,
    batch: int = 2,
    check: bool = True,
):  # type: ignore[no-untyped-def]
    args = [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets[data]),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        str(batch),
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
        "--export_verify",
        "false",
        *NO_SAVE,
        *extra,
    ]
    return torchrun(DPO, args, nproc=nproc, check=check)


def _close(got: float, want: float, rel: float = 1e-4, floor: float = 1e-5) -> bool:
    # Relative, with an absolute floor for values that are differences of sums near zero (margins, rewards).
    return abs(got - want) <= rel * abs(want) + floor


def _assert_same(got: list[dict], want: list[dict], keys=METRICS, **tol: float) -> None:  # type: ignore[no-untyped-def]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    bad = [
        (r["step"], k, r.get(k), w.get(k))
        for r, w in zip(got, want, strict=True)
        for k in keys
        if (k in r) != (k in w) or (k in w and not _close(r[k], w[k], **tol))
    ]
    assert not bad, bad


@pytest.mark.parametrize(
    "data, loss_type", [("strings", "sigmoid"), ("messages", "sigmoid"), ("strings", "ipo")]
)
def test_every_step_matches_trl(assets, tmp_path: Path, data: str, loss_type: str) -> None:
    trl = tmp_path / "trl.json"
    python(
        REPO / "tests" / "support" / "trl_dpo.py",
        [
            str(assets["model"]),
            str(assets[data]),
            str(trl),
            "--batch",
            "2",
            "--accum",
            "2",
            "--steps",
            "3",
            "--lr",
            str(LR),
            "--beta",
            str(BETA),
            "--loss_type",
            loss_type,
        ],
    )
    _dpo(assets, data, tmp_path / "ours", "--loss_type", loss_type)
    want = json.loads(trl.read_text())
    got = read_metrics(tmp_path / "ours" / "metrics.jsonl")
    start = math.log(2) if loss_type == "sigmoid" else (1 / (2 * BETA)) ** 2  # reference = policy at step 1
    assert got[0]["loss"] == pytest.approx(start, rel=1e-7)
    assert any(abs(r["rewards/margins"]) > 1e-2 for r in got[1:])  # the policy moved: the check has teeth
    _assert_same(got, want)


def _plain_dpo_loop(assets: dict[str, Path], steps: int, eps: float) -> list[dict[str, float]]:
    """cDPO by hand: plain transformers forward, log_softmax, the paper's formula, torch AdamW, clipping."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["strings"].read_text().splitlines()]
    pairs, _ = tokenize_pairs(records, tok, max_length=64)
    collate = PreferenceCollator(pad_token_id=tok.pad_token_id, max_length=64)
    policy = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)

    def logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = (
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        )
        per_token = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return (per_token * batch["completion_mask"][:, 1:]).sum(1)

    rows = []
    for step in range(steps):
        totals = {k: 0.0 for k in METRICS if k != "grad_norm"}
        for micro in range(2):
            batch = collate(pairs[(2 * step + micro) * 2 : (2 * step + micro) * 2 + 2])
            with torch.no_grad():
                ref = logps(reference, batch)
            pol = logps(policy, batch)
            chosen, rejected = pol[:2] - ref[:2], pol[2:] - ref[2:]
            z = BETA * (chosen - rejected)
            loss = (
                -(1 - eps) * torch.nn.functional.logsigmoid(z) - eps * torch.nn.functional.logsigmoid(-z)
            ).mean()
            (loss / 2).backward()
            totals["loss"] += float(loss.detach()) / 2
            totals["rewards/chosen"] += float(BETA * chosen.mean()) / 2
            totals["rewards/rejected"] += float(BETA * rejected.mean()) / 2
            totals["rewards/accuracies"] += float((chosen > rejected).float().mean()) / 2
            totals["rewards/margins"] += float(BETA * (chosen - rejected).mean()) / 2
            totals["logps/chosen"] += float(pol[:2].mean()) / 2
            totals["logps/rejected"] += float(pol[2:].mean()) / 2
        totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        rows.append({"step": step + 1, **totals})
    return rows


@pytest.fixture(scope="module")
def two_rank_runs(assets, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """cDPO (label_smoothing 0.2) on 2 ranks: the frozen sharded reference, and precomputed log-probs (with an
    eval set and a checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("dpo2")
    common = ("--label_smoothing", "0.2")
    _dpo(assets, "strings", root / "frozen", *common, nproc=2, batch=1)
    _dpo(
        assets,
        "strings",
        root / "precomputed",
        *common,
        "--precompute_ref_log_probs",
        "true",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "2",
        nproc=2,
        batch=1,
    )
    return {"frozen": root / "frozen", "precomputed": root / "precomputed"}


def test_two_ranks_equal_one_process_and_a_plain_loop(assets, two_rank_runs, tmp_path: Path) -> None:
    proc = _dpo(assets, "strings", tmp_path / "one", "--label_smoothing", "0.2")
    assert "conservative DPO, label_smoothing=0.2" in proc.stdout + proc.stderr
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = read_metrics(two_rank_runs["frozen"] / "metrics.jsonl")
    _assert_same(two, one, rel=1e-5)  # each rank with its own pairs, the same global step
    _assert_same(one, _plain_dpo_loop(assets, 3, eps=0.2))


def test_the_three_references_agree_and_lora_starts_at_ln2(assets, two_rank_runs, tmp_path: Path) -> None:
    frozen = read_metrics(two_rank_runs["frozen"] / "metrics.jsonl")
    precomputed = read_metrics(two_rank_runs["precomputed"] / "metrics.jsonl")
    # The same first three steps (the precomputed run holds 4 of its 16 pairs out for eval: another order).
    assert precomputed[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    evals = [r for r in precomputed if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and evals[-1]["eval_pairs"] == 4
    lora = ("--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "5e-2")
    _dpo(assets, "strings", tmp_path / "lora", *lora, nproc=2, batch=1)
    _dpo(
        assets,
        "strings",
        tmp_path / "lora_pre",
        *lora,
        "--precompute_ref_log_probs",
        "true",
        nproc=2,
        batch=1,
    )
    a = read_metrics(tmp_path / "lora" / "metrics.jsonl")
    b = read_metrics(tmp_path / "lora_pre" / "metrics.jsonl")
    assert (
        a[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and a[0]["rewards/margins"] == 0.0
    )  # B = 0 at init
    # The adapter moved the margin off its exact 0 (9.6e-4 measured).
    assert abs(a[-1]["rewards/margins"]) > 1e-4
    _assert_same(b, a, rel=1e-5)
    # A frozen reference run with the precomputed run's data order equals it.
    _dpo(
        assets,
        "strings",
        tmp_path / "frozen_eval",
        "--label_smoothing",
        "0.2",
        "--max_steps",
        "4",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "2",
        nproc=2,
        batch=1,
    )
    frozen_eval = read_metrics(tmp_path / "frozen_eval" / "metrics.jsonl")
    _assert_same(precomputed, frozen_eval, keys=(*METRICS, "eval_loss", "eval_rewards/margins"), rel=1e-5)
    assert len(frozen) == 3


def test_a_resumed_run_with_precomputed_log_probs_repeats_the_same_losses(
    assets, two_rank_runs, tmp_path
) -> None:
    full = two_rank_runs["precomputed"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoint-2").symlink_to(full / "checkpoint-2", target_is_directory=True)
    (resumed / "latest").write_text("2\n")
    _dpo(
        assets,
        "strings",
        resumed,
        "--label_smoothing",
        "0.2",
        "--precompute_ref_log_probs",
        "true",
        "--max_steps",
        "4",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "2",
        "--resume_from_checkpoint",
        "latest",
        nproc=2,
        batch=1,
    )
    want = {r["step"]: r for r in read_metrics(full / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    assert [got[s]["loss"] for s in (3, 4)] == [want[s]["loss"] for s in (3, 4)]  # bit for bit
    assert got[4]["eval_loss"] == want[4]["eval_loss"]


def test_a_run_whose_rank_is_killed_restarts_by_itself_with_the_same_losses(
    assets, two_rank_runs, tmp_path
) -> None:
    """The precomputed run under torchrun --max_restarts 1 (the launcher's flag alone: resume_from_checkpoint auto),
    rank 1 killed (SIGKILL) as step 3 starts: the agent restarts the run, which computes the reference log-probs
    again, resumes from checkpoint-2 and ends with the uninterrupted run's losses and eval, bit for bit
    (docs/restarts.md)."""
    out = tmp_path / "run"
    args = [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["strings"]),
        "--output_dir",
        str(out),
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
        "--export_verify",
        "false",
        "--label_smoothing",
        "0.2",
        "--precompute_ref_log_probs",
        "true",
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "2",
    ]
    proc = elastic(
        DPO,
        args,
        launcher="torchrun",
        launcher_args=["--nproc_per_node", "2", "--max_restarts", "1", "--monitor_interval", "0.1"],
        faults=[{"attempt": 0, "rank": 1, "at": "step", "step": 3}],
    )
    assert "test fault: step at step 3 (rank 1)" in proc.stderr
    (restart,) = json.loads((out / "restarts.json").read_text())["restarts"]
    assert (restart["step"], restart["ranks"], restart["resumed_from_step"]) == (3, [1], 2)
    want = {r["step"]: r for r in read_metrics(two_rank_runs["precomputed"] / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert [got[s]["loss"] for s in (1, 2, 3, 4)] == [want[s]["loss"] for s in (1, 2, 3, 4)]  # bit for bit
    assert got[4]["eval_loss"] == want[4]["eval_loss"]


def test_lora_dpo_through_accelerate_launch_exports_a_verified_adapter_and_merge(
    assets, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = accelerate_launch(
        "accelerate_configs/fsdp2_cpu.yaml",
        DPO,
        [
            "--model_name_or_path",
            str(assets["model"]),
            "--dataset_name",
            str(assets["messages"]),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--max_length",
            "64",
            "--mixed_precision",
            "bf16",
            "--use_peft",
            "true",
            "--merge_adapter",
            "true",
            "--learning_rate",
            "1e-2",
            *NO_SAVE,
        ],
        served=True,  # accelerate's environment for the config, ranks forked (test_sft_recipe.py runs the real one)
    )
    log = proc.stdout + proc.stderr
    assert "DPO reference: the base model with the LoRA adapter disabled" in log
    assert "adapter verified" in log and "export verified" in log
    assert (out / "adapter_model.safetensors").is_file() and (out / "merged" / "model.safetensors").is_file()
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and "rewards/accuracies" in rows[-1]


def test_bad_preference_data_is_named(assets, tmp_path: Path) -> None:
    no_column = tmp_path / "no_chosen.jsonl"
    no_column.write_text(
        "".join(json.dumps({"prompt": "q", "answer": " a", "rejected": " b"}) + "\n" for _ in range(4))
    )
    proc = _dpo({**assets, "bad": no_column}, "bad", tmp_path / "a", check=False)
    assert proc.returncode != 0 and "[rank0]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "needs 'chosen' and 'rejected' columns" in proc.stderr and "missing ['chosen']" in proc.stderr
    records = assets["strings"].read_text().splitlines()
    records[5] = json.dumps({"prompt": "q", "chosen": " a", "rejected": "   "})
    bad = tmp_path / "empty.jsonl"
    bad.write_text("\n".join(records) + "\n")
    proc = _dpo({**assets, "bad": bad}, "bad", tmp_path / "b", check=False)
    assert proc.returncode != 0 and "record 5: an empty rejected completion" in proc.stderr
    proc = _dpo({**assets, "bad": bad}, "bad", tmp_path / "c", "--on_bad_record", "skip", "--max_steps", "1")
    assert (
        "16 pairs, 0 truncated, 0 dropped (no room for a completion), 1 bad records skipped (1 empty completion)"
        in proc.stdout + proc.stderr
    )
