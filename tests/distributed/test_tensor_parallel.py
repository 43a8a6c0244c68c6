"""Tensor parallel 2 x FSDP2 over 2 data ranks on 4 gloo processes (one mesh: dp_shard_cp x tp).

- Tensor parallel alone on 2 ranks (each tp group of the mesh, fp32) gives the whole model's loss and gradients, and
  issues torchtitan's collectives, counted with CommDebugMode: per decoder layer 2 all-gathers + 2 reduce-scatters
  forward and backward (before sequence parallel: 2 all-reduces forward and 5 backward, one per q/k/v/gate/up), the
  embedding split over the vocabulary (1 all-reduce), the head's input gathered once and, under the chunked loss,
  one [3 x chunk] all-gather per chunk (loss parallel). An eval forward of an odd length keeps the stream whole.
- The split model's loss and every gradient equal the whole model's in fp64 (Llama with GQA and an untied head on
  plain logits; Qwen3 with per-head q/k norms, a tied head and the chunked loss; Gemma3 with per-head norms, sliding
  window and soft-capped logits), and the library's clip reads the same gradient norm from the 2-D DTensors
  (tests/distributed/workers/tp_worker.py); the same under HSDP x TP (2 replica groups x 1 shard x tp 2, 3-D).
- bf16 compute with activation checkpointing none / full / selective under the sequence layout: the whole bf16
  model's loss and gradients, checkpointing bit for bit the same, and the collectives its recompute repeats.
- The SFT recipe with tp 2 x dp_shard 2 trains the losses, target counts and gradient norms of flat FSDP2 over 4 ranks
  on the same data-parallel batch (per_device_train_batch_size doubles as the data world halves; fp32, accumulation,
  chat data with unequal target counts; eval every 2 steps), on Llama and Qwen3, and exports a verified folder equal to
  the flat one.
- A checkpoint resumes across layouts: tp 2 x dp 2 -> flat 4 and flat 4 -> tp 2 x dp 2 give the uninterrupted losses;
  `hf-fsdp2 export` of a tp 2 x dp 2 checkpoint (one process, from its 2-D DCP shards) equals the run's own export.
MoE families are refused (their plan's expert styles have no torch equivalent): tests/unit/test_tp_settings.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.count_formulas import tp_step_collectives
from support.families import make_family_dir
from support.launch import REPO, SFT, python, torchrun
from support.tiny import write_chat_jsonl

from hf_fsdp2.observe.logs import read_metrics

pytestmark = pytest.mark.four_procs
WORKER = Path(__file__).parent / "workers" / "tp_worker.py"
STEPS = 4
# Gradient norms in fp32: flat FSDP2 over 4 ranks itself moves this tiny model's norm from one process's by up to
# 2.5e-4 relative by step 4 (measured on llama3_untied: 5.1e-5, 1.5e-4, 2.0e-4, 2.5e-4 at steps 1-4; its gradients
# are sums with heavy cancellation, and AdamW's first steps amplify their rounding); tensor parallel reduces in yet
# another order (measured 1.6e-5 .. 8.9e-5 from flat on both families). Twice flat's own deviation bounds it; the fp64 worker shows
# the split itself exact (6e-16).
GRAD_NORM_RTOL = 5e-4
RESUMED = "llama3_untied"  # the family whose checkpoints the resume and offline-export tests read


LAYERS, CHUNK = 2, 8  # the worker's models and the chunked case's chunk rows


def training_collectives(chunks: int) -> tuple[dict[str, int], dict[str, int]]:
    """A training forward's and its backward's collectives over tp for a model of :data:`LAYERS` decoder layers
    (``chunks``: the chunked loss's chunks; 0: plain logits).

    Forward: per layer one all-gather into attention and one into the MLP, one reduce-scatter out of each; the
    vocabulary-split embedding's all-reduce; the head's input all-gathered; the logits gathered (plain), or one
    ``[3 x chunk]`` all-gather per chunk and the one-position logits the head itself still computes (chunked).
    Backward: each forward all-gather's reduce-scatter and each reduce-scatter's all-gather, per layer; the head
    input's reduce-scatter; the first layer's input gradient gathered back to the whole (replicated) embedding output.
    """
    head = chunks + 1 if chunks else 1
    forward = {"all_gather": 2 * LAYERS + 1 + head, "reduce_scatter": 2 * LAYERS, "all_reduce": 1}
    backward = {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS + 1}
    return forward, backward


def test_tp_x_fsdp2_gives_the_whole_models_loss_and_gradients_in_fp64(tmp_path: Path) -> None:
    torchrun(WORKER, [str(tmp_path)], nproc=4)
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert len(ranks) == 4
    for results in ranks:
        assert set(results) == {
            "llama_gqa_untied_plain",
            "qwen3_qk_norm_tied_chunked",
            "gemma3_qk_norm_sliding_softcap_plain",
            "llama_fp8_tensorwise",
            "llama_hsdp_tp",
            "llama_bf16_checkpointed",
        }
        # HSDP x TP (2 replica groups x 1 shard x tp 2) in fp64: the whole model's loss, gradients and clip norm
        # (measured 4e-16), parameters on the 3-D mesh.
        hsdp = results.pop("llama_hsdp_tp")
        assert "error" not in hsdp, hsdp.get("error")
        for got, want in (hsdp["loss"], hsdp["norm"]):
            assert abs(got - want) <= 1e-12 * abs(want), hsdp
        assert hsdp["grad_rel"] <= 1e-12, hsdp["grad_rel"]
        placements = hsdp["placements"]
        assert (
            placements["model.layers.0.self_attn.o_proj.weight"]
            == "(Replicate(), Shard(dim=0), Shard(dim=1))"
        )
        assert placements["model.norm.weight"] == "(Replicate(), Shard(dim=0), Replicate())"
        # bf16 compute (fp32 master weights and reductions) with each checkpointing mode, tp 2 x FSDP2 2: the whole
        # bf16 model's loss (measured 1.2e-5 relative) and gradients (1.3e-2 of each tensor's largest entry: a few
        # bf16 roundings; a layout that lost or doubled a share would be off by 0.5 or more); checkpointing changes
        # nothing (the same bf16 operations recomputed: bit for bit), and its backward repeats, per layer, the two
        # all-gathers into attention and the MLP and (full) attention's reduce-scatter, whose output the residual
        # stream needs (the checkpoint's recompute stops at the MLP's down projection, its last saved input);
        # selective keeps the reduce-scatter's output (before: re-ran it, 1 per layer).
        bf16 = results.pop("llama_bf16_checkpointed")
        assert "error" not in bf16, bf16.get("error")
        none = bf16["none"]
        assert abs(none["loss"] - bf16["want"]) <= 1e-3 * bf16["want"], bf16
        assert none["grad_rel"] <= 5e-2, bf16
        kinds = ("all_gather", "reduce_scatter", "all_reduce")
        for mode, reduce_scatters in (("full", LAYERS), ("selective", 0)):
            assert bf16[mode]["loss"] == none["loss"] and bf16[mode]["grad_diff"] == 0.0, (mode, bf16)
            recomputed = {k: bf16[mode]["backward"].get(k, 0) - none["backward"].get(k, 0) for k in kinds}
            assert recomputed == {
                "all_gather": 2 * LAYERS,
                "reduce_scatter": reduce_scatters,
                "all_reduce": 0,
            }, (
                mode,
                bf16,
            )
        # The whole forward and backward (tp and FSDP2 alike) is the GPU check's formula less the step's own 3
        # all-reduces (bench/gpu_bench_parallel.py's tp_counts; tests/support/count_formulas.py).
        for mode in ("none", "full"):
            r = bf16[mode]
            got = {k: r["forward"].get(k, 0) + r["backward"].get(k, 0) for k in kinds}
            want = tp_step_collectives(LAYERS, -(-r["targets"] // CHUNK), mode)
            assert got == {**want, "all_reduce": want["all_reduce"] - 3}, (mode, got, want)
        fp8 = results.pop("llama_fp8_tensorwise")
        assert "error" not in fp8, fp8.get("error")
        # FP8 under TP (emulated tensorwise float8, the float8 styles, float8 on the wire as gloo bytes): the whole FP8
        # model's loss and gradients (the same scales: each amax is reduced over the tp ranks), the bf16 layout's
        # all-gathers and reduce-scatters, of which the block inputs (forward) and the row-parallel output gradients
        # (backward) in float8: 4 per layer; the all-reduces add the amaxes of split tensors.
        got, want = fp8["loss"]
        assert abs(got - want) <= 1e-5 * abs(want) and fp8["grad_rel"] <= 1e-4, fp8
        forward, backward = training_collectives(-(-fp8["targets"] // CHUNK))
        for kind in ("all_gather", "reduce_scatter"):
            assert fp8["collectives"][kind] == forward.get(kind, 0) + backward.get(kind, 0), fp8[
                "collectives"
            ]
        assert fp8["float8_all_gathers"] == 4 * LAYERS, fp8
        for case, r in results.items():
            assert "error" not in r, r.get("error")
            # fp64: rounding only. Gemma's RMSNorm computes in fp32 whatever the dtype: its gradients carry fp32
            # rounding (measured 1.9e-7), as in tests/distributed/test_context_parallel.py.
            tol = 2e-6 if "gemma" in case else 1e-12
            got, want = r["loss"]
            assert abs(got - want) <= tol * abs(want), case
            assert r["grad_rel"] <= tol, (case, r["grad_rel"])
            norm, ref_norm = r["norm"]
            assert abs(norm - ref_norm) <= tol * ref_norm, case
            # Split layers: (data shard, tp shard); everything else replicated over tp.
            assert r["placements"]["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
            assert r["placements"]["model.norm.weight"] == "(Shard(dim=0), Replicate())"
            alone = r["tp_alone"]
            # fp32: the split adds in another order (measured: losses to 3e-8, gradients to 2e-6 relative).
            for got, want in (alone["loss"], alone["odd_loss"]):
                assert abs(got - want) <= 1e-5 * abs(want), case
            assert alone["grad_rel"] <= 1e-4, (case, alone["grad_rel"])
            chunks, odd_chunks = (-(-n // CHUNK) if "chunked" in case else 0 for n in alone["targets"])
            forward, backward = training_collectives(chunks)
            assert alone["forward"] == forward, (case, alone["forward"])
            assert alone["backward"] == backward, (case, alone["backward"])
            # Eval: the stream whole, so one all-reduce per block and the embedding's; the head gathers no input.
            gathers = odd_chunks + 1 if odd_chunks else 1
            assert alone["eval_forward"] == {"all_reduce": 2 * LAYERS + 1, "all_gather": gathers}, case
    assert "4 replicated_with_grad_allreduce" in ranks[0]["qwen3_qk_norm_tied_chunked"]["line"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, str]]:
    """``run(family, tp, *extra)``: the 4-rank SFT run of a tiny ``family`` model, flat (tp=1, 2 rows per rank) or
    tp 2 x dp_shard 2 (4 rows per rank: the same data-parallel batch); each run once per module. Returns its folder
    and log. Only :data:`RESUMED`'s uninterrupted runs save checkpoints (at 2 and 4): no test reads another. Only the tp
    runs verify their export: the tests read the flat runs' exported weights, never their verification's line."""
    root = tmp_path_factory.mktemp("tp")
    data = write_chat_jsonl(root / "chat.jsonl", 64, seed=5)
    done: dict[tuple, tuple[Path, str]] = {}

    def launch(family: str, tp: int, *extra: str, out: Path | None = None) -> tuple[Path, str]:
        key = (family, tp, *extra)
        if out is None and key in done:
            return done[key]
        model = root / family
        if not model.exists():
            make_family_dir(model, family, seed=3)
        folder = out or root / f"{family}-tp{tp}"
        args = [
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(folder),
            "--max_steps",
            str(STEPS),
            "--per_device_train_batch_size",
            str(2 * tp),
            "--gradient_accumulation_steps",
            "2",
            "--max_length",
            "64",
            "--mixed_precision",
            "no",
            "--logging_steps",
            "1",
            "--learning_rate",
            "1e-3",
            "--train_sampling_strategy",
            "sequential",
            "--eval_split_fraction",
            "0.25",
            "--eval_steps",
            "2",
            "--tp_size",
            str(tp),
            *extra,
        ]
        # Checkpoints at 2 and 4 where a test reads them; else none (a run saves at its last step by default).
        args += ["--save_steps", "2" if out is None and family == RESUMED else "0"]
        if tp == 1 and out is None:
            args += ["--export_verify", "false"]
        proc = torchrun(SFT, args, nproc=4)
        result = (folder, proc.stdout + proc.stderr)
        if out is None:
            done[key] = result
        return result

    return launch


def _same(got: Path, want: Path, steps: list[int]) -> None:
    """Losses and eval losses within 1e-5 relative (measured: 6e-8), target, processed and eval token counts equal
    (a tensor-parallel group's batch counted once), gradient norms within :data:`GRAD_NORM_RTOL`."""
    by_step = {r["step"]: r for r in read_metrics(got / "metrics.jsonl")}
    ref = {r["step"]: r for r in read_metrics(want / "metrics.jsonl")}
    for step in steps:
        assert by_step[step]["target_tokens"] == ref[step]["target_tokens"], step
        assert by_step[step]["tokens"] == ref[step]["tokens"], step
        assert by_step[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert by_step[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=GRAD_NORM_RTOL), step
        if step % 2 == 0:  # eval every 2 steps
            assert by_step[step]["eval_tokens"] == ref[step]["eval_tokens"], step
            assert by_step[step]["eval_loss"] == pytest.approx(ref[step]["eval_loss"], rel=1e-5), step


@pytest.mark.parametrize(("family", "plan"), [("llama3_untied", "llama"), ("qwen3", "qwen3")])
def test_tp2_x_dp2_trains_like_flat_fsdp2_over_4_ranks_and_exports_the_same_model(
    run: Callable[..., tuple[Path, str]], family: str, plan: str
) -> None:
    flat, _ = run(family, 1)
    out, log = run(family, 2)
    assert "device mesh: flat FSDP2 over 2 ranks; tensor parallel 2" in log
    assert (
        f"tensor parallel 2 ({plan}'s base_model_tp_plan through torch DTensor styles, sequence parallel"
        in log
    )
    assert "loss parallel under the chunked loss" in log
    # The embedding split over the vocabulary across tp, and each part over the data ranks (FSDP2's strided shard).
    assert (
        "model.embed_tokens.weight (_StridedShard(dim=0, sf=2), Shard(dim=0)) on mesh (dp_shard_cp=2, tp=2)"
        in log
    )
    assert "fsdp_cpu_ram_efficient_loading=false (tp_size=2" in log
    assert "export verified" in log
    _same(out, flat, list(range(1, STEPS + 1)))
    # fp32 master weights after 4 AdamW steps differ by reduction order only; the bf16 exports agree to one bf16
    # rounding step (2^-7 relative; measured: 7 of 21 tensors bit-equal, the largest difference 2.4e-4).
    got, want = load_file(out / "model.safetensors"), load_file(flat / "model.safetensors")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=2**-7, atol=1e-6)


def test_checkpoints_resume_across_layouts(run: Callable[..., tuple[Path, str]], tmp_path: Path) -> None:
    """DCP reshards on load: tp 2 x dp 2's checkpoint-2 resumes as flat FSDP2 over 4 ranks, and flat's as tp 2 x dp 2;
    steps 3 and 4 give the uninterrupted runs' losses."""
    flat, _ = run(RESUMED, 1)
    tp, _ = run(RESUMED, 2)
    for source, layout in ((tp, 1), (flat, 2)):
        out = tmp_path / f"from-tp{3 - layout}-to-tp{layout}"
        out.mkdir()
        (out / "checkpoint-2").symlink_to(source / "checkpoint-2", target_is_directory=True)
        (out / "latest").write_text("2\n")
        _, log = run(
            RESUMED, layout, "--resume_from_checkpoint", "latest", "--export_verify", "false", out=out
        )
        assert "resumed from" in log and "at step 2" in log
        _same(out, flat if layout == 1 else tp, [3, 4])


def test_the_offline_export_of_a_tp_checkpoint_equals_the_runs_export(
    run: Callable[..., tuple[Path, str]], tmp_path: Path
) -> None:
    tp, _ = run(RESUMED, 2)
    proc = python(
        REPO / "hf_fsdp2" / "cli.py", ["export", str(tp / "checkpoint-4"), str(tmp_path / "offline")]
    )
    assert "export verified" in proc.stdout + proc.stderr
    got, want = load_file(tmp_path / "offline" / "model.safetensors"), load_file(tp / "model.safetensors")
    assert got.keys() == want.keys()
    for key in want:  # the same fp32 master weights, rounded once: bit for bit
        assert torch.equal(got[key], want[key]), key
