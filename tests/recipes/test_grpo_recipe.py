"""The GRPO recipe end to end on 2 gloo ranks: every step's loss, gradient norm and rewards equal a plain one-process
loop over the same prompts (each rank's, sampled with its seed from the unsharded model, scored, normalised per
group, the loss over both ranks' completions), with a rank whose rewards are all equal (no advantage) and a prompt
no reward function scores (a group with no valid completion); a run resumed from its checkpoint samples and trains
exactly as the uninterrupted one; the export is verified."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from support.launch import REPO, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.observe.logs import read_metrics

GRPO = REPO / "recipes" / "grpo.py"
STEPS, B, G, MAX_NEW, LR, SEED = 3, 2, 4, 5, 1e-3, 0
REWARDS = (
    "def by_kind(prompts, completions, kind, **kw):\n"
    "    # kind 'flat': every completion the same reward (no advantage); 'skip': unscorable (None)\n"
    "    return [None if k == 'skip' else 0.5 if k == 'flat' else float(len(set(c)) % 3) for c, k in "
    "zip(completions, kind)]\n"
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo")
    rng = random.Random(5)
    data = root / "prompts.jsonl"
    with data.open("w") as fh:
        for i in range(16):  # sequential order: rank 0 reads the even records, rank 1 the odd ones
            kind = "flat" if i % 2 else ("skip" if i == 2 else "vary")
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))
            fh.write(json.dumps({"prompt": prompt, "answer": rng.choice(WORDS), "kind": kind}) + "\n")
    (root / "grpo_rewards.py").write_text(REWARDS)
    return {"model": _ending_model(root / "model"), "data": data, "root": root}


def _ending_model(folder: Path) -> Path:
    """The tiny Llama with its end-of-sequence logit raised along the mean final hidden state: completions end
    at different lengths (a random model almost never samples its end token), on each rank differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_llama_dir(folder, seed=3)
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(3, 30000, (16, 12), generator=torch.Generator().manual_seed(0))
        mean = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[eos] = 8.0 * mean / mean.pow(2).sum()
    model.save_pretrained(folder)
    return folder


def _args(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(assets["model"]), "--dataset_name", str(assets["data"]), "--output_dir",
            str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", str(B), "--num_generations", str(G),
            "--max_completion_length", str(MAX_NEW), "--max_length", "64", "--mixed_precision", "no",
            "--learning_rate", str(LR), "--lr_scheduler_type", "constant", "--train_sampling_strategy", "sequential",
            "--logging_steps", "1", "--seed", str(SEED), "--reward_funcs", "grpo_rewards:by_kind",
            "--reward_weights", "2.0", "--temperature", "0.9", *extra]  # fmt: skip


