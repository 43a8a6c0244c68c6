"""Expert parallel on 4 gloo ranks (one launch for every case: tests/distributed/workers/ep_worker.py).

For each MoE family of tests/support/moe.py (Qwen3-MoE with its router loss, Mixtral and OLMoE without, Qwen2-MoE
with a shared expert, gpt-oss with expert biases): 8 experts, top 2, routing skewed so that experts 6 and 7 receive no
token (under ``ep 4`` their rank receives none at all), two micro-batches per rank of different lengths and target
counts, rank 0's weights only (the other ranks build the model on meta). Three layouts: flat FSDP2 over 4, ``ep 2 x
efsdp 2`` and ``ep 4``. Each trains 4 steps whose losses, router losses and gradient norms equal a plain one-process
transformers + torch AdamW loop over the same micro-batches (fp32, relative 1e-4), the router loss computed as
transformers computes it over each micro-batch's tokens of all four ranks; each export is verified and equals the
flat run's; a checkpoint of ``ep 2`` resumes flat and one of flat resumes under ``ep 2`` with the losses of the runs
that did not stop; one step's all-to-all calls and bytes are those of the formula of docs/fsdp2-guide.md.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support.launch import torchrun
from support.moe import EXPERTS, IDLE, LR, MOE_FAMILIES, STEPS, WORLD, make_moe_dir, moe_batches
from transformers import AutoModelForCausalLM

WORKER = Path(__file__).parent / "workers" / "ep_worker.py"
FAMILIES = tuple(MOE_FAMILIES)
RESUME = ("qwen3_moe",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ep")
    for family in FAMILIES:
        make_moe_dir(root / "models" / family, family)
    torchrun(
        WORKER,
        ["--root", str(root / "models"), "--families", ",".join(FAMILIES), "--resume", ",".join(RESUME),
         "--out", str(root / "out")],
        nproc=WORLD,
        timeout=900,
    )  # fmt: skip
    return root / "models", root / "out"


def _result(out: Path, family: str) -> dict:
    result = json.loads((out / family / "result.json").read_text())
    assert "error" not in result, f"{family}: {result.get('error')}\n{result.get('traceback')}"
    return result


def reference(model_dir: Path) -> dict[str, list[float]]:
    """Plain transformers and torch AdamW in one process over every rank's micro-batches: per step, the summed CE over
    the step's target tokens, plus for each micro-batch index the router loss of transformers'
    ``load_balancing_loss_func`` over that micro-batch's tokens of all ranks (their router logits and masks joined)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    config = model.config
    coef = config.router_aux_loss_coef if config.output_router_logits else 0.0
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out: dict[str, list[float]] = {"losses": [], "aux": [], "grad_norms": []}
    for step in range(STEPS):
        per_rank = [moe_batches(step, rank) for rank in range(WORLD)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for mbs in per_rank for b in mbs)
        ce_total, aux_total = 0.0, 0.0
        for m in range(2):
            loss, logits_per_layer, masks = 0.0, None, []
            for mbs in per_rank:
                b = mbs[m]
                res = model(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    output_router_logits=bool(coef),
                )
                logits = res.logits[:, :-1].float()
                ce = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), b["labels"][:, 1:].reshape(-1), reduction="sum"
                )
                loss = loss + ce / tokens
                ce_total += float(ce)
                if coef:
                    layers = res.router_logits
                    logits_per_layer = (
                        [[x] for x in layers]
                        if logits_per_layer is None
                        else [acc + [x] for acc, x in zip(logits_per_layer, layers, strict=True)]
                    )
                    masks.append(b["attention_mask"].reshape(-1))
            if coef:
                joined = tuple(torch.cat(x) for x in logits_per_layer)
                aux = balance(joined, EXPERTS, config.num_experts_per_tok, torch.cat(masks)[None])
                loss = loss + coef * aux / 2
                aux_total += float(aux) / 2
            loss.backward()
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(ce_total / tokens)
        out["aux"].append(aux_total)
    return out


