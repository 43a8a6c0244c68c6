"""The GRPO recipe's reading of the shared keys, and the other recipes' reading of the now per-recipe ``beta``."""

from __future__ import annotations

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config import parse_config as _parse
from hf_fsdp2.trainer.grpo import grpo_settings_check
from hf_fsdp2.trainer.kto import kto_settings_check
from hf_fsdp2.trainer.preference import dpo_objective


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return _parse(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o", *argv])


def test_grpo_defaults_dapo_no_kl_and_no_compile_and_refuses_what_it_cannot_do() -> None:
    cfg = parse("--reward_funcs", "exact_match")
    grpo_settings_check(cfg)
    assert (cfg.preference.loss_type, cfg.preference.beta, cfg.fsdp.torch_compile) == ("dapo", 0.0, False)
    cfg = parse(
        "--reward_funcs", "exact_match", "--loss_type", "dr_grpo", "--beta", "0.04", "--torch_compile", "true"
    )
    grpo_settings_check(cfg)
    assert (cfg.preference.loss_type, cfg.preference.beta, cfg.fsdp.torch_compile) == ("dr_grpo", 0.04, True)
    for argv, message in ((("--loss_type", "ipo"), "loss_type='ipo' is not a GRPO loss"),
                          (("--precompute_ref_log_probs", "true"), "cannot be computed before"),
                          (("--packing", "true"), "packing=True"),
                          (("--max_length", "64", "--max_completion_length", "64"), "must exceed max_completion_length"),
                          ((), "reward_funcs is empty")):  # fmt: skip
        funcs = () if message == "reward_funcs is empty" else ("--reward_funcs", "exact_match")
        with pytest.raises(ConfigError, match=message):
            grpo_settings_check(parse(*funcs, *argv))
    with pytest.raises(ConfigError, match="num_generations=1 must be >= 2"):
        parse("--num_generations", "1")
    with pytest.raises(ConfigError, match="reward_weights has 2 values for 1 reward_funcs"):
        parse("--reward_funcs", "exact_match", "--reward_weights", "1", "2")


def test_dpo_and_kto_keep_trls_beta_and_refuse_a_grpo_loss() -> None:
    cfg = parse()
    dpo_objective(cfg)
    assert cfg.preference.beta == 0.1
    cfg = parse()
    kto_settings_check(cfg)
    assert cfg.preference.beta == 0.1 and cfg.preference.loss_type == "kto"
    with pytest.raises(ConfigError, match="a GRPO loss: run recipes/grpo.py"):
        dpo_objective(parse("--loss_type", "dapo"))
    with pytest.raises(ConfigError, match="beta=0.0 must be > 0 for DPO"):
        dpo_objective(parse("--beta", "0"))


def test_prompts_come_from_prompt_records_or_chat_records_and_bad_ones_are_named(chatml_tokenizer) -> None:
    from hf_fsdp2.trainer.grpo import tokenize_prompts

    user = {"role": "user", "content": "2024-03-05"}
    records = [{"prompt": "a plain prompt", "answer": "x"},
               {"messages": [user, {"role": "assistant", "content": "5 March 2024"}], "kind": "chat"},
               {"prompt": [user]}]  # fmt: skip
    out = tokenize_prompts(records, chatml_tokenizer, limit=64, long_examples="drop", source="d.jsonl")
    assert [e["columns"].get("answer") for e in out] == ["x", "5 March 2024", None]
    assert out[1]["prompt"] == [user] and out[1]["columns"]["kind"] == "chat"
    chat = chatml_tokenizer.apply_chat_template(
        [user], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out[1]["prompt_ids"] == list(chat) == out[2]["prompt_ids"]
    assert out[0]["prompt_ids"] == chatml_tokenizer("a plain prompt", add_special_tokens=False)["input_ids"]
    with pytest.raises(ConfigError, match="d.jsonl record 0: no 'prompt' column nor 'messages'"):
        tokenize_prompts([{"text": "x"}], chatml_tokenizer, limit=64, long_examples="drop", source="d.jsonl")
    with pytest.raises(ConfigError, match="record 0: the prompt has .* tokens, over .* = 2"):
        tokenize_prompts(records[:1], chatml_tokenizer, limit=2, long_examples="error", source="d.jsonl")
    assert (
        tokenize_prompts(records[:1], chatml_tokenizer, limit=2, long_examples="drop", source="d.jsonl") == []
    )