def _plain_loop(
    assets: dict[str, Path], loss_type: str, iterations: int = 1, beta: float = 0.0
) -> list[dict]:
    """The same run in one process: rank r's prompts are records r, r+2, ... in order, sampled with rank r's seed;
    ``iterations`` updates per generation batch against the sampler's log-probs; ``beta``: KL to the model as loaded
    (a frozen copy)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.methods.grpo.loss import GrpoSettings, group_advantages, grpo_loss_sums
    from hf_fsdp2.methods.grpo.rewards import combine, resolve_reward_functions, score_completions
    from hf_fsdp2.methods.grpo.rollout import SamplingSettings, TransformersGenerator, rollout_seed
    from hf_fsdp2.methods.grpo.step import _rows

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    reference = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    functions = resolve_reward_functions(["grpo_rewards:by_kind"], [2.0], max_completion_length=MAX_NEW)
    settings = GrpoSettings(loss_type=loss_type, max_completion_length=MAX_NEW, num_generations=G, beta=beta)
    generator = TransformersGenerator(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                                      settings=SamplingSettings(MAX_NEW, temperature=0.9))  # fmt: skip

    def token_logps(net: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
        width = row["completion_mask"].shape[1]
        logits = net(input_ids=row["input_ids"], attention_mask=row["attention_mask"]).logits[
            :, -width - 1 : -1
        ]
        return torch.log_softmax(logits / 0.9, -1).gather(-1, row["input_ids"][:, -width:, None]).squeeze(-1)

    rows_out = []
    for step in range(1, STEPS + 1):
        batch, parts = [], []
        for rank in (0, 1):
            mine = records[rank::2][(step - 1) * B : step * B]
            prompts = [tok(r["prompt"])["input_ids"] for r in mine]  # as TRL: with BOS
            repeated = [p for p in prompts for _ in range(G)]
            completions = generator.generate(repeated, seed=rollout_seed(SEED, step, rank))
            texts = tok.batch_decode(completions, skip_special_tokens=True)
            columns = {k: [r[k] for r in mine for _ in range(G)] for k in ("answer", "kind")}
            table = score_completions(functions, [r["prompt"] for r in mine for _ in range(G)], texts, completions,
                                      columns)  # fmt: skip
            rewards = combine(table, functions)
            advantages, _ = group_advantages(rewards, settings)
            parts.append(rewards)
            row = _rows(repeated, completions, tok.pad_token_id)
            with torch.no_grad():
                old = token_logps(model, row) if iterations > 1 else None
                ref = token_logps(reference, row) if beta else None
            batch.append((row, advantages, old, ref))
        for _ in range(iterations):
            sums = [grpo_loss_sums(token_logps(model, row), old, ref, adv, row["completion_mask"], settings)
                    for row, adv, old, ref in batch]  # fmt: skip
            loss = sum(x.loss for x in sums) / sum(x.count for x in sums)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
        kl = sum(float(x.kl) for x in sums) / sum(float(x.tokens) for x in sums)
        rewards = torch.cat(parts)
        rows_out.append({"step": step, "loss": float(loss), "grad_norm": grad_norm, "kl": kl,
                         "reward": float(rewards.nanmean())})  # fmt: skip
    return rows_out


def _extra(loss_type: str, iterations: int, beta: float, gather: str) -> list[str]:
    return ["--loss_type", loss_type, "--num_iterations", str(iterations), "--beta", str(beta), "--rollout_gather",
            gather]  # fmt: skip


@pytest.fixture(scope="module")
def dapo_run(assets, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The dapo run (TRL's defaults), a checkpoint every step: the plain loop's parity case and the uninterrupted run
    a resumed one must repeat. Its folder and log."""
    out = tmp_path_factory.mktemp("dapo") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(assets["root"]))
        proc = torchrun(
            GRPO, _args(assets, out, *_extra("dapo", 1, 0.0, "full"), "--save_steps", "1"), nproc=2
        )
    return out, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("loss_type", "iterations", "beta", "gather"),
    [("dapo", 1, 0.0, "full"), ("grpo", 1, 0.0, "layer"), ("dr_grpo", 2, 0.1, "full")],
)
def test_two_ranks_equal_a_plain_loop_with_a_flat_rank_and_an_unscorable_group(
    assets, tmp_path, monkeypatch, request, loss_type, iterations, beta, gather
):
    """dr_grpo with num_iterations 2 (the second update's ratio against the sampler's log-probs) and beta 0.1 (the KL
    to a frozen sharded copy of the model as loaded); grpo with the rollout gathered per layer (rollout_gather:
    layer), its ranks decoding in step."""
    monkeypatch.syspath_prepend(str(assets["root"]))
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    if loss_type == "dapo":  # the module's dapo run (its checkpoints change no number)
        run, log = request.getfixturevalue("dapo_run")
    else:
        run = tmp_path / "run"
        proc = torchrun(GRPO, _args(assets, run, *_extra(loss_type, iterations, beta, gather)), nproc=2)
        log = proc.stdout + proc.stderr
    assert f"loss: GRPO {loss_type}" in log and "export verified" in log, log[-3000:]
    got = read_metrics(run / "metrics.jsonl")
    want = _plain_loop(assets, loss_type, iterations, beta)
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "reward", *(("kl",) if beta else ())):
            assert abs(g[key] - w[key]) <= 1e-4 * abs(w[key]) + 1e-6, (g["step"], key, g[key], w[key])
    # Rank 1's groups are all flat (half the groups of every step), and record 2's group is unscorable at step 2.
    assert all(r["frac_reward_zero_std"] >= 0.5 for r in got), [r["frac_reward_zero_std"] for r in got]
    # Completions end at different lengths (the ranks run different numbers of decoding steps).
    assert any(r["completions/min_length"] < r["completions/max_length"] for r in got), got
    assert {"rewards/grpo_rewards:by_kind/mean", "completions/mean_length",
            "clip_ratio/region_mean"} <= set(got[0])  # fmt: skip
    assert any(abs(r["loss"]) > 1e-7 for r in got) or any(r["grad_norm"] > 0 for r in got)


