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
from support.launch import REPO, elastic, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.observe.logs import read_metrics

GRPO = REPO / "recipes" / "grpo.py"
STEPS, B, G, MAX_NEW, LR, SEED = 3, 2, 4, 5, 1e-3, 0
# For the runs whose checkpoints nothing reads: the end-of-run checkpoint (save_steps defaults to 500, and the last
# step always saves) is a sharded save per launch that no assertion looks at. No number depends on it.
NO_SAVE = ("--save_steps", "0")
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
        for i in range(
            16
        ):  # sequential order, 4 prompts per generation batch: rank 1 samples records 4k+2, 4k+3
            kind = "flat" if i % 4 >= 2 else ("skip" if i == 4 else "vary")
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
        ids = torch.randint(3, 2000, (16, 12), generator=torch.Generator().manual_seed(0))
        mean = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[eos] = 8.0 * mean / mean.pow(2).sum()
    model.save_pretrained(folder)
    return folder


def _args(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(B * G),
        "--num_generations",
        str(G),
        "--max_completion_length",
        str(MAX_NEW),
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
        "--reward_funcs",
        "grpo_rewards:by_kind",
        "--reward_weights",
        "2.0",
        "--temperature",
        "0.9",
        *extra,
    ]


def _plain_loop(
    assets: dict[str, Path],
    loss_type: str,
    iterations: int = 1,
    beta: float = 0.0,
    per_device: int = B * G,
    accumulation: int = 1,
    steps_per_generation: int | None = None,
    rollout_batch: int | None = None,
    mask_truncated: bool = False,
    quantile: float = 1.0,
) -> list[dict]:
    """The same run in one process, written from TRL's meaning: every generation batch takes the next
    ``per_device x 2 ranks x steps_per_generation / G`` records in order, each repeated G times, rank r sampling its
    contiguous share (in calls of ``rollout_batch``, seeded as rank r's); the rewards of both ranks normalised per
    group (a group may span the ranks); each step one update over ``accumulation`` micro-batches of ``per_device``
    completions per rank from the buffered batch, ``iterations`` passes per generation batch against the sampler's
    log-probs (kept when the batch outlives a step); ``beta``: KL to the model as loaded (a frozen copy);
    ``mask_truncated``: completions not ending in EOS or pad out of the loss; ``quantile``: the surrogate over the
    tokens of at least that entropy quantile of both ranks' micro-batch (TRL's mask)."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.methods.grpo.loss import GrpoSettings, group_advantages, grpo_loss_sums, high_entropy_mask
    from hf_fsdp2.methods.grpo.rewards import combine, resolve_reward_functions, score_completions
    from hf_fsdp2.methods.grpo.rollout import (
        SamplingSettings,
        TransformersGenerator,
        is_clipped,
        rollout_seed,
    )
    from hf_fsdp2.methods.grpo.step import _rows

    tok = AutoTokenizer.from_pretrained(assets["model"])
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    reference = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    functions = resolve_reward_functions(["grpo_rewards:by_kind"], [2.0], max_completion_length=MAX_NEW)
    settings = GrpoSettings(loss_type=loss_type, max_completion_length=MAX_NEW, num_generations=G, beta=beta)
    generator = TransformersGenerator(
        model,
        pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id],
        settings=SamplingSettings(max_completion_length=MAX_NEW, temperature=0.9),
    )
    spg = steps_per_generation or accumulation
    every, share = (
        spg * iterations,
        per_device * spg,
    )  # micro-batches per generation batch; completions per rank
    prompts_per = 2 * share // G
    rollout_batch = rollout_batch or share

    def token_scores(net: torch.nn.Module, row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        width = row["completion_mask"].shape[1]
        logits = net(input_ids=row["input_ids"], attention_mask=row["attention_mask"]).logits[
            :, -width - 1 : -1
        ]
        logps = torch.log_softmax(logits / 0.9, -1)
        entropy = -(logps.exp() * logps).sum(-1).detach()
        return logps.gather(-1, row["input_ids"][:, -width:, None]).squeeze(-1), entropy

    def token_logps(net: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_scores(net, row)[0]

    def sample(number: int) -> dict:
        mine = records[(number - 1) * prompts_per : number * prompts_per]
        repeated = [tok(r["prompt"])["input_ids"] for r in mine for _ in range(G)]  # as TRL: with BOS
        kinds = {k: [r[k] for r in mine for _ in range(G)] for k in ("answer", "kind")}
        tables, rows, completions_all = [], {}, []
        for rank in (0, 1):
            part = repeated[rank * share : (rank + 1) * share]
            completions: list[list[int]] = []
            for c in range(-(-share // rollout_batch)):
                completions += generator.generate(
                    part[c * rollout_batch : (c + 1) * rollout_batch],
                    seed=rollout_seed(SEED, number, rank + 2 * c),
                )
            texts = tok.batch_decode(completions, skip_special_tokens=True)
            columns = {k: v[rank * share : (rank + 1) * share] for k, v in kinds.items()}
            prompts = [r["prompt"] for r in mine for _ in range(G)][rank * share : (rank + 1) * share]
            tables.append(score_completions(functions, prompts, texts, completions, columns))
            completions_all.append((part, completions))
        rewards = combine(torch.cat(tables), functions)
        advantages, zero = group_advantages(rewards, settings)
        for rank, (part, completions) in enumerate(completions_all):
            for j in range(spg):
                cut = slice(j * per_device, (j + 1) * per_device)
                row = _rows(part[cut], completions[cut], tok.pad_token_id)
                ends = [tok.eos_token_id, tok.pad_token_id]
                kept = [not (mask_truncated and is_clipped(c, ends)) for c in completions[cut]]
                row["loss_mask"] = row["completion_mask"] * torch.tensor(kept)[:, None].long()
                adv = advantages[rank * share : (rank + 1) * share][cut]
                with torch.no_grad():
                    old = token_logps(model, row) if accumulation % every else None
                    ref = token_logps(reference, row) if beta else None
                rows[rank, j] = (row, adv, old, ref)
        tokens = sum(int(r[0]["loss_mask"].sum()) for r in rows.values())
        return {"rows": rows, "rewards": rewards, "tokens": tokens, "zero": float(zero.double().mean())}

    rows_out, batch = [], None
    for step in range(1, STEPS + 1):
        micro = []
        for i in range(accumulation):
            m = (step - 1) * accumulation + i
            if m % every == 0:
                batch = sample(m // every + 1)
            assert batch is not None
            micro += [(batch, batch["rows"][rank, m % spg]) for rank in (0, 1)]
        loss = torch.zeros(())
        kl = tokens = entropy = 0.0
        for k in range(0, len(micro), 2):  # one micro-batch of each rank: the entropy mask pools both
            pair = micro[k : k + 2]
            scores = [token_scores(model, row) for _, (row, *_) in pair]
            pooled = torch.cat(
                [e[row["loss_mask"].bool()] for (_, e), (_, (row, *_)) in zip(scores, pair, strict=True)]
            )
            for (logps, ent), (gen, (row, adv, old, ref)) in zip(scores, pair, strict=True):
                mask = row["loss_mask"]
                keep = high_entropy_mask(ent, mask, 1 - quantile, pooled) if quantile < 1 else None
                sums = grpo_loss_sums(logps, old, ref, adv, mask, settings, entropy_mask=keep, entropies=ent)
                norm = {"dapo": gen["tokens"] * accumulation / spg, "bnpo": accumulation * 2}.get(
                    loss_type, per_device * accumulation * 2
                )
                loss = loss + sums.loss / norm
                kl, tokens = kl + float(sums.kl), tokens + float(sums.tokens)
                entropy += float(sums.entropy)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        assert batch is not None
        rows_out.append(
            {
                "step": step,
                "loss": float(loss),
                "grad_norm": grad_norm,
                "kl": kl / tokens,
                "entropy": entropy / tokens,
                "reward": float(batch["rewards"].nanmean()),
                "frac_reward_zero_std": batch["zero"],
            }
        )
    return rows_out


def _extra(loss_type: str, iterations: int, beta: float, gather: str) -> list[str]:
    return [
        "--loss_type",
        loss_type,
        "--num_iterations",
        str(iterations),
        "--beta",
        str(beta),
        "--rollout_gather",
        gather,
    ]


@pytest.fixture(scope="module")
def dapo_run(assets, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The dapo run (TRL's defaults), checkpoint-2 (and the end's, 3): the plain loop's parity case and the
    uninterrupted run a resumed one must repeat from checkpoint-2. Its folder and log."""
    out = tmp_path_factory.mktemp("dapo") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(assets["root"]))
        proc = torchrun(
            GRPO, _args(assets, out, *_extra("dapo", 1, 0.0, "full"), "--save_steps", "2"), nproc=2
        )
    return out, proc.stdout + proc.stderr


