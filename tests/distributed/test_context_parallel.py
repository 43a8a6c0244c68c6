"""Context parallel (all-to-all) on 4 gloo processes.

- The attention parts equal the whole-sequence model (fp64) on Llama (GQA, sdpa and eager), Qwen3 (one KV head,
  repeated), Gemma2 (sliding window, soft-capped logits) and Mixtral (MoE), packed and padded, for cp 4 and for two
  cp-2 groups holding different batches; and Llama's two rows of different documents under a flash kernel
  (transformers' flash code, a stand-in flash-attn) equal the whole model under sdpa's block-diagonal mask.
- The SFT recipe with cp 2 x dp_shard 2 trains the losses of flat FSDP2 over 4 ranks and of one process (fp32,
  accumulation, chat data whose target counts change every step), exports the same model, and resumes a flat
  checkpoint.
- Continued pre-training of rows of 2,048 tokens packed from several documents on a Qwen3-MoE model, with activation
  checkpointing, the chunked loss and LoRA: cp 2 x dp_shard 2 equals flat FSDP2 over 4 ranks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.families import make_family_dir
from support.flat_reference import NO_CHECKPOINT, STEPS, FlatReference, flat_reference, sft_args
from support.launch import REPO, SFT, torchrun
from support.tiny import WORDS, write_pairs_jsonl

from hf_fsdp2.observe.logs import read_metrics

pytestmark = pytest.mark.four_procs
WORKER = Path(__file__).parent / "workers" / "cp_attention_worker.py"
CPT = REPO / "recipes" / "cpt.py"
DPO = REPO / "recipes" / "dpo.py"


def test_attention_parts_equal_the_whole_sequence_on_every_family(tmp_path: Path) -> None:
    torchrun(WORKER, [str(tmp_path)], nproc=4)
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert len(ranks) == 4 and all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    for results in ranks:
        assert len(results) == 14  # 6 cases x (cp 4, cp 2), 2 of them again with flex attention's block mask
        for case, r in results.items():
            got, want = r["loss"]
            # fp64: rounding only. Gemma2's RMSNorm computes in fp32 whatever the dtype (its norm weights' gradients
            # carry fp32 rounding, ~1e-7); the MoE model runs in fp32 (torch's grouped_mm has no fp64).
            tol = 1e-12 if r["dtype"] == "torch.float64" and "gemma2" not in case else 2e-6
            assert r["tokens"][0] == r["tokens"][1], case  # the parts' target counts sum to the batch's
            assert abs(got - want) <= tol * abs(want), case
            assert r["grad_rel"] <= tol, (case, r["grad_rel"])
            assert r["whole_sequences_diff"] == 0.0, case  # samples: the model's own kernel, untouched
            # Flash: each rank's kernel ran over both whole rows (padded to 24), every document apart.
            if "flash" in case:
                assert r["flash_kinds"] == ["varlen"], case
                assert r["cu_seqlens"] == [[0, 9, 17, 23, 24, 28, 40, 47, 48]], case
        for case in ("llama_gqa_sdpa_packed/cp2", "gemma2_sliding_softcap_packed/cp2"):
            dense, block = results[case], results[f"{case}/block"]
            # Today's CPU path: one dense [rows, 1, S, S] bool mask per layer (eager adds an additive copy in the
            # compute dtype; S = 24: 23 tokens padded to a multiple of cp).
            assert [m["kind"] for m in dense["masks"]] == ["dense", "dense"], case
            assert all(m["shape"] == [2, 1, 24, 24] and m["bytes"] == 2 * 24 * 24 for m in dense["masks"]), (
                case
            )
            # The block mask: no dense mask in any layer; what each holds is the formula's (2 rows of 24 positions:
            # one 128-position tile, four int32 tile lists and counts, and the int64 document ids).
            assert [m["kind"] for m in block["masks"]] == ["block", "block"], case
            for mask in block["masks"]:
                assert mask["bytes"] == mask["formula"] == 4 * 4 * 2 * 1 * 2 + 8 * 2 * 24, (case, mask)
            # The dense mask's loss, and gradients within the bound both hold to the whole model's (so within twice
            # it of each other): fp64, Gemma2's norms in fp32 (measured: loss 4.6e-10, gradients 3.5e-7 relative).
            tol = 2e-6 if "gemma2" in case else 1e-12
            assert abs(block["loss"][0] - dense["loss"][0]) <= tol * abs(dense["loss"][0]), case
            assert block["grad_rel"] <= tol and dense["grad_rel"] <= tol, (case, block["grad_rel"])
    lines = {case: r["line"] for case, r in ranks[0].items()}
    assert "repeated 4x before the all-to-all" in lines["qwen3_one_kv_head_packed/cp4"]
    assert "around the eager kernel" in lines["gemma2_sliding_softcap_packed/cp2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> FlatReference:
    """The tiny Llama, its chat data, flat FSDP2 over 4 ranks and one process: the same two runs as
    tests/distributed/test_hsdp.py compares against, made once per session (tests/support/flat_reference.py)."""
    return flat_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def assets(reference: FlatReference) -> tuple[Path, Path]:
    return reference.model, reference.data


def _args(assets: tuple[Path, Path], out: Path, batch: int, *extra: str) -> list[str]:
    return sft_args(*assets, out, batch, *extra)


def _same(got: list[dict], want: list[dict], steps: list[int], single: list[dict] | None = None) -> None:
    """Losses within 1e-5 relative, target counts equal; gradient norms within twice what flat FSDP2 itself deviates
    from one process (fp32 reduction order; tests/distributed/test_hsdp.py measured it)."""
    by_step, ref = {r["step"]: r for r in got}, {r["step"]: r for r in want}
    alone = {r["step"]: r for r in single or want}
    for step in steps:
        assert by_step[step]["target_tokens"] == ref[step]["target_tokens"], step
        assert by_step[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        envelope = max(
            2 * abs(ref[step]["grad_norm"] - alone[step]["grad_norm"]), 2e-6 * ref[step]["grad_norm"]
        )
        assert abs(by_step[step]["grad_norm"] - ref[step]["grad_norm"]) <= envelope, (step, envelope)


@pytest.fixture(scope="module")
def flat(reference: FlatReference) -> Path:
    """Flat FSDP2 over 4 ranks, 2 examples per rank per micro-batch, checkpoints at 2 and 4."""
    return reference.flat


@pytest.fixture(scope="module")
def single(reference: FlatReference) -> list[dict]:
    """One process, the same global micro-batches (8 examples each): the reference for float noise."""
    return reference.single


def test_cp2_x_dp2_trains_like_flat_fsdp_over_4_ranks_and_exports_the_same_model(
    assets, flat, single, tmp_path: Path
) -> None:
    out = tmp_path / "cp"
    # 2 data-parallel ranks: 4 examples each per micro-batch, the flat run's 8 in all.
    proc = torchrun(SFT, _args(assets, out, 4, "--cp_size", "2", *NO_CHECKPOINT), nproc=4)
    log = proc.stdout + proc.stderr
    assert "context parallel 2 (all_to_all): each sequence split over 2 ranks, 2 data-parallel ranks" in log
    assert "context parallel: all-to-all over 2 ranks around the sdpa kernel" in log
    assert "export verified" in log
    _same(
        read_metrics(out / "metrics.jsonl"),
        read_metrics(flat / "metrics.jsonl"),
        list(range(1, STEPS + 1)),
        single,
    )
    # fp32 master weights after 4 AdamW steps differ by reduction order only; the bf16 exports agree to one bf16
    # rounding step (2^-7 relative), as HSDP's do.
    got, want = load_file(out / "model.safetensors"), load_file(flat / "model.safetensors")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=2**-7, atol=1e-6)


def test_a_flat_checkpoint_resumes_with_context_parallel(assets, flat, single, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    out.mkdir()
    (out / "checkpoint-2").symlink_to(flat / "checkpoint-2", target_is_directory=True)
    (out / "latest").write_text("2\n")
    proc = torchrun(
        SFT,
        _args(
            assets,
            out,
            4,
            "--cp_size",
            "2",
            "--resume_from_checkpoint",
            "latest",
            "--export_verify",
            "false",
            *NO_CHECKPOINT,
        ),
        nproc=4,
    )
    assert "resumed from" in proc.stdout + proc.stderr
    _same(read_metrics(out / "metrics.jsonl"), read_metrics(flat / "metrics.jsonl"), [3, 4], single)


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Documents of 150 to 900 words (each word a token or two): every 2,048-token row packs several of them."""
    root = tmp_path_factory.mktemp("cp_long")
    rng = random.Random(7)
    docs = root / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(150, 900)))}) + "\n"
            for _ in range(70)
        )
    )
    # Qwen3-MoE without its router loss (refused under cp: each rank would see part of the token fractions).
    model = make_family_dir(
        root / "model",
        "qwen3_moe",
        seed=3,
        overrides={"output_router_logits": False, "max_position_embeddings": 2048},
    )
    return model, docs


