"""GRPO with vLLM rollouts against a real server (``hf-fsdp2 vllm-serve`` in .venv-vllm, one per module: vLLM's
start-up is most of this file's time): greedy completions equal transformers' token for token; sampled completions'
log-probs equal the policy's after several weight syncs (one per optimizer update), and the probe refuses a server
left with other weights; a 2-rank GRPO run trains through it (the correction's ratios ~1) and resumes exactly; a
server that is not up stops every rank with one clear error. Skipped, with the reason, without .venv-vllm
(scripts/setup_vllm.sh builds it, scripts/setup.sh runs that)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.launch import REPO, free_port, torchrun
from support.tiny import WORDS
from support.vllm_models import NO_VLLM, VLLM_PYTHON, tiny_vllm_llama

from hf_fsdp2.observe.logs import read_metrics

GRPO = REPO / "recipes" / "grpo.py"
START_TIMEOUT_S = 600
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=NO_VLLM,
)


def _model(folder: Path) -> Path:
    return tiny_vllm_llama(folder, tied=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo_vllm")
    rng = random.Random(5)
    data = root / "prompts.jsonl"
    with data.open("w") as fh:
        for _ in range(16):
            fh.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))}) + "\n")
    (root / "vllm_rewards.py").write_text(
        "def spread(prompts, completions, **kw):\n    return [float(len(set(c)) % 3) for c in completions]\n"
    )
    return {"model": _model(root / "model"), "data": data, "root": root}


@pytest.fixture(scope="module")
def server(assets: dict[str, Path]) -> Iterator[str]:
    """One ``hf-fsdp2 vllm-serve`` for the module (float32, like the trainer here); its start-up time is printed."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} absent: bash scripts/setup_vllm.sh builds it")
    port = free_port()
    log = assets["root"] / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "hf_fsdp2.cli",
        "vllm-serve",
        "--model",
        str(assets["model"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    ]
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    try:
        while "ready on http" not in log.read_text():
            if proc.poll() is not None or time.monotonic() - start > START_TIMEOUT_S:
                pytest.fail(f"vllm-serve did not start (exit {proc.returncode}): {log.read_text()[-3000:]}")
            time.sleep(1)
        print(f"vllm-serve up in {time.monotonic() - start:.1f} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()  # the process this fixture started (the command execs the server in place)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _generator(url: str, model: torch.nn.Module, eos: int, temperature: float = 0.9, **generation_kwargs):  # type: ignore[no-untyped-def]
    from hf_fsdp2.methods.grpo.rollout import SamplingSettings
    from hf_fsdp2.methods.grpo.vllm.client import ServerSettings, VllmClient, VllmGenerator

    settings = SamplingSettings(
        max_completion_length=12, temperature=temperature, generation_kwargs=generation_kwargs
    )
    gen = VllmGenerator(
        model,
        VllmClient(ServerSettings(url, timeout=60)),
        eos_ids=[eos],
        settings=settings,
        probe=([1, 450, 1996], [1354, 1701, 916]),
        compute_dtype="float32",
        device=torch.device("cpu"),
    )
    gen.connect()
    return gen


def _prompts(assets: dict[str, Path]) -> tuple[list[list[int]], object]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    lines = assets["data"].read_text().splitlines()[:6]
    return [tok(json.loads(line)["prompt"])["input_ids"] for line in lines], tok


@needs_vllm
def test_greedy_rollouts_equal_transformers_token_for_token(assets, server) -> None:
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.methods.grpo.rollout import SamplingSettings, TransformersGenerator

    prompts, tok = _prompts(assets)
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    got = _generator(server, model, tok.eos_token_id).generate(prompts, seed=0, greedy=True)
    plain = TransformersGenerator(
        model,
        pad_id=tok.pad_token_id,
        eos_ids=[tok.eos_token_id],
        settings=SamplingSettings(max_completion_length=12),
        bos_id=tok.bos_token_id,
    )
    want = plain.generate(prompts, seed=0, greedy=True)
    assert got == want
    assert len({len(c) for c in got}) > 1 and any(c[-1] == tok.eos_token_id for c in got), (
        got
    )  # some end early


def _policy_logps(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@needs_vllm
def test_sampled_logps_after_weight_syncs_equal_the_policys_and_the_probe_refuses_other_weights(
    assets, server
) -> None:
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.methods.grpo.vllm.client import VllmServerError
    from hf_fsdp2.methods.grpo.vllm.probe import probe_bound

    prompts, tok = _prompts(assets)
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = _generator(server, model, tok.eos_token_id, temperature=0.9)
    optimizer.register_step_post_hook(gen.mark_stale)
    worst, seen = 0.0, set()
    for round_ in range(3):
        completions = gen.generate(prompts * 2, seed=round_)
        logps = gen.take_logps()
        seen.add(json.dumps(completions))
        loss = torch.zeros(())
        for p, c, lp in zip(prompts * 2, completions, logps, strict=True):
            mine = _policy_logps(model, p, c, 0.9)
            diff = float((mine.detach() - torch.tensor(lp)).abs().max())
            assert diff <= probe_bound(mine.detach(), "float32", "float32", 2), (round_, diff)
            worst = max(worst, diff)
            loss = loss - mine.sum() * (1.0 if len(c) % 2 else -1.0)
        loss.backward()
        optimizer.step()  # the hook marks the server's weights stale: sent before the next rollout
        optimizer.zero_grad()
    assert gen.syncs == 3 and gen.version == 3 and len(seen) == 3
    print(f"sampled vs policy log-probs after 3 syncs: max |diff| {worst:.3g}")
    # One more update, not sent: the server now has other weights, by more than the probe's bound.
    before = _policy_logps(model, [1, 450, 1996], [1354, 1701, 916], 1.0).detach()
    (-before.new_tensor(0.0) - _policy_logps(model, [1, 450, 1996], [1354, 1701, 916], 1.0).sum()).backward()
    optimizer.step()
    after = _policy_logps(model, [1, 450, 1996], [1354, 1701, 916], 1.0).detach()
    assert float((after - before).abs().max()) > 100 * probe_bound(after, "float32", "float32", 2)
    with pytest.raises(VllmServerError, match="answers with other weights than the trainer's"):
        gen.check_probe()


@needs_vllm
def test_generation_kwargs_reach_the_engines_sampling_params(assets, server) -> None:
    """generation_kwargs are vLLM SamplingParams fields with use_vllm (TRL's meaning): min_tokens 6 keeps every
    completion from ending before 6 tokens, where the same rollout without it ends some earlier; a name the server's
    SamplingParams lacks (transformers' suppress_tokens) is refused at connect, with the fields it has."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.config import ConfigError

    prompts, tok = _prompts(assets)
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    plain = _generator(server, model, tok.eos_token_id).generate(prompts * 2, seed=4)
    held = _generator(server, model, tok.eos_token_id, min_tokens=6).generate(prompts * 2, seed=4)
    assert any(len(c) < 6 and c[-1] == tok.eos_token_id for c in plain), plain
    assert all(len(c) >= 6 for c in held) and any(c[-1] == tok.eos_token_id for c in held), held
    with pytest.raises(
        ConfigError,
        match=r"generation_kwargs has \['suppress_tokens'\], not fields of vLLM's "
        r"SamplingParams .*whose fields are \[.*'min_tokens'",
    ):
        _generator(server, model, tok.eos_token_id, suppress_tokens=[5])


def _args(assets: dict[str, Path], out: Path, url: str, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--learning_rate",
        "1e-2",
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        "1",
        "--seed",
        "0",
        "--reward_funcs",
        "vllm_rewards:spread",
        "--temperature",
        "0.9",
        "--use_vllm",
        "true",
        "--vllm_server_base_url",
        url,
        "--export_verify",
        "false",
        *extra,
    ]


@needs_vllm
def test_grpo_with_vllm_on_two_ranks_trains_and_resumes_exactly(
    assets, server, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    straight = tmp_path / "straight"
    proc = torchrun(GRPO, _args(assets, straight, server, "--save_steps", "1"), nproc=2)
    log = proc.stdout + proc.stderr
    assert log.count("probe passed") == 3, log[-3000:]  # weights sent before each step's rollout, probed
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # vLLM samples what the policy would: the correction's ratios are 1 up to float32 rounding
        assert r["sampling/sampling_logp_difference/max"] < 1e-4, r
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4, r
    assert (
        any(r["grad_norm"] > 0 for r in rows)
        and rows[0]["completions/min_length"] < rows[0]["completions/max_length"]
    )
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    (resumed / "latest").write_text("2\n")
    torchrun(
        GRPO,
        _args(assets, resumed, server, "--save_steps", "1", "--resume_from_checkpoint", "latest"),
        nproc=2,
    )
    a = {r["step"]: r for r in rows}
    b = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    for key in (
        "loss",
        "grad_norm",
        "reward",
        "completions/mean_length",
        "sampling/importance_sampling_ratio/mean",
    ):
        assert a[3][key] == pytest.approx(b[3][key], rel=1e-6, abs=1e-9), (key, a[3][key], b[3][key])


def test_a_server_that_is_not_up_stops_every_rank_with_one_clear_error(assets, tmp_path, monkeypatch) -> None:
    """No vLLM needed: nothing listens on the port. Both ranks raise the same error (each exits 2) within the
    timeout; rank 0 says it once."""
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    url = f"http://127.0.0.1:{free_port()}"
    args = _args(assets, tmp_path / "run", url, "--vllm_server_timeout", "3")
    start = time.monotonic()
    proc = torchrun(GRPO, args, nproc=2, check=False, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 120, log[-3000:]
    codes = getattr(proc, "rank_codes", None)  # each rank's exit status (the served launcher reports them)
    assert codes is None or list(codes) == [2, 2], (codes, log[-3000:])  # every rank raised it, none hung
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(errors) == 1, log[-3000:]
    assert (
        f"failed while connecting to the vLLM server (rank 0): VllmServerError: no vLLM server answered at {url} "
        "within vllm_server_timeout=3 s"
    ) in errors[0]
    assert "hf-fsdp2 vllm-serve --model" in errors[0]


@needs_vllm
def test_a_generation_batch_over_two_steps_syncs_once_per_rollout_and_resumes_inside_it(
    assets, server, tmp_path, monkeypatch
) -> None:
    """steps_per_generation 2: a rollout every 2 updates, so the weights go to the server before steps 1 and 3 only
    (the update of step 1 is sent with step 3's rollout); a run resumed from checkpoint-1 (inside the generation
    batch, its buffer in the checkpoint: no rollout, no sync at step 2) repeats steps 2 and 3."""
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    extra = ("--save_steps", "1", "--steps_per_generation", "2")
    straight = tmp_path / "straight"
    proc = torchrun(GRPO, _args(assets, straight, server, *extra), nproc=2)
    log = proc.stdout + proc.stderr
    assert log.count("probe passed") == 2, log[-3000:]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    (resumed / "latest").write_text("1\n")
    proc = torchrun(
        GRPO, _args(assets, resumed, server, *extra, "--resume_from_checkpoint", "latest"), nproc=2
    )
    assert (proc.stdout + proc.stderr).count("probe passed") == 1  # step 3's rollout only
    a = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    for step in (2, 3):
        for key in ("loss", "grad_norm", "reward", "sampling/importance_sampling_ratio/mean"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)