CASES = {  # name: (loss_type, iterations, beta, gather, per_device, accumulation, steps_per_generation, rollout batch)
    "dapo": ("dapo", 1, 0.0, "full", B * G, 1, None, None),
    # 32 completions per generation batch (2 micro-batches of 8 per rank), sampled every 2 steps in 4 generate calls
    # of at most 5 per rank with the model gathered per layer (its ranks decoding in step); the sampler's log-probs
    "grpo": ("grpo", 1, 0.0, "layer", B * G, 1, 2, 5),
    # micro-batches of 2 completions, 3 per step, each generation batch trained twice (2 steps): 3 prompts of 4
    # completions over 2 ranks of 6, so a prompt's group spans the ranks; the KL to a frozen sharded copy
    "dr_grpo": ("dr_grpo", 2, 0.1, "full", 2, 3, None, None),
    # with mask_truncated_completions, top_entropy_quantile 0.5 (the mask over both ranks' tokens) and log_completions
    "bnpo": ("bnpo", 1, 0.0, "full", 4, 2, None, None),
}
OPTIONS = {
    "bnpo": [
        "--mask_truncated_completions",
        "true",
        "--top_entropy_quantile",
        "0.5",
        "--log_completions",
        "true",
        "--num_completions_to_print",
        "3",
    ]
}


