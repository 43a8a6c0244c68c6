"""optim=muon on 2 gloo ranks (FSDP2 shards, the matrices orthogonalised by their owner ranks) vs one process of
plain torch.optim.Muon + torch.optim.AdamW, and its exact resume through the DCP checkpoint.

The reference loop uses no hf_fsdp2 code: plain LlamaForCausalLM, torch.optim.Muon on the decoder layers' 2-D
matrices, torch.optim.AdamW on the rest (decay on the embeddings and head, none on norms), transformers' cosine
schedule on each, the documented data order (tests/support/reference.py).
"""

from __future__ import annotations

import json
import shutil
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

WORLD, SEED, LR, MUON_LR, WD, STEPS, MAX_LEN, BS, ACCUM = 2, 7, 3e-3, 0.02, 0.1, 4, 96, 2, 2


class _Both:
    """Two optimizers (or schedulers) stepped as one, for reference_steps."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()


def reference_run(model_dir: Path, data: list[dict]) -> list[dict]:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    named = list(model.named_parameters())
    matrices = [p for n, p in named if ".layers." in n and p.ndim == 2]
    decay = [p for n, p in named if ".layers." not in n and p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    assert len(matrices) == 7 * model.config.num_hidden_layers  # q k v o gate up down per layer
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        foreach=True,
    )
    muon = torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=WD, adjust_lr_fn="original")
    scheds = [
        get_cosine_schedule_with_warmup(o, num_warmup_steps=0, num_training_steps=STEPS)
        for o in (adamw, muon)
    ]
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    return reference_steps(
        model,
        _Both(adamw, muon),  # type: ignore[arg-type]
        _Both(*scheds),  # type: ignore[arg-type]
        [p for _, p in named],
        data,
        pad_id,
        world=WORLD,
        batch_size=BS,
        accum=ACCUM,
        seed=SEED,
        steps=STEPS,
    )


def _args(model_dir: Path, data_file: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data_file),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(BS),
        "--gradient_accumulation_steps",
        str(ACCUM),
        "--learning_rate",
        str(LR),
        "--weight_decay",
        str(WD),
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
        "--export_dtype",
        "float32",
        "--export_verify",
        "false",
        "--save_steps",
        "2",
        "--save_total_limit",
        "0",
        "--optim",
        "muon",
        "--muon_lr",
        str(MUON_LR),
        "--muon_adjust_lr",
        "original",
        *extra,
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict], Path]:
    root = tmp_path_factory.mktemp("muon")
    model_dir = make_tiny_llama_dir(root / "model", seed=3)
    data_file = write_chat_jsonl(root / "chat.jsonl", 40, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ds, _ = tokenize_dataset(load_raw_dataset(str(data_file)), tokenizer, max_length=MAX_LEN, source="chat")
    out = root / "run"
    proc = torchrun(SFT, _args(model_dir, data_file, out))
    (root / "run.log").write_text(proc.stdout + proc.stderr)
    return model_dir, data_file, [ds[i] for i in range(len(ds))], out


def test_two_ranks_equal_torch_muon_plus_adamw_in_one_process(setup):
    model_dir, _, data, out = setup
    expected = reference_run(model_dir, data)
    assert len({e["target_tokens"] for e in expected}) > 1  # real, varying batches
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [g["target_tokens"] for g in got] == [e["target_tokens"] for e in expected]
    loss_rel = [abs(g["loss"] - e["loss"]) / e["loss"] for g, e in zip(got, expected, strict=True)]
    norm_rel = [
        abs(g["grad_norm"] - e["grad_norm"]) / e["grad_norm"] for g, e in zip(got, expected, strict=True)
    ]
    print(f"max relative difference: loss {max(loss_rel):.2e}, grad norm {max(norm_rel):.2e}")
    assert max(loss_rel) <= 1e-4, (got, expected)
    assert max(norm_rel) <= 2e-3, (
        got,
        expected,
    )  # as test_parity: Adam's sign-like early updates show here first
    assert got[-1]["loss"] < got[0]["loss"]
    log = (out.parent / "run.log").read_text()
    # The two groups, logged with their counts: 2 layers x 7 matrices on Muon; embeddings, head, 5 norms on AdamW.
    assert "Muon on 14 decoder-layer matrices" in log and "AdamW on 7 tensors" in log, log[-3000:]


def test_resume_from_checkpoint_repeats_the_uninterrupted_losses(setup, tmp_path: Path):
    model_dir, data_file, _, full = setup
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    torchrun(SFT, _args(model_dir, data_file, out, "--resume_from_checkpoint", "latest"))
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(full / "metrics.jsonl")}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(got) == [3, 4]
    # Exact: the momentum buffers and Adam moments came back from DCP as they were saved (sharded as the weights).
    assert all(got[s] == want[s] for s in got), (got, want)


def test_lora_adapters_stay_on_adamw_under_muon_on_two_ranks_as_in_one_process(setup, tmp_path: Path):
    """LoRA under optim=muon: the adapters' A (r x in) and B (out x r) factors are AdamW's (Keller Jordan's and
    Moonlight's split: Muon for hidden weight matrices only), so the run equals PEFT + torch.optim.AdamW on them in
    one process, at learning_rate (muon_lr, set 3x apart, is unused); the log names the factors and warns that the
    run trains as AdamW."""
    from peft import LoraConfig, get_peft_model

    model_dir, data_file, data, _ = setup
    steps = 4
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = get_peft_model(base, config)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert named and all(".lora_" in n and ".layers." in n and p.ndim == 2 for n, p in named)
    trainable = [p for _, p in named]
    adamw = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(adamw, num_warmup_steps=0, num_training_steps=steps)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    expected = reference_steps(
        model,
        adamw,
        sched,
        trainable,
        data,
        pad_id,
        world=WORLD,
        batch_size=BS,
        accum=ACCUM,
        seed=SEED,
        steps=steps,
    )
    out = tmp_path / "run"
    args = _args(
        model_dir,
        data_file,
        out,
        "--use_peft",
        "true",
        "--lora_r",
        "8",
        "--lora_alpha",
        "16",
        "--lora_dropout",
        "0.0",
        "--lora_target_modules",
        "all-linear",
        "--max_steps",
        str(steps),
        "--weight_decay",
        "0.0",
        "--muon_lr",
        str(3 * LR),
        "--muon_adjust_lr",
        "match_rms_adamw",
        "--save_steps",
        "0",
    )
    proc = torchrun(SFT, args)
    log = proc.stdout + proc.stderr
    assert "Muon on 0 decoder-layer matrices" in log, log[-3000:]
    assert f"LoRA's A/B factors on AdamW: {len(named)} tensors" in log, log[-3000:]
    assert "optim=muon with use_peft=true: every trainable tensor is a LoRA factor" in log, log[-3000:]
    got = read_metrics(out / "metrics.jsonl")
    loss_rel = [abs(g["loss"] - e["loss"]) / e["loss"] for g, e in zip(got, expected, strict=True)]
    print(f"LoRA max relative loss difference {max(loss_rel):.2e}")
    assert len(got) == steps and max(loss_rel) <= 1e-4, (got, expected)
    # Training moved the adapters (B starts at zero), so the equal losses are over changing weights.
    assert all(p.abs().max() > 0 for n, p in named if ".lora_B." in n)


def test_three_ranks_uneven_and_empty_row_blocks_equal_torch_muon(tmp_path: Path):
    """Rows that 3 ranks do not divide (13, 7, 11), a 2-row matrix (the third rank's block is empty) and a last
    round with fewer matrices than ranks: the sharded parameters equal one process of torch.optim.Muon + AdamW."""
    out = tmp_path / "w.json"
    torchrun(Path(__file__).parent / "workers" / "muon_worker.py", ["--out", str(out)], nproc=3)
    got = json.loads(out.read_text())
    print(f"3 ranks: max relative parameter difference per step {got['diffs']}")
    assert got["world"] == 3 and all(b > 0 for b in got["sent"])
    assert max(got["diffs"]) <= 1e-5 and got["moved"][-1] > 1e-2, got
    # Counted per step: 2 all-to-alls per bucket of rounds (8 matrices over 3 ranks by Newton-Schulz cost: 6 rounds,
    # one rank taking the cheap 2-row ones; one bucket under the default 256 MiB), where one round per bucket (the
    # exchange before buckets) takes 2 per round; the same parameters bit for bit (the same bf16 blocks reach the
    # same Newton-Schulz: only the transport is grouped).
    assert (got["rounds"], got["buckets"]) == (6, 1)
    assert got["all_to_alls"] == [2 * got["buckets"], 2 * got["rounds"]] * len(got["diffs"]), got[
        "all_to_alls"
    ]
    assert all(got["bit_identical"]), got["bit_identical"]
