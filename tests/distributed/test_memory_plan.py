"""The memory plan against what real FSDP2 runs hold, at world 1, 2 and 4 on CPU (gloo).

Two model shapes (a tiny Llama with untied head and chunked cross entropy; a tiny Qwen3 with tied embeddings,
QK norms and the plain loss), every activation-checkpointing mode. Per rank: sharded parameter, gradient and
AdamW bytes predicted from the config must equal the storages the rank holds after a step, exactly (uneven
chunks included: vocab 2098 is not a multiple of 4); activations and loss bytes predicted by the meta forward
must equal what ``SavedTensorMeter`` counts on the real sharded run (a plan within 10% would do; on CPU the same
kernels run, so the test holds them to equality). A 3-row linear layer at world 4 leaves rank 3 an empty chunk.

The same for adapters over a frozen base, wrapped as a run wraps them: QLoRA (the decoder linears in NF4, sharded by
FSDP2 with their scales; a wider tiny Llama so that every weight splits over 4 ranks) and QDoRA on the tied Qwen3.
World 1 is the one-GPU QLoRA run, whose FSDP2 unshard path differs (no all-gather). Context parallel: cp 2 over 2
ranks (the run's all-to-all attention, half of each sequence per rank) against the plan with cp_size 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.families import make_family_dir
from support.launch import torchrun
from support.tiny import make_tiny_llama_dir
from transformers import AutoConfig

from hf_fsdp2.config.plans import ACPlan, LoraSettings
from hf_fsdp2.plan import (
    PlanSettings,
    build_meta_model,
    compute_bytes,
    shard_rows,
    state_bytes,
)

WORKER = Path(__file__).parent / "workers" / "memory_plan_worker.py"
MODES = ("none", "full", "every_k", "selective", "offload")
# name -> (micro-batch, sequence length, ce_chunk_tokens). The bytes are compared exactly, so any length shows a
# wrong count; 32 and 24 (not 64 and 48: half the forward and backward of every rank and mode) keep a batch of 2,
# one length a multiple of 4 (cp 2 splits it in 2 x 2 parts) and one not a power of 2, and the chunked and plain loss.
SHAPES = {"llama": (2, 32, 1024), "qwen3": (2, 24, 0)}
# name -> (model, micro-batch, sequence length, ce_chunk_tokens, adapter as the worker wraps it: LoRA r=8)
ADAPTERS = {"qlora": ("llama_wide", 2, 32, 1024, "qlora"), "qdora": ("qwen3_wide", 2, 24, 0, "qdora")}
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan_models")
    return {
        "llama": make_tiny_llama_dir(root / "llama", seed=1),
        "qwen3": make_family_dir(root / "qwen3", "qwen3"),
        "llama_wide": make_family_dir(root / "llama_wide", "llama3_untied", overrides=WIDE),
        "qwen3_wide": make_family_dir(root / "qwen3_wide", "qwen3", overrides={**WIDE, "head_dim": 64}),
    }


def _measure(models: dict[str, Path], out: Path, world: int) -> list[dict]:
    specs = [f"{name}={models[name]}:{b}:{s}:{c}" for name, (b, s, c) in SHAPES.items()]
    adapters = [f"{name}={models[m]}:{b}:{s}:{c}:{a}" for name, (m, b, s, c, a) in ADAPTERS.items()]
    torchrun(
        WORKER, ["--models", *specs, "--adapters", *adapters, "--out", str(out)], nproc=world, timeout=300
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check(models: dict[str, Path], measured: list[dict], world: int) -> None:
    cases = {name: (name, b, s, c, "") for name, (b, s, c) in SHAPES.items()} | ADAPTERS
    for name, (model, batch, seq, chunk, adapter) in cases.items():
        config = AutoConfig.from_pretrained(models[model])
        lora = LoraSettings(r=8, use_dora="dora" in adapter) if adapter else None
        for mode in MODES:
            settings = PlanSettings(
                world_size=world,
                micro_batch=batch,
                seq_len=seq,
                ac=ACPlan(mode, every_k=2, pin_memory=False),
                mixed_precision="bf16",
                ce_chunk_tokens=chunk,
                device_type="cpu",
                lora=lora,
                load_in_4bit=adapter.startswith("q"),
            )
            meta = build_meta_model(config, settings)
            compute = compute_bytes(config, settings)
            for rank in range(world):
                got = measured[rank]["models"][name][mode]
                assert got["chunk"] == chunk, (name, mode)  # the real run took the planned loss path
                want = state_bytes(meta, settings, rank)
                where = f"{name} {mode} world {world} rank {rank}"
                assert (want["params"], want["grads"], want["optimizer"]) == (
                    got["params"],
                    got["grads"],
                    got["optimizer"],
                ), where
                assert (compute.saved.activations, compute.saved.loss) == (got["activations"], got["loss"]), (
                    where
                )
    for rank in range(world):  # Linear(8 -> 3) sharded alone, fp32: chunks of ceil(3 / world) rows
        probe = measured[rank]["probe"]
        held, padded = shard_rows(3, world, rank)
        assert probe["weight_rows"] == held
        assert probe["params"] == probe["grads"] == padded * 8 * 4 + padded * 4
        assert probe["optimizer"] == 2 * (held * 8 * 4 + held * 4) + 2 * 4


def test_world_1_and_2_match_the_plan_exactly(models, tmp_path: Path):
    measured_by_world = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        out.mkdir()
        measured = measured_by_world[world] = _measure(models, out, world)
        assert all(m["world"] == world for m in measured)
        _check(models, measured, world)
    # The activations differ by mode as the modes say (the plan is not flat): full keeps least, none most.
    acts = {mode: measured[0]["models"]["llama"][mode]["activations"] for mode in MODES}
    assert acts["offload"] < acts["full"] < acts["selective"] < acts["every_k"] < acts["none"]
    acts = {mode: measured[0]["models"]["qlora"][mode]["activations"] for mode in MODES}
    assert acts["offload"] < acts["full"] < min(acts["selective"], acts["every_k"]) <= acts["none"]
    # The 4-bit base: each of 2 ranks holds half of what world 1 holds of the NF4 weights (exactly: even splits,
    # plus each weight's own 16-entry table and scale mean), and the adapter's gradients are halved too.
    one, two = (measured_by_world[w][0]["models"]["qlora"]["none"] for w in (1, 2))
    assert two["grads"] * 2 == one["grads"] and two["params"] < one["params"] * 0.51


@pytest.mark.four_procs
def test_world_4_matches_the_plan_exactly_uneven_and_empty_chunks(models, tmp_path: Path):
    measured = _measure(models, tmp_path, 4)
    _check(models, measured, 4)
    # vocab 2098 rows in chunks of 525: rank 3 holds 523 rows, so its AdamW state is smaller.
    optimizer = [measured[r]["models"]["llama"]["none"]["optimizer"] for r in range(4)]
    assert optimizer[0] == optimizer[1] == optimizer[2] > optimizer[3]
    assert measured[3]["probe"]["weight_rows"] == 0  # rank 3 holds nothing of the probe, yet a padded buffer


def test_context_parallel_world_2_matches_the_plan(models, tmp_path: Path):
    """cp_size 2 over 2 ranks (the all-to-all backend, as the run's build_model and step apply it): each rank runs
    half of each sequence, its attention over the whole sequence with half the heads. The plan's sharded state (over
    dp_shard 1 x cp 2) and the meta forward's activations and loss (the run's cp_attention, the all-to-all a local
    copy) equal what the real run holds and saves."""
    batch, seq, chunk = SHAPES["llama"]
    spec = f"llama={models['llama']}:{batch}:{seq}:{chunk}"
    torchrun(WORKER, ["--models", spec, "--cp", "2", "--out", str(tmp_path)], nproc=2, timeout=300)
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    config = AutoConfig.from_pretrained(models["llama"])
    flat = {}
    for mode in MODES:
        settings = PlanSettings(
            world_size=2,
            cp=2,
            micro_batch=batch,
            seq_len=seq,
            ac=ACPlan(mode, every_k=2, pin_memory=False),
            mixed_precision="bf16",
            ce_chunk_tokens=chunk,
            device_type="cpu",
        )
        meta = build_meta_model(config, settings)
        compute = compute_bytes(config, settings)
        flat[mode] = compute_bytes(config, settings.replace(cp=1)).saved.activations
        for rank in range(2):
            got = measured[rank]["models"]["llama"][mode]
            want = state_bytes(meta, settings, rank)
            where = f"cp 2 {mode} rank {rank}"
            assert (want["params"], want["grads"], want["optimizer"]) == (
                got["params"],
                got["grads"],
                got["optimizer"],
            ), where
            assert (compute.saved.activations, compute.saved.loss) == (got["activations"], got["loss"]), where
    # Half of each sequence per rank: full checkpointing keeps exactly half of the flat run's layer inputs.
    assert measured[0]["models"]["llama"]["full"]["activations"] * 2 == flat["full"]