def _case_args(case: str) -> list[str]:
    loss_type, iterations, beta, gather, per_device, accumulation, spg, rollout_batch = CASES[case]
    extra = [
        *_extra(loss_type, iterations, beta, gather),
        "--per_device_train_batch_size",
        str(per_device),
        "--gradient_accumulation_steps",
        str(accumulation),
    ]
    extra += ["--steps_per_generation", str(spg)] if spg else []
    extra += ["--rollout_batch_size", str(rollout_batch)] if rollout_batch else []
    return extra + OPTIONS.get(case, [])


@pytest.fixture(scope="module")
def grpo_run(assets, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The grpo case (a generation batch every 2 steps), a checkpoint every step: step 1's is inside a generation
    batch. Its folder and log."""
    out = tmp_path_factory.mktemp("grpo") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(assets["root"]))
        proc = torchrun(GRPO, _args(assets, out, *_case_args("grpo"), "--save_steps", "1"), nproc=2)
    return out, proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_a_plain_loop_with_a_flat_rank_and_an_unscorable_group(
    assets, tmp_path, monkeypatch, request, case
):
    """Every step's loss, gradient norm, reward (and KL) equal the plain loop of TRL's batch and step meaning."""
    loss_type, iterations, beta, gather, per_device, accumulation, spg, rollout_batch = CASES[case]
    monkeypatch.syspath_prepend(str(assets["root"]))
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    if case in ("dapo", "grpo"):  # the module's runs (their checkpoints change no number)
        run, log = request.getfixturevalue(f"{case}_run")
    else:
        run = tmp_path / "run"
        proc = torchrun(GRPO, _args(assets, run, *_case_args(case), *NO_SAVE), nproc=2)
        log = proc.stdout + proc.stderr
    assert f"loss: GRPO {loss_type}" in log and "export verified" in log, log[-3000:]
    got = read_metrics(run / "metrics.jsonl")
    options = OPTIONS.get(case, [])
    want = _plain_loop(
        assets,
        loss_type,
        iterations,
        beta,
        per_device,
        accumulation,
        spg,
        rollout_batch,
        mask_truncated="--mask_truncated_completions" in options,
        quantile=0.5 if "--top_entropy_quantile" in options else 1.0,
    )
    for g, w in zip(got, want, strict=True):
        for key in (
            "loss",
            "grad_norm",
            "reward",
            "frac_reward_zero_std",
            "entropy",
            *(("kl",) if beta else ()),
        ):
            assert abs(g[key] - w[key]) <= 1e-4 * abs(w[key]) + 1e-6, (g["step"], key, g[key], w[key])
    # Half the prompts are flat (all of rank 1's in the 8-per-rank runs), and record 4's group is unscorable.
    assert all(r["frac_reward_zero_std"] >= 0.25 for r in got), [r["frac_reward_zero_std"] for r in got]
    # Completions end at different lengths (the ranks run different numbers of decoding steps).
    assert any(r["completions/min_length"] < r["completions/max_length"] for r in got), got
    assert {
        "rewards/grpo_rewards:by_kind/mean",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "entropy",
    } <= set(got[0])
    assert all(r["entropy"] > 0 for r in got)
    # mask_truncated_completions: some completions were cut at max_completion_length, so the mask did something
    clipped = [r["completions/clipped_ratio"] for r in got]
    assert "--mask_truncated_completions" not in options or any(0 < c < 1 for c in clipped), clipped
    # log_completions: TRL's table of every rank's rows of the step's generation batch, 3 printed
    if "--log_completions" in options:
        for r in got:
            assert len(r["completions"]) == 3 and r["completions"][0]["step"] == r["step"], r["completions"]
            assert set(r["completions"][0]) == {
                "step",
                "prompt",
                "completion",
                "grpo_rewards:by_kind",
                "advantage",
            }
    else:
        assert all("completions" not in r for r in got)
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
    # Step 3's numbers are the subject; the export of this run is the dapo run's, verified there; its checkpoints
    # nothing reads (NO_SAVE).
    args = _args(
        assets,
        resumed,
        *_extra("dapo", 1, 0.0, "full"),
        *NO_SAVE,
        "--resume_from_checkpoint",
        "latest",
        "--export_verify",
        "false",
    )
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
        *NO_SAVE,
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
    args = _args({**assets, "model": model}, tmp_path / "run", "--max_steps", "2", "--beta", "0.05", *NO_SAVE)
    proc = torchrun(GRPO, args, nproc=2)
    log = proc.stdout + proc.stderr
    assert "export verified" in log, log[-3000:]
    assert ("GRPO adds no MoE router load-balancing loss" in log) is (family == "qwen3_moe")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(
        r["kl"] == r["kl"] and r["grad_norm"] == r["grad_norm"] for r in rows
    )


def test_every_rank_stops_at_the_end_ids_of_the_folders_generation_config(
    assets, tmp_path, monkeypatch
) -> None:
    """A generation_config.json that makes every id but 100 an end token (config.json keeps the one </s>): rank 1
    builds its model from config.json (fsdp_cpu_ram_efficient_loading, on by default here), yet every rank's
    completions stop where plain generation with the folder's config stops, at their first end token (TRL's
    union of the tokenizer's EOS and the generation config's ids); read per rank by the reward function."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fsdp2.methods.grpo.rollout import cut_at_eos, stop_token_ids

    folder = make_tiny_llama_dir(tmp_path / "model", seed=3)
    vocab = len(AutoTokenizer.from_pretrained(folder))
    ends = [i for i in range(vocab) if not 100 <= i < 200]
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": ends}))
    record = tmp_path / "completions.jsonl"
    (tmp_path / "length_rewards.py").write_text(
        "import json, os\n"
        "def by_first(prompts, completions, completion_ids, **kw):\n"
        f"    with open({str(record)!r}, 'a') as fh:\n"
        "        fh.write(json.dumps({'rank': int(os.environ['RANK']), 'ids': [list(c) for c in completion_ids]}) + '\\n')\n"
        "    return [float(c[0] % 7) for c in completion_ids]\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{assets['root']}")
    args = _args(
        {**assets, "model": folder},
        tmp_path / "run",
        "--max_steps",
        "2",
        "--reward_funcs",
        "length_rewards:by_first",
        "--reward_weights",
        "1.0",
        "--export_verify",
        "false",
        *NO_SAVE,
    )
    torchrun(GRPO, args, nproc=2)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    stops = stop_token_ids(
        AutoTokenizer.from_pretrained(folder).eos_token_id, plain.generation_config.eos_token_id
    )
    assert stops == ends
    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    for line in record.read_text().splitlines():
        row = json.loads(line)
        seen[row["rank"]] += row["ids"]
    for rank, completions in seen.items():
        # 2 steps of B x G completions per rank
        assert len(completions) == 2 * B * G, (rank, len(completions))
        lengths = [len(c) for c in completions]
        # plain generation keeps every sampled token up to and including the first of the folder's end ids
        assert lengths == [len(c) for c in cut_at_eos(_padded(completions), stops)], (rank, completions)
        assert min(lengths) == 1, (rank, lengths)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Completions of several lengths as one tensor (a pad that is no end id: 150)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [150] * (width - len(r)) for r in rows])