def _cpt_args(corpus: tuple[Path, Path], out: Path, batch: int, *extra: str) -> list[str]:
    model, docs = corpus
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(docs),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        str(batch),
        "--gradient_accumulation_steps",
        "2",
        "--max_length",
        "2048",
        "--cross_document_attention",
        "false",
        "--mixed_precision",
        "no",
        "--logging_steps",
        "1",
        "--learning_rate",
        "1e-3",
        "--activation_checkpointing",
        "full",
        "--ce_chunk_tokens",
        "512",
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        "--lora_dropout",
        "0",
        "--export_verify",
        "false",
        *NO_CHECKPOINT,
        *extra,
    ]


def test_packed_rows_of_2048_tokens_over_several_documents_with_ac_chunked_loss_and_lora(
    long_corpus, tmp_path: Path
) -> None:
    torchrun(CPT, _cpt_args(long_corpus, tmp_path / "flat", 1), nproc=4)
    # Under expert parallel too (ep 2 over the cp x dp_shard ranks: each rank 2 of the 4 experts of each layer, the
    # tokens of its part of every row exchanged): CPT's packed rows through the recipe, with context parallel.
    proc = torchrun(
        CPT, _cpt_args(long_corpus, tmp_path / "cp", 2, "--cp_size", "2", "--ep_size", "2"), nproc=4
    )
    log = proc.stdout + proc.stderr
    assert "context parallel: all-to-all over 2 ranks" in log
    assert "expert parallel 2: 2 experts modules (Qwen3MoeExperts)" in log, log[-3000:]
    got, want = (
        read_metrics(tmp_path / "cp" / "metrics.jsonl"),
        read_metrics(tmp_path / "flat" / "metrics.jsonl"),
    )
    assert [r["target_tokens"] for r in got] == [r["target_tokens"] for r in want]
    assert all(r["target_tokens"] > 4 * 2 * 2000 for r in want)  # 8 full rows of 2,048 per step (2 steps)
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), g["step"]