def _close(got: list[float], want: list[float], what: str) -> float:
    rel = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))
    assert rel <= 1e-4, (what, got, want)
    return rel


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_trains_like_flat_fsdp2_and_one_process(runs: tuple[Path, Path], family: str) -> None:
    models, out = runs
    result = _result(out, family)
    want = reference(models / family)
    router = MOE_FAMILIES[family][1]["output_router_logits"]
    figures = {}
    for layout in ("ep1", "ep2", "ep4"):
        run = result[layout]
        figures[layout] = (
            _close(run["losses"], want["losses"], f"{layout} losses"),
            _close(run["grad_norms"], want["grad_norms"], f"{layout} grad norms"),
        )
        if router:
            _close(run["aux"], want["aux"], f"{layout} router loss")
        else:
            assert run["aux"] == [None] * STEPS
        assert run["export"].startswith("verified"), run["export"]
        # The skew: no rank routed a token to experts 6 and 7; every rank routed some to the others.
        for rank, counts in enumerate(run["routed"]):
            assert [counts[e] for e in IDLE] == [0, 0], (layout, rank, counts)
    assert result["ep2"]["local_experts"] == 4 and result["ep4"]["local_experts"] == 2
    print(family, {k: f"loss {a:.1e} grad norm {b:.1e}" for k, (a, b) in figures.items()})


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_exports_equal_the_flat_runs(runs: tuple[Path, Path], family: str) -> None:
    models, out = runs
    flat = load_file(out / family / "export_ep1" / "model.safetensors")
    # The names transformers wrote the checkpoint with: one tensor per expert (gpt-oss: fused, as its checkpoints are).
    assert flat.keys() == load_file(models / family / "model.safetensors").keys()
    for layout in ("ep2", "ep4"):
        got = load_file(out / family / f"export_{layout}" / "model.safetensors")
        assert got.keys() == flat.keys()
        worst = max(float((got[k] - flat[k]).abs().max()) for k in flat)
        # AdamW moves a weight by at most ~lr per step; the layouts' rounding differs only in the last bits of the
        # gradients, so the weights agree far inside one step's movement.
        assert worst <= 1e-2 * LR, (layout, worst)
        for name in flat:
            if any(
                f".experts.{e}." in name for e in IDLE
            ):  # no gradient, no update: bit for bit (per-expert names)
                assert torch.equal(got[name], flat[name]), name


@pytest.mark.parametrize("family", RESUME)
def test_a_checkpoint_resumes_across_layouts(runs: tuple[Path, Path], family: str) -> None:
    _, out = runs
    result = _result(out, family)
    for saved, resumed in ((2, 1), (1, 2)):
        got = result[f"resume_ep{saved}_to_ep{resumed}"]
        _close(got["losses"], result[f"ep{resumed}"]["losses"][2:], f"resume ep{saved} -> ep{resumed}")
        _close(
            got["grad_norms"], result[f"ep{resumed}"]["grad_norms"][2:], f"resume ep{saved} -> ep{resumed}"
        )


def test_the_all_to_all_moves_what_the_formula_says(runs: tuple[Path, Path]) -> None:
    """One step of Qwen3-MoE (2 MoE layers, 2 micro-batches, no activation checkpointing, fp32): per rank and MoE layer
    and micro-batch, 3 exchanges in the forward (the counts, the tokens out, the results back) and 2 in the backward;
    over all ranks, ``layers x (4 x k x hidden x bytes x T + ranks x micro-batches x experts x 8)`` bytes go into
    ``all_to_all_single`` (T: the step's tokens of all ranks, padding included; each (token, choice) row out and back,
    forward and backward; the counts as int64)."""
    _, out = runs
    result = _result(out, "qwen3_moe")
    layers, micro, k, hidden = 2, 2, 2, 64
    for ep in (2, 4):
        counted = result[f"ep{ep}_counted"]
        assert all(calls == layers * micro * (3 + 2) for calls, _, _ in counted), counted
        tokens = sum(t for _, _, t in counted)
        want = layers * (4 * k * hidden * 4 * tokens + WORLD * micro * EXPERTS * 8)
        assert sum(b for _, b, _ in counted) == want, (ep, counted, want)
