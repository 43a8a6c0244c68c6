"""TRL's GRPO semantics end to end on 2 gloo ranks: a chat model whose end-of-turn token is only in its
generation_config (as Qwen2.5's <|im_end|>) and whose generation_config asks for a repetition penalty, message-list
prompts, and TRL-written reward functions beside a reward model folder: completions end at the end of the turn
(clipped_ratio below 1), the rollout says which config samples and what of the model's it leaves out, the reward
model and the functions are scored, what they log (log_metric, with trainer_state) is in metrics.jsonl, and the
export is verified."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer
from support.launch import REPO, torchrun
from support.tiny import WORDS, make_tiny_llama_dir, save_tokenizer

from hf_fsdp2.observe.logs import read_metrics

GRPO = REPO / "recipes" / "grpo.py"
STEPS, G, MAX_NEW = 2, 4, 6
REWARDS = '''
import asyncio
import re


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(completion[0]["content"]) % 3) for completion in completions]


def curriculum(completions, trainer_state, log_metric, **kwargs):
    progress = trainer_state.global_step / trainer_state.max_steps
    log_metric("curriculum/progress", progress)
    return [progress] * len(completions)
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("grpo_trl")
    model = make_tiny_llama_dir(root / "chat-model", seed=6)
    tok = AutoTokenizer.from_pretrained(model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():  # the end of turn likely (not certain): completions end at different lengths
        ids = torch.randint(3, 2000, (16, 12), generator=torch.Generator().manual_seed(0))
        mean = policy.model(input_ids=ids).last_hidden_state.mean((0, 1))
        policy.lm_head.weight[end] = 4.0 * mean / mean.pow(2).sum()
    policy.generation_config.eos_token_id = [tok.eos_token_id, end]
    policy.generation_config.repetition_penalty = 1.3
    policy.save_pretrained(model)
    rm_tok = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    rm_tok.pad_token = rm_tok.eos_token
    torch.manual_seed(1)
    rm = root / "tiny-rm"
    LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(rm_tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
            pad_token_id=rm_tok.pad_token_id,
        )
    ).save_pretrained(rm)
    save_tokenizer(rm_tok, rm)
    rng = random.Random(2)
    data = root / "chats.jsonl"
    with data.open("w") as fh:
        for _ in range(8):
            question = " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))
            fh.write(
                json.dumps({"prompt": [{"role": "user", "content": question}], "ground_truth": "x"}) + "\n"
            )
    (root / "trl_doc_rewards.py").write_text(REWARDS)
    return {"model": model, "rm": rm, "data": data, "root": root}


def test_a_chat_run_with_trl_reward_functions_and_a_reward_model(assets, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PYTHONPATH", str(assets["root"]))
    out = tmp_path / "run"
    funcs = [
        "trl_doc_rewards:format_reward_func",
        "trl_doc_rewards:async_reward_func",
        "trl_doc_rewards:curriculum",
        str(assets["rm"]),
    ]
    args = [
        "--model_name_or_path",
        str(assets["model"]),
        "--dataset_name",
        str(assets["data"]),
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--per_device_train_batch_size",
        str(2 * G),
        "--num_generations",
        str(G),
        "--max_completion_length",
        str(MAX_NEW),
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--learning_rate",
        "1e-5",
        "--lr_scheduler_type",
        "constant",
        "--logging_steps",
        "1",
        "--seed",
        "0",
        "--reward_funcs",
        *funcs,
        "--reward_weights",
        "1.0",
        "0.5",
        "1.0",
        "1.0",
        "--temperature",
        "0.9",
        "--chat_template_kwargs",
        '{"unused_flag": true}',
    ]
    proc = torchrun(GRPO, args, nproc=2)
    log = proc.stdout + proc.stderr
    assert "export verified" in log, log[-3000:]
    assert "rollout samples with: temperature 0.9" in log and "eos_token_id [2, 2097]" in log, log[-3000:]
    assert "not from the model's generation_config: repetition_penalty 1.3" in log, log[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert {
            "rewards/tiny-rm/mean",
            "rewards/trl_doc_rewards:async_reward_func/mean",
            "rewards/trl_doc_rewards:format_reward_func/mean",
        } <= set(r), sorted(r)
        assert r["rewards/tiny-rm/std"] > 0  # the reward model's logits differ per completion
        assert 0 <= r["completions/clipped_ratio"] < 1, [(k, v) for k, v in r.items() if "compl" in k]
    # trainer_state.global_step / max_steps: the updates done before the step's rollout, as TRL's.
    assert [r["curriculum/progress"] for r in rows] == [0.0, 0.5]
    assert any(r["completions/min_length"] < r["completions/max_length"] for r in rows)
