"""The memory plan with context parallel (``cp_size``, the all-to-all backend; hf_fsdp2/plan/context.py): the
sharded state over dp_shard x cp ranks, the meta forward at S/cp tokens per rank with the run's all-to-all attention
(gathered q/k/v, the per-layer mask), the table's line, the recommender's cp rungs, the plan command's refusal of a
recipe without context parallel. Each figure here would differ if cp were ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from hf_fsdp2 import cli
from hf_fsdp2.config.plans import ACPlan
from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.plan import PlanError, PlanSettings, format_plan, plan_memory, recommend
from hf_fsdp2.plan.recommend import context_parallel_sizes

LAYERS = 2
CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=LAYERS,
    vocab_size=1000,
)


def _plan(**changes: object):  # type: ignore[no-untyped-def]
    values: dict[str, object] = dict(
        world_size=4,
        micro_batch=2,
        seq_len=512,
        device_type="cuda",
        attn_implementation="sdpa",
        ac=ACPlan("none"),
    )
    values.update(changes)
    return plan_memory(CONFIG, PlanSettings(**values))  # type: ignore[arg-type]


def _recipe(tmp: Path, **overrides: object) -> list[str]:
    (tmp / "config.json").write_text(CONFIG.to_json_string())
    argv = [
        "--model_name_or_path",
        str(tmp),
        "--dataset_name",
        "data.jsonl",
        "--output_dir",
        str(tmp / "run"),
        "--per_device_train_batch_size",
        "2",
        "--max_length",
        "512",
        "--mixed_precision",
        "bf16",
    ]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return argv


def test_state_is_sharded_over_dp_shard_x_cp_ranks(tmp_path: Path) -> None:
    sft = get_method("sft")
    flat = PlanSettings.from_config(
        parse_method_config(sft, _recipe(tmp_path)), world_size=4, device_type="cuda"
    )
    cp = PlanSettings.from_config(
        parse_method_config(sft, _recipe(tmp_path, cp_size=2)), world_size=4, device_type="cuda"
    )
    assert (cp.cp, cp.shard_size) == (2, 4)  # mesh dp_shard 2 x cp 2: the parameters over all 4 ranks
    hsdp = PlanSettings.from_config(
        parse_method_config(sft, _recipe(tmp_path, cp_size=2, dp_replicate_size=2)),
        world_size=8,
        device_type="cuda",
    )
    assert (hsdp.cp, hsdp.shard_size) == (2, 4)  # 2 replica groups of dp_shard 2 x cp 2
    one, two = plan_memory(CONFIG, flat), plan_memory(CONFIG, cp)
    assert one.per_rank == two.per_rank and one.fsdp_buffers == two.fsdp_buffers


def test_activations_are_those_of_a_part_of_each_sequence() -> None:
    # Full checkpointing keeps each layer's input: exactly 1/cp of the flat run's.
    full = [_plan(cp=cp, ac=ACPlan("full")).compute.saved.activations for cp in (1, 2, 4)]
    assert full[0] == 2 * full[1] == 4 * full[2]
    # Without: the kernel keeps the gathered q/k/v (whole sequence, heads/cp heads): about 1/cp again, a little over.
    none = [_plan(cp=cp).compute.saved.activations for cp in (1, 2, 4)]
    assert none[0] / 2 <= none[1] <= 1.1 * none[0] / 2 and none[0] / 4 <= none[2] <= 1.15 * none[0] / 4
    # The loss and logits: the part's tokens only.
    assert _plan(cp=2).compute.saved.loss < _plan(cp=1).compute.saved.loss
    # Eager keeps the attention probabilities [b, heads/cp, S, S]: half of the flat run's at cp 2 on CPU. On CUDA the
    # all-to-all runs flex attention's fused kernel instead (the causal mask as a block mask): no [S, S] kept.
    eager = [
        _plan(cp=cp, attn_implementation="eager", device_type="cpu").compute.saved.activations
        for cp in (1, 2)
    ]
    assert eager[0] / 2 <= eager[1] <= 1.05 * eager[0] / 2
    fused = _plan(cp=2, attn_implementation="eager").compute.saved.activations
    assert fused <= 1.1 * _plan(cp=2).compute.saved.activations  # as sdpa's flash kernel


def test_the_all_to_all_buffers_and_the_mask_per_layer() -> None:
    plan = _plan(cp=4)
    ctx = plan.context
    assert ctx is not None and (ctx.tokens, ctx.part) == (512, 128)
    # 8 heads over 4 ranks: 2 query heads; 2 KV heads do not divide by 4: repeated 2x, 1 KV head per rank.
    assert (ctx.split.heads // 4, ctx.split.kv_repeat) == (2, 2)
    head = 256 // 8
    assert ctx.gathered_bytes == 2 * (2 + 2 * 1) * 512 * head * 2  # [b, 2 + 1 + 1 heads, S, d] in bf16
    assert ctx.scattered_bytes == 2 * 128 * 8 * head * 2  # [b, S/cp, heads, d]
    assert ctx.mask_bytes == 0  # one causal document per row: sdpa's causal kernel, no mask
    # Packed rows on CUDA: flex attention's block mask per layer (4 int32 tile lists [b, 1, 4, 4] of 128-position
    # tiles with their counts, and the [b, S] int64 document ids), kept by no kernel; a fused kernel's saved tensors.
    padded, packed = _plan(cp=2), _plan(cp=2, packing=True)
    assert packed.context is not None and packed.context.block
    assert packed.context.mask_bytes == 4 * 4 * 2 * 4 * (4 + 1) + 8 * 2 * 512
    grown = packed.compute.saved.activations - padded.compute.saved.activations
    assert grown <= LAYERS * 2 * 512 * 8  # the document ids at most, where the dense mask kept 2 MiB (below)
    # On CPU (flex attention has no backward there): a [b, 1, S, S] bool mask per layer, which sdpa turns into an
    # additive one; the dense path was the CUDA one before the block mask: LAYERS x 2 x 512 x 512 x 2 bytes kept.
    dense = _plan(cp=2, packing=True, device_type="cpu")
    assert dense.context is not None and not dense.context.block
    assert dense.context.mask_bytes == 2 * 512 * 512
    # A length that does not divide: padded to a multiple of cp, as the run pads it.
    odd = _plan(cp=4, seq_len=510)
    assert odd.context is not None and odd.context.tokens == 512
    assert odd.compute.saved.activations == plan.compute.saved.activations


def test_the_table_and_json_say_what_cp_does() -> None:
    plan = _plan(cp=2, packing=True)
    text = format_plan(plan)
    assert (
        "context parallel 2 (all-to-all around the sdpa kernel): each rank holds 256 of the 512 tokens"
        in text
    )
    assert "4 query heads and 1 key/value heads per rank over the whole sequence" in text
    assert "q/k/v gathered" in text and "flex attention's block mask per layer" in text
    assert "2 data-parallel ranks" in text
    assert "bool mask per layer" in format_plan(_plan(cp=2, packing=True, device_type="cpu"))
    out = plan.to_json()
    assert out["settings"]["cp_size"] == 2 and out["settings"]["dp_shard_size"] == 2
    assert out["context_parallel"]["tokens_per_rank"] == 256 and out["context_parallel"]["kv_repeat"] == 1
    assert _plan().to_json()["context_parallel"] is None


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"cp": 3, "world_size": 6}, "cp_size=3 does not divide the model's num_attention_heads=8"),
        ({"cp": 4, "world_size": 2}, "cp_size=4 must divide the 2 ranks a parameter is sharded over"),
        ({"cp": 2, "attn_implementation": "flex_attention"}, "wraps the attention kernels sdpa, eager"),
    ],
)
def test_what_the_run_refuses_the_plan_refuses(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(PlanError, match=needle.replace("(", r"\(")):
        _plan(**changes)


def test_the_recommender_offers_cp_when_a_sequence_does_not_fit() -> None:
    settings = PlanSettings(
        world_size=4,
        micro_batch=1,
        seq_len=4096,
        device_type="cpu",
        attn_implementation="sdpa",
        ac=ACPlan("full"),
    )
    assert context_parallel_sizes(CONFIG, settings) == [2, 4]
    flat = plan_memory(CONFIG, settings)
    wide = plan_memory(CONFIG, settings.replace(cp=4, gradient_accumulation_steps=4))
    budget = int((flat.peak + wide.peak) / 2 / 0.9)  # cp 4 fits, cp 1 does not
    tried = recommend(CONFIG, settings, budget, 0.1, context_parallel=True)
    assert tried[-1].fits and tried[-1].changes["cp_size"] in (2, 4)
    assert (
        tried[-1].changes["gradient_accumulation_steps"] == tried[-1].changes["cp_size"]
    )  # the same global batch
    # A method without context parallel (dpo, kto, rm, grpo): no cp rung.
    assert not any("cp_size" in c.changes for c in recommend(CONFIG, settings, budget, 0.1))
    # Heads that do not split: 6 heads divide by 2, not by 4.
    six = LlamaConfig(
        hidden_size=192,
        intermediate_size=256,
        num_attention_heads=6,
        num_key_value_heads=6,
        num_hidden_layers=1,
        vocab_size=100,
    )
    assert context_parallel_sizes(six, settings) == [2]


def test_the_plan_command_refuses_cp_for_a_recipe_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["plan", "--world_size", "2", "--device", "cpu", *_recipe(tmp_path, cp_size=2)]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context_parallel"]["cp_size"] == 2 and out["settings"]["cp_size"] == 2
    assert cli.main(["plan", "--recipe", "kto", *argv[1:]]) != 0
    err = capsys.readouterr().err
    assert "cp_size=2 is not supported by the kto recipe" in err and "sft, cpt and dpo" in err