def test_a_reward_that_scores_nothing_stops_the_run_naming_it(assets, tmp_path, monkeypatch) -> None:
    """A reward function that returns None for every completion: at the third step without a usable reward every
    rank stops alike (exit status 2, one line naming the function; not a collapse blamed on the learning rate),
    nothing is exported, metrics.jsonl and summary.json say why."""
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


def test_a_run_resumed_inside_a_generation_batch_trains_on_the_same_completions(
    assets, grpo_run, tmp_path, monkeypatch
) -> None:
    """checkpoint-1 of the grpo case falls inside a generation batch (sampled at step 1, trained on at steps 1 and
    2): each rank's buffered completions, advantages and sampler's log-probs are in it, so the resumed run's step 2
    (no sampling) and step 3 (the next generation batch) repeat the uninterrupted run's."""
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    straight, log = grpo_run
    assert "sampled every 2 micro-batch(es)" in log, log[-3000:]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    (resumed / "latest").write_text("1\n")
    args = _args(
        assets,
        resumed,
        *_case_args("grpo"),
        *NO_SAVE,
        "--resume_from_checkpoint",
        "latest",
        "--export_verify",
        "false",
    )
    torchrun(GRPO, args, nproc=2)
    a = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    assert sorted(b) == [2, 3], sorted(b)
    for step in (2, 3):
        for key in ("loss", "grad_norm", "reward", "entropy", "completions/mean_length"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key, a[step][key])


