"""optim=muon with every recipe and layout: dpo, kto, rm and grpo on 2 gloo ranks, HSDP (2 replicas x 2 shards, 4
ranks) and context parallel (cp 2) with the SFT recipe, each against a run whose Muon update is known to be right.

* dpo, kto (APO-zero: no KL rows, so the micro-batches' make-up does not matter) and rm: 2 ranks against one process
  of the same recipe on the same global micro-batches (world 1: each matrix orthogonalised whole on its own rank, the
  path tests/unit/test_muon.py holds to torch.optim.Muon bit for bit). Equal losses over 3 steps say that the
  all-to-alls hand each owner the right matrix and every rank its own row block back, for the recipe's own trainable
  set (the policy; DPO's frozen reference has no optimizer; the reward model's score head, outside the decoder layers,
  goes to AdamW: the log line's counts are checked).
* grpo: 2 ranks against the plain one-process loop of tests/recipes/test_grpo_recipe.py (TRL's batch and step meaning,
  rollouts sampled as each rank samples them) with torch.optim.Muon on the decoder layers' matrices and
  torch.optim.AdamW on the rest in place of its AdamW (its gradient norm within 2e-3: the test says why).
* HSDP 2x2 and cp 2: the SFT recipe against one process on the same global micro-batches.

Tolerance: losses within relative 1e-4, gradient norms and the recipes' statistics
(rewards, log-probs, margins) within 1e-3. Both sides compute in fp32; the layouts sum gradients in another order
(~1e-7 relative), and Muon's Newton-Schulz runs in bf16 (torch's), where such a difference flips a rounding of the
input, and through 5 iterations of bf16 products, of many output elements: the update moves by up to 2^-8 of
itself. Measured (3 steps, AdamW lr 1e-3, Muon lr 0.004): losses at most 1.6e-5 relative (KTO), gradient
norms 7.8e-5 (HSDP); rewards and margins, differences of sums near zero, up to 4e-3 relative of values ~1e-3
(hence the 1e-5 floor). A wrong distributed update fails it: with each rank orthogonalising its own row block
(no gather; tried by hand on the KTO run) the 2-rank loss is off by 6.0e-4 relative at step 2 and 7.5e-3 at step 3.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from support.launch import REPO, SFT, torchrun
from support.tiny import WORDS, make_tiny_llama_dir, write_chat_jsonl, write_pairs_jsonl, write_unpaired_jsonl

from hf_fsdp2.observe.logs import read_metrics

STEPS, LR, MUON_LR = 3, 1e-3, 0.004
MUON = ("--optim", "muon", "--muon_lr", str(MUON_LR), "--muon_adjust_lr", "original")
LOSS_REL, STAT_REL = 1e-4, 1e-3


def _close(got: list[dict], want: list[dict], keys: tuple[str, ...], floor: float = 1e-5) -> None:
    """The loss within relative 1e-4, the other figures within 1e-3 (module docstring), each + ``floor`` (for the
    differences of sums near zero: margins, rewards)."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, len(want) + 1)), (got, want)
    rel = {"loss": LOSS_REL}
    bad = [
        (r["step"], k, r[k], w[k])
        for r, w in zip(got, want, strict=True)
        for k in keys
        if abs(r[k] - w[k]) > rel.get(k, STAT_REL) * abs(w[k]) + floor
    ]
    assert not bad, bad
    # the runs trained: Muon moved the weights between the steps (the loss changes)
    assert len({round(w["loss"], 6) for w in want}) == len(want), want