def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(
    assets, dapo_run, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    straight, _ = dapo_run
    # The uninterrupted run's checkpoint-2 as another run folder's latest: resumed there, step 3 must repeat.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    (resumed / "latest").write_text("2\n")
    # Step 3's numbers are the subject; the export of this run is the dapo run's, verified there.
    args = _args(assets, resumed, *_extra("dapo", 1, 0.0, "full"), "--save_steps", "1", "--resume_from_checkpoint",
                 "latest", "--export_verify", "false")  # fmt: skip
    torchrun(GRPO, args, nproc=2)
    a = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert a[3][key] == pytest.approx(b[3][key], rel=1e-6, abs=1e-9), (key, a[3][key], b[3][key])


def test_lora_with_a_kl_to_the_base_trains_and_exports_a_verified_adapter(
    assets, tmp_path, monkeypatch
) -> None:
    """LoRA: the reference is the base with the adapter disabled (no second copy); the KL to it is 0 before the
    adapter moves and positive after; the adapter's export is verified as every LoRA run's."""
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    extra = [
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--beta",
        "0.1",
        "--learning_rate",
        "2e-2",
    ]
    proc = torchrun(GRPO, _args(assets, tmp_path / "run", *extra), nproc=2)
    log = proc.stdout + proc.stderr
    assert "GRPO reference: the base model with the LoRA adapter disabled" in log, log[-3000:]
    assert "adapter verified: " in log, log[-3000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0, [r["kl"] for r in rows]


def test_a_reward_function_that_raises_on_one_rank_stops_every_rank_naming_it(
    assets, tmp_path, monkeypatch
) -> None:
    """Rank 1's prompts make the function raise: both ranks stop at once (none waits in a collective) and the error
    names the function, the rank and the example."""
    (tmp_path / "picky_rewards.py").write_text(
        "def picky(prompts, completions, kind, **kw):\n"
        "    if 'flat' in kind:\n        raise ValueError('no flat prompts here')\n"
        "    return [1.0] * len(completions)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{assets['root']}")
    args = _args(assets, tmp_path / "run", "--reward_funcs", "picky_rewards:picky", "--reward_weights", "1.0")
    proc = torchrun(GRPO, args, nproc=2, check=False, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert (
        "failed while scoring the completions (rank 1)" in log
        and "'picky_rewards:picky' raised ValueError" in log
    )
    assert "on example" in log, log[-3000:]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma2"])
def test_other_families_roll_out_train_and_export(assets, tmp_path, monkeypatch, family: str) -> None:
    """Tied embeddings (Qwen3), a MoE with its router logits on (Qwen3-MoE: no router loss while decoding), final
    logit soft-capping (Gemma 2): the rollout, the KL to the frozen copy, the update and the verified export."""
    from support.families import make_family_dir

    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    model = make_family_dir(tmp_path / family, family)
    args = _args({**assets, "model": model}, tmp_path / "run", "--max_steps", "2", "--beta", "0.05")
    proc = torchrun(GRPO, args, nproc=2)
    log = proc.stdout + proc.stderr
    assert "export verified" in log, log[-3000:]
    assert ("GRPO adds no MoE router load-balancing loss" in log) is (family == "qwen3_moe")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(
        r["kl"] == r["kl"] and r["grad_norm"] == r["grad_norm"] for r in rows
    )


def test_a_reward_that_scores_nothing_stops_the_run_naming_it(assets, tmp_path, monkeypatch) -> None:
    """A reward function that returns None for every completion: at the third step without a usable reward every
    rank stops alike (exit status 2, one line naming the function; not a collapse blamed on the learning rate),
    nothing is exported, metrics.jsonl and summary.json say why (issue 40 item 7)."""
    (tmp_path / "none_rewards.py").write_text(
        "def nothing(prompts, completions, **kw):\n    return [None] * len(completions)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{assets['root']}")
    out = tmp_path / "run"
    args = _args(assets, out, "--reward_funcs", "none_rewards:nothing", "--reward_weights", "1.0")
    proc = torchrun(GRPO, args, nproc=2, check=False, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(errors) == 1, log[-3000:]
    completions = 2 * B * G
    assert (
        f"no learning signal for 3 steps in a row (steps 1..{STEPS}): no usable reward: every reward function "
        f"returned None for every completion (at step {STEPS}: 'none_rewards:nothing' scored 0 of {completions})"
    ) in errors[0], errors[0]
    assert "return a float for the completions it can score" in errors[0]
    assert "COLLAPSE" not in log and "learning_rate" not in errors[0], log[-3000:]
    assert not (out / "model.safetensors").exists()
    events = [r for r in read_metrics(out / "metrics.jsonl") if "event" in r]
    assert [(e["event"], e["action"], e["step"]) for e in events] == [
        ("no_learning_signal", "stopped", STEPS)
    ]
    assert json.loads((out / "summary.json").read_text())["stopped"] == "no_learning_signal"