@pytest.mark.slow
def test_tp2_x_cp2_x_dp2_on_8_ranks_trains_like_flat_fsdp(assets, flat, single, tmp_path: Path) -> None:
    """Tensor, context and data parallel together, once: 8 gloo processes (2 tensor-parallel ranks per context-parallel
    rank, 2 of those per data rank, 2 data ranks reading 4 examples each: the flat run's 8 per micro-step)."""
    out = tmp_path / "tpcp"
    proc = torchrun(
        SFT,
        _args(assets, out, 4, "--tp_size", "2", "--cp_size", "2", "--export_verify", "false", *NO_CHECKPOINT),
        nproc=8,
    )
    log = proc.stdout + proc.stderr
    assert "context parallel 2 (all_to_all)" in log and "tensor parallel 2" in log
    # 4 heads / tp 2 = 2 per tensor-parallel rank, 1 per context-parallel rank; 1 KV head per tp rank, repeated.
    assert "1 query heads and 1 key/value heads per rank" in log and "repeated 2x" in log
    _same(
        read_metrics(out / "metrics.jsonl"),
        read_metrics(flat / "metrics.jsonl"),
        list(range(1, STEPS + 1)),
        single,
    )


@pytest.fixture(scope="module")
def pairs(assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pairs_jsonl(tmp_path_factory.mktemp("cp_pairs") / "pairs.jsonl", 48, seed=3)


def _dpo_args(model: Path, data: Path, out: Path, batch: int, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
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
        "--logging_steps",
        "1",
        "--learning_rate",
        "1e-3",
        "--train_sampling_strategy",
        "sequential",
        "--export_verify",
        "false",
        "--eval_split_fraction",
        "0.25",
        "--eval_steps",
        "3",
        *NO_CHECKPOINT,
        *extra,
    ]


def _abs_tolerance(key: str, logged: dict) -> float:
    """The absolute tolerance of one logged value of the cp run against the flat run's.

    A DPO reward is beta x (policy log-prob sum - reference log-prob sum), and a margin the difference of two: four
    fp32 sums of completion log-probs in all, each summed in another order by the parts than by the whole rows. A sum
    S of fp32 terms, added in a different order, moves by up to a few ulps of |S| (8 x eps32 x |S| is taken here), so a
    margin of 0.005 over log-prob sums in the hundreds can move by 1e-6 with nothing wrong (measured: 1.01e-6 at step 2
    with the packages a fresh set-up installed on 2026-12-06, where the same tree had passed at 1e-6 before). A pair
    counted twice or lost moves a margin by a whole fraction of itself. Every other value: 1e-6.
    """
    if not key.startswith("rewards/") or "accuracies" in key:
        return 1e-6
    beta = 0.1  # the runs' DPO beta (the recipe's default)
    largest = max(abs(logged["logps/chosen"]), abs(logged["logps/rejected"]))
    return max(1e-6, 4 * beta * 8 * torch.finfo(torch.float32).eps * largest)


@pytest.mark.parametrize(
    ("flat_extra", "cp_extra"),
    [
        # DPO: the flat run's live reference forward against the cp run's precomputed table (both through the
        # parts: the table is written once per cp group).
        ((), ("--precompute_ref_log_probs", "true")),
        # ORPO: reference-free, its NLL over the chosen rows' whole sequences (the second label set, cut alike).
        (("--loss_type", "orpo"), ("--loss_type", "orpo")),
    ],
    ids=["dpo", "orpo"],
)
def test_preference_pairs_split_over_2_ranks_train_like_whole_pairs(
    assets, pairs, tmp_path: Path, flat_extra: tuple, cp_extra: tuple
) -> None:
    model = assets[0]
    torchrun(DPO, _dpo_args(model, pairs, tmp_path / "flat", 2, *flat_extra), nproc=2)
    proc = torchrun(DPO, _dpo_args(model, pairs, tmp_path / "cp", 4, "--cp_size", "2", *cp_extra), nproc=2)
    assert "context parallel: all-to-all over 2 ranks" in proc.stdout + proc.stderr
    got, want = (
        read_metrics(tmp_path / "cp" / "metrics.jsonl"),
        read_metrics(tmp_path / "flat" / "metrics.jsonl"),
    )
    assert len(got) == len(want) and any("eval_loss" in r for r in want)
    for g, w in zip(got, want, strict=True):
        # Every logged mean (loss, rewards, log-probs, accuracies, margins, NLL, eval) and count: the pairs counted
        # once per cp group, not cp_size times.
        assert g.keys() == w.keys()
        for key, value in w.items():
            # Not compared: timings, rates, memory (machine state) and padding (parts pad to a multiple of cp_size).
            skip = ("_s", "per_s", "per_device", "mfu", "gib", "padding", "eta")
            if not isinstance(value, float | int) or any(part in key for part in skip):
                continue
            assert value == pytest.approx(g[key], rel=1e-5, abs=_abs_tolerance(key, w)), (g["step"], key)