def test_a_run_whose_rank_is_killed_restarts_by_itself_and_trains_as_the_uninterrupted_one(
    assets, grpo_run, tmp_path, monkeypatch
) -> None:
    """The grpo case under torchrun --max_restarts 1 (the launcher's flag alone: resume_from_checkpoint auto), rank 1
    killed (SIGKILL) as step 2 starts, inside the generation batch sampled at step 1: the agent restarts the run, it
    resumes from checkpoint-1 with each rank's buffered completions and finishes with the uninterrupted run's numbers
    (docs/restarts.md)."""
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    straight, _ = grpo_run
    out = tmp_path / "run"
    proc = elastic(
        GRPO,
        _args(assets, out, *_case_args("grpo"), "--save_steps", "1", "--export_verify", "false"),
        launcher="torchrun",
        launcher_args=["--nproc_per_node", "2", "--max_restarts", "1", "--monitor_interval", "0.1"],
        faults=[{"attempt": 0, "rank": 1, "at": "step", "step": 2}],
    )
    assert "test fault: step at step 2 (rank 1)" in proc.stderr
    (restart,) = json.loads((out / "restarts.json").read_text())["restarts"]
    assert (restart["step"], restart["ranks"], restart["resumed_from_step"]) == (2, [1], 1)
    a = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "event" not in r}
    assert sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm", "reward", "entropy", "completions/mean_length"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
