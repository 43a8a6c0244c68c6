"""Each method's own config section: its keys, its defaults (no in-place rewriting of another section), and the
refusal of another method's keys naming that method."""

from __future__ import annotations

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods import get_method, parse_method_config


def parse(recipe: str, *argv: str):  # type: ignore[no-untyped-def]
    return parse_method_config(
        recipe, ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o", *argv]
    )


def check(recipe: str, *argv: str):  # type: ignore[no-untyped-def]
    """Parse, then the method's start-up checks (what a launch runs before any loading)."""
    cfg = parse(recipe, *argv)
    get_method(recipe).objective(cfg)
    return cfg


def test_grpo_defaults_dapo_no_kl_and_no_compile_and_refuses_what_it_cannot_do() -> None:
    cfg = check("grpo", "--reward_funcs", "exact_match")
    assert (cfg.method.loss_type, cfg.method.beta, cfg.fsdp.torch_compile) == ("dapo", 0.0, False)
    cfg = check(
        "grpo",
        "--reward_funcs",
        "exact_match",
        "--loss_type",
        "dr_grpo",
        "--beta",
        "0.04",
        "--torch_compile",
        "true",
    )
    assert (cfg.method.loss_type, cfg.method.beta, cfg.fsdp.torch_compile) == ("dr_grpo", 0.04, True)
    # A YAML value of a shared key wins over the method's default for it, as the command line's does.
    assert parse("sft").fsdp.torch_compile is None  # the default of the other methods is untouched
    for argv, message in (
        (("--loss_type", "ipo"), "loss_type='ipo' is not a loss of the GRPO recipe"),
        (
            ("--precompute_ref_log_probs", "true"),
            "'precompute_ref_log_probs' .* is a key of the dpo and kto recipe, not of the grpo recipe",
        ),
        (("--packing", "true"), "packing=True"),
        (("--max_length", "64", "--max_completion_length", "64"), "must exceed max_completion_length"),
        ((), "reward_funcs is empty"),
    ):
        funcs = () if message == "reward_funcs is empty" else ("--reward_funcs", "exact_match")
        with pytest.raises(ConfigError, match=message):
            check("grpo", *funcs, *argv)
    with pytest.raises(ConfigError, match="num_generations=1 must be >= 2"):
        parse("grpo", "--num_generations", "1")
    with pytest.raises(ConfigError, match="reward_weights has 2 values for 1 reward_funcs"):
        parse("grpo", "--reward_funcs", "exact_match", "--reward_weights", "1", "2")


def test_dpo_and_kto_keep_trls_beta_and_refuse_each_others_keys() -> None:
    assert parse("dpo").method.beta == 0.1 and parse("dpo").method.loss_type == "sigmoid"
    cfg = parse("kto")
    assert cfg.method.beta == 0.1 and cfg.method.loss_type == "kto"
    with pytest.raises(ConfigError, match="loss_type='dapo' is not a loss of the DPO recipe"):
        parse("dpo", "--loss_type", "dapo")
    with pytest.raises(ConfigError, match="beta=0.0 must be > 0 for DPO"):
        parse("dpo", "--beta", "0")
    with pytest.raises(
        ConfigError,
        match="'num_generations' in the command line is a key of the grpo recipe, not of "
        "the dpo recipe; remove it, or train with recipes/grpo.py",
    ):
        parse("dpo", "--num_generations", "4")
    with pytest.raises(
        ConfigError, match="'beta' .* is a key of the dpo and kto and grpo recipe, not of the sft"
    ):
        parse("sft", "--beta", "0.1")
    with pytest.raises(ConfigError, match="'center_rewards_coefficient' .* of the rm recipe, not of the kto"):
        parse("kto", "--center_rewards_coefficient", "0.1")


def test_the_saved_config_of_a_method_parses_again_for_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hf_fsdp2.config import save_config

    cfg = parse("kto", "--desirable_weight", "1.2")
    path = save_config(cfg, tmp_path / "c.yaml")
    again = parse_method_config("kto", ["--config", str(path)])
    assert again.to_flat_dict() == cfg.to_flat_dict() and again.method.desirable_weight == 1.2
    with pytest.raises(
        ConfigError, match="'desirable_weight' in .* is a key of the kto recipe, not of the dpo"
    ):
        parse_method_config("dpo", ["--config", str(path)])


def test_prompts_come_from_prompt_records_or_chat_records_and_bad_ones_are_named(chatml_tokenizer) -> None:
    from hf_fsdp2.methods.grpo.data import tokenize_prompts

    user = {"role": "user", "content": "2024-03-05"}
    records = [
        {"prompt": "a plain prompt", "answer": "x"},
        {"messages": [user, {"role": "assistant", "content": "5 March 2024"}], "kind": "chat"},
        {"prompt": [user]},
    ]
    out = tokenize_prompts(records, chatml_tokenizer, limit=64, long_examples="drop", source="d.jsonl")
    assert [e["columns"].get("answer") for e in out] == ["x", "5 March 2024", None]
    assert out[1]["prompt"] == [user] and out[1]["columns"]["kind"] == "chat"
    chat = chatml_tokenizer.apply_chat_template(
        [user], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out[1]["prompt_ids"] == list(chat) == out[2]["prompt_ids"]
    assert out[0]["prompt_ids"] == chatml_tokenizer("a plain prompt")["input_ids"]  # with BOS, as TRL
    with pytest.raises(ConfigError, match="d.jsonl record 0: no 'prompt' column nor 'messages'"):
        tokenize_prompts([{"text": "x"}], chatml_tokenizer, limit=64, long_examples="drop", source="d.jsonl")
    with pytest.raises(ConfigError, match="record 0: the prompt has .* tokens, over .* = 2"):
        tokenize_prompts(records[:1], chatml_tokenizer, limit=2, long_examples="error", source="d.jsonl")
    assert (
        tokenize_prompts(records[:1], chatml_tokenizer, limit=2, long_examples="drop", source="d.jsonl") == []
    )
