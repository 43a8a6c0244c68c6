"""Parity: the 2-rank FSDP2 recipe vs a single-process plain PyTorch loop, same data and seed (fp32).

The reference loop below uses no hf_fsdp2 code: plain LlamaForCausalLM, AdamW, transformers' cosine
schedule, torch's gradient clipping, and the documented data order (a permutation seeded with
seed + epoch, truncated to a multiple of the world size, rank r taking every world-th index). The
recipe's logged loss must be the mean over all target tokens of the step on all ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.launch import SFT, torchrun
from support.reference import reference_steps
from support.tiny import make_tiny_llama_dir, write_chat_jsonl
from transformers import AutoTokenizer, LlamaForCausalLM, get_cosine_schedule_with_warmup

from hf_fsdp2.data.loading import load_raw_dataset
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.observe.logs import read_metrics

WORLD, SEED, LR, STEPS, MAX_LEN = 2, 7, 3e-3, 6, 96


def reference_run(
    model_dir: Path, data: list[dict], *, bs: int, accum: int, weight_decay: float
) -> list[dict]:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        foreach=True,
    )
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=STEPS)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    params = list(model.parameters())
    return reference_steps(
        model,
        opt,
        sched,
        params,
        data,
        pad_id,
        world=WORLD,
        batch_size=bs,
        accum=accum,
        seed=SEED,
        steps=STEPS,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    root = tmp_path_factory.mktemp("parity")
    model_dir = make_tiny_llama_dir(root / "model", seed=3)
    data_file = write_chat_jsonl(root / "chat.jsonl", 40, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ds, _ = tokenize_dataset(load_raw_dataset(str(data_file)), tokenizer, max_length=MAX_LEN, source="chat")
    return model_dir, data_file, [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize(
    ("bs", "accum", "weight_decay", "sync_each", "ce_chunk"),
    [(4, 1, 0.0, True, 0), (2, 3, 0.1, True, 16), (3, 2, 0.0, False, 1024)],
    ids=["no-accum-plain-ce", "accum3-wd-chunked-ce", "accum2-nosync"],
)
def test_two_rank_fsdp2_matches_plain_pytorch(
    setup, tmp_path: Path, bs: int, accum: int, weight_decay: float, sync_each: bool, ce_chunk: int
):
    model_dir, data_file, data = setup
    expected = reference_run(model_dir, data, bs=bs, accum=accum, weight_decay=weight_decay)
    # The micro-batches must really hold unequal numbers of target tokens, or a mean of means would pass too.
    assert len({e["target_tokens"] for e in expected}) > 1
    out = tmp_path / "run"
    torchrun(
        SFT,
        [
            "--model_name_or_path",
            str(model_dir),
            "--dataset_name",
            str(data_file),
            "--output_dir",
            str(out),
            "--max_steps",
            str(STEPS),
            "--per_device_train_batch_size",
            str(bs),
            "--gradient_accumulation_steps",
            str(accum),
            "--learning_rate",
            str(LR),
            "--weight_decay",
            str(weight_decay),
            "--lr_scheduler_type",
            "cosine",
            "--max_grad_norm",
            "1.0",
            "--mixed_precision",
            "no",
            "--max_length",
            str(MAX_LEN),
            "--seed",
            str(SEED),
            "--fsdp_sync_each_microbatch",
            str(sync_each).lower(),
            "--export_dtype",
            "float32",
            "--ce_chunk_tokens",
            str(ce_chunk),
            "--export_verify",  # the subject is the losses; verification is tested where it is the subject
            "false",
        ],
        nproc=WORLD,
    )
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    loss_rel = [abs(g["loss"] - e["loss"]) / abs(e["loss"]) for g, e in zip(got, expected, strict=True)]
    norm_rel = [
        abs(g["grad_norm"] - e["grad_norm"]) / e["grad_norm"] for g, e in zip(got, expected, strict=True)
    ]
    print(f"max relative difference: loss {max(loss_rel):.2e}, grad norm {max(norm_rel):.2e}")
    assert [g["target_tokens"] for g in got] == [e["target_tokens"] for e in expected]
    assert max(loss_rel) <= 1e-4, (got, expected)
    # Adam's early updates are ~lr * sign(grad): float-level differences in near-zero gradient entries
    # (different reduction order across ranks) move those weights by up to lr, which shows in the
    # gradient norm before it shows in the loss; the norm is held to a looser 2e-3.
    assert max(norm_rel) <= 2e-3, (got, expected)
    # Training moved the loss: the comparison is over changing weights, not a constant.
    assert got[-1]["loss"] < got[0]["loss"]


def test_same_seed_same_losses_bit_for_bit(setup, tmp_path: Path):
    """Seeded and deterministic on CPU: two runs of the recipe (bf16, AC, accumulation) log identical numbers."""
    model_dir, data_file, _ = setup
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        torchrun(
            SFT,
            [
                "--model_name_or_path",
                str(model_dir),
                "--dataset_name",
                str(data_file),
                "--output_dir",
                str(out),
                "--max_steps",
                "3",
                "--per_device_train_batch_size",
                "2",
                "--gradient_accumulation_steps",
                "2",
                "--learning_rate",
                str(LR),
                "--max_length",
                str(MAX_LEN),
                "--seed",
                str(SEED),
                "--gradient_checkpointing",
                "true",
                "--export_verify",
                "false",
            ],
            nproc=WORLD,
        )
        runs.append(
            [(r["loss"], r["grad_norm"], r["target_tokens"]) for r in read_metrics(out / "metrics.jsonl")]
        )
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3