def _common(model: Path, data: Path, out: Path, batch: int, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
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
        "--export_verify",
        "false",
        "--save_steps",
        "0",
        "--seed",
        "0",
        *MUON,
        *extra,
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("muon-recipes")


@pytest.fixture(scope="module")
def model(root: Path) -> Path:
    return make_tiny_llama_dir(root / "model", seed=3)


def _two_and_one(
    script: Path, model: Path, data: Path, root: Path, name: str, *extra: str
) -> tuple[list, list, str]:
    """The recipe on 2 ranks (2 examples each per micro-batch) and on 1 process (4): both runs' metrics, the 2-rank
    log."""
    proc = torchrun(script, _common(model, data, root / f"{name}2", 2, *extra), nproc=2)
    torchrun(script, _common(model, data, root / f"{name}1", 4, *extra), nproc=1)
    two, one = (read_metrics(root / f"{name}{n}" / "metrics.jsonl") for n in (2, 1))
    return two, one, proc.stdout + proc.stderr


# Each decoder layer: q, k, v, o, gate, up, down; 2 layers.
MATRICES = 14


def test_dpo_with_muon_on_two_ranks_equals_one_process(model: Path, root: Path) -> None:
    two, one, log = _two_and_one(
        REPO / "recipes" / "dpo.py",
        model,
        write_pairs_jsonl(root / "pairs.jsonl", 24, seed=1),
        root,
        "dpo",
        "--beta",
        "0.1",
    )
    # the policy's matrices on Muon; the frozen reference has no optimizer (it would double the counts)
    assert f"Muon on {MATRICES} decoder-layer matrices" in log and "AdamW on 7 tensors" in log, log[-3000:]
    _close(two, one, ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected"))


def test_kto_with_muon_on_two_ranks_equals_one_process(model: Path, root: Path) -> None:
    data = write_unpaired_jsonl(root / "unpaired.jsonl", 24, seed=11, desirable=0.5)
    two, one, log = _two_and_one(
        REPO / "recipes" / "kto.py",
        model,
        data,
        root,
        "kto",
        "--beta",
        "0.5",
        "--loss_type",
        "apo_zero_unpaired",
    )
    assert f"Muon on {MATRICES} decoder-layer matrices" in log and "APO-zero" in log, log[-3000:]
    _close(two, one, ("loss", "grad_norm", "rewards/chosen", "logps/chosen"))


def test_rm_with_muon_on_two_ranks_equals_one_process_score_head_on_adamw(model: Path, root: Path) -> None:
    two, one, log = _two_and_one(
        REPO / "recipes" / "rm.py", model, write_pairs_jsonl(root / "rm.jsonl", 24, seed=4), root, "rm"
    )
    # the score head (outside the decoder layers) is AdamW's 8th tensor, beside the embeddings and the norms (the
    # sequence-classification model has no LM head)
    assert f"Muon on {MATRICES} decoder-layer matrices" in log and "AdamW on 7 tensors" in log, log[-3000:]
    _close(two, one, ("loss", "grad_norm", "accuracy", "margin", "mean_reward"))


def _grpo_module():  # type: ignore[no-untyped-def]
    """tests/recipes/test_grpo_recipe.py (its assets, arguments and plain loop), loaded under a name of its own."""
    path = REPO / "tests" / "recipes" / "test_grpo_recipe.py"
    spec = importlib.util.spec_from_file_location("_grpo_recipe_for_muon", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grpo_assets(g, root: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """test_grpo_recipe.py's assets (its fixture's body: a module-scoped fixture of another module cannot be asked
    for): 16 prompts in its order of kinds, its reward module, its model."""
    rng = random.Random(5)
    data = root / "prompts.jsonl"
    with data.open("w") as fh:
        for i in range(16):
            kind = "flat" if i % 4 >= 2 else ("skip" if i == 4 else "vary")
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))
            fh.write(json.dumps({"prompt": prompt, "answer": rng.choice(WORDS), "kind": kind}) + "\n")
    (root / "grpo_rewards.py").write_text(g.REWARDS)
    return {"model": g._ending_model(root / "model"), "data": data, "root": root}


def test_grpo_with_muon_on_two_ranks_equals_the_plain_loop_with_torch_muon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    g = _grpo_module()
    assets = _grpo_assets(g, tmp_path)
    loss_type, iterations, beta, gather, per_device, accumulation, spg, rollout_batch = g.CASES["grpo"]
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    muon = (
        "--optim",
        "muon",
        "--muon_lr",
        str(g.LR),
        "--muon_adjust_lr",
        "match_rms_adamw",
        "--weight_decay",
        "0",
    )
    proc = torchrun(g.GRPO, g._args(assets, tmp_path / "run", *g._case_args("grpo"), *muon), nproc=2)
    log = proc.stdout + proc.stderr
    assert f"Muon on {MATRICES} decoder-layer matrices" in log and "export verified" in log, log[-3000:]
    got = read_metrics(tmp_path / "run" / "metrics.jsonl")

    # The plain loop's AdamW over model.parameters() becomes torch.optim.Muon on the policy's decoder-layer matrices
    # (Muon's defaults as the recipe's: momentum 0.95, Nesterov, 5 steps) + torch.optim.AdamW on the rest.
    loaded: list[torch.nn.Module] = []
    real_load, real_adamw = AutoModelForCausalLM.from_pretrained, torch.optim.AdamW

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        net = real_load(*args, **kwargs)
        loaded.append(net)
        return net

    class Both:
        def __init__(self, params, lr: float, weight_decay: float) -> None:  # type: ignore[no-untyped-def]
            named = list(loaded[0].named_parameters())  # the policy (the reference is its deep copy)
            assert {id(p) for p in params} == {id(p) for _, p in named}
            matrices = [p for n, p in named if ".layers." in n and p.ndim == 2]
            assert len(matrices) == MATRICES
            rest = [p for n, p in named if not (".layers." in n and p.ndim == 2)]
            self.parts = (
                real_adamw(rest, lr=lr, weight_decay=weight_decay),
                torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
            )

        def step(self) -> None:
            for part in self.parts:
                part.step()

        def zero_grad(self) -> None:
            for part in self.parts:
                part.zero_grad()

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(torch.optim, "AdamW", Both)
    monkeypatch.syspath_prepend(str(assets["root"]))
    want = g._plain_loop(assets, loss_type, iterations, beta, per_device, accumulation, spg, rollout_batch)
    # One iteration per generation: the loss is 0 by construction (its gradient is not), the rewards are counts, so
    # the gradient norm is the figure that carries Muon's update. Its tolerance: torch's Newton-Schulz rounds its
    # input and every product to bf16 (the 2-rank exchange sends the same bf16 rows), and the two runs' momenta
    # differ by fp32 summation order (~1e-7), so each run's update is the exact one up to bf16 rounding, and so is
    # the next step's gradient norm up to rho, the shift that rounding makes. Measured with the Newton-Schulz and the
    # exchange in fp32 on both sides: step 3's gradient norms 2.0e-7 apart (fp32 rounding only); bf16 against fp32:
    # rho = 3.9e-4 (2 ranks) and 5.4e-4 (the plain loop). Two bf16 runs are within 2 rho (1.1e-3; measured
    # 1.45e-4): 2e-3 relative. A wrong distributed update (each rank orthogonalising its own row block) moves step 3's
    # gradient norm by 0.26 relative (3.66 -> 2.70) and its reward 1.5 -> 1.4375.
    rel = {"loss": 1e-4, "grad_norm": 2e-3, "reward": 1e-4}
    for r, w in zip(got, want, strict=True):
        for key, tol in rel.items():
            assert abs(r[key] - w[key]) <= tol * abs(w[key]) + 1e-6, (r["step"], key, r[key], w[key])
    assert len({round(w["grad_norm"], 6) for w in want}) == len(want), want


@pytest.fixture(scope="module")
def sft_single(root: Path) -> tuple[Path, Path, list[dict]]:
    """SFT with Muon in one process, 8 examples per micro-batch: the layouts' reference."""
    model, data = (
        make_tiny_llama_dir(root / "sft-model", seed=5),
        write_chat_jsonl(root / "chat.jsonl", 64, seed=5),
    )
    torchrun(SFT, _common(model, data, root / "sft1", 8), nproc=1)
    return model, data, read_metrics(root / "sft1" / "metrics.jsonl")


@pytest.mark.four_procs
def test_hsdp_2x2_with_muon_equals_one_process(sft_single, root: Path) -> None:
    """Each replica group orthogonalises its own copy of a matrix over its 2 shards (the shard dimension's group):
    the replicas' gradients are already averaged, so both compute the same update."""
    model, data, single = sft_single
    proc = torchrun(SFT, _common(model, data, root / "hsdp", 2, "--dp_replicate_size", "2"), nproc=4)
    log = proc.stdout + proc.stderr
    assert "HSDP: 2 replica groups x 2 shards" in log and f"Muon on {MATRICES} decoder-layer matrices" in log
    _close(read_metrics(root / "hsdp" / "metrics.jsonl"), single, ("loss", "grad_norm"))


def test_cp2_with_muon_equals_one_process(sft_single, root: Path) -> None:
    """cp 2 on 2 ranks: one data-parallel rank whose sequences are split over 2; FSDP2 shards over both."""
    model, data, single = sft_single
    proc = torchrun(SFT, _common(model, data, root / "cp", 8, "--cp_size", "2"), nproc=2)
    log = proc.stdout + proc.stderr
    assert "context parallel 2" in log and f"Muon on {MATRICES} decoder-layer matrices" in log, log[-3000:]
    _close(read_metrics(root / "cp" / "metrics.jsonl"), single, ("loss", "grad_norm"))
