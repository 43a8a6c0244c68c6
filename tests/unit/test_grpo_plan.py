"""The memory plan of a GRPO run: the training micro-batch is ``per_device_train_batch_size`` completions (TRL's
meaning), and the rollout phase (the model gathered, the KV cache of the sequences of one generate call:
``rollout_batch_size``, default the rank's share of the generation batch; the last logits, the sharded parameters
and optimizer state) is computed from the model config by hand here and named in the plan's notes."""

from __future__ import annotations

from hf_fsdp2.methods import get_method, parse_method_config
from hf_fsdp2.methods.grpo.plan import rollout_bytes, rollout_note
from hf_fsdp2.plan import PlanSettings, plan_memory


def test_the_rollout_phase_is_the_gathered_model_and_the_kv_cache() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg = parse_method_config(
        "grpo",
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            "o",
            "--per_device_train_batch_size",
            "3",
            "--gradient_accumulation_steps",
            "2",
            "--num_generations",
            "4",
            "--max_length",
            "128",
            "--mixed_precision",
            "bf16",
        ],
    )
    settings = PlanSettings.from_config(cfg, world_size=2, device_type="cpu", method=get_method("grpo"))
    assert settings.micro_batch == 3  # completions (the old meaning, prompts x num_generations, was 12 rows)
    plan = plan_memory(config, settings)
    r = rollout_bytes(plan, config, cfg)
    sequences = 3 * 2  # per_device x steps_per_generation (= gradient_accumulation_steps): the rank's share
    assert r.sequences == sequences and r.chunks == 1
    assert r.kv_cache == 2 * 3 * 2 * 16 * sequences * 128 * 2  # K and V, layers, kv heads, head dim, bf16
    assert r.gathered == plan.total_params * 2 and r.logits == sequences * 1000 * 4
    state = plan.per_rank[plan.worst_rank]
    assert (
        r.state == state["params"] + state["optimizer"]
        and r.peak == r.gathered + r.kv_cache + r.logits + r.state
    )
    assert "GRPO rollout phase" in rollout_note(
        plan, config, cfg
    ) and f"{sequences} sequences" in rollout_note(plan, config, cfg)


def test_rollout_batch_size_splits_the_kv_cache_into_calls() -> None:
    """rollout_batch_size 4 of a rank's 12 completions: 3 generate calls, a third of the KV cache and last logits."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    argv = [
        "--model_name_or_path",
        "m",
        "--dataset_name",
        "d.jsonl",
        "--output_dir",
        "o",
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "3",
        "--num_generations",
        "4",
        "--max_length",
        "128",
        "--mixed_precision",
        "bf16",
    ]
    whole_cfg = parse_method_config("grpo", argv)
    split_cfg = parse_method_config("grpo", [*argv, "--rollout_batch_size", "4"])
    settings = PlanSettings.from_config(whole_cfg, world_size=2, device_type="cpu", method=get_method("grpo"))
    plan = plan_memory(config, settings)
    whole, split = rollout_bytes(plan, config, whole_cfg), rollout_bytes(plan, config, split_cfg)
    assert (whole.sequences, whole.chunks, split.sequences, split.chunks) == (12, 1, 4, 3)
    assert whole.kv_cache == 3 * split.kv_cache and whole.logits == 3 * split.logits
    assert "one of 3 generate call(s)" in rollout_note(plan, config, split_cfg)


def test_a_generation_batch_the_ranks_cannot_hold_is_named_not_raised() -> None:
    """The plan of 1 rank for a layout of 2 (3 completions, groups of 4): the rollout line says why, as the run
    would refuse it, and the training table is still made."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg = parse_method_config(
        "grpo",
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d.jsonl",
            "--output_dir",
            "o",
            "--per_device_train_batch_size",
            "3",
            "--num_generations",
            "4",
            "--max_length",
            "128",
        ],
    )
    plan = plan_memory(
        config, PlanSettings.from_config(cfg, world_size=1, device_type="cpu", method=get_method("grpo"))
    )
    note = rollout_note(plan, config, cfg)
    assert (
        note.startswith("GRPO rollout phase not planned: generation_batch_size (3 = ")
        and "num_generations (4)" in note
    )
