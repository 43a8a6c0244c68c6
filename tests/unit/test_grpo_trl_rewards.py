"""Reward functions written for TRL work unchanged: the reward functions of TRL 1.16's GRPOTrainer
docs (and ``trl.rewards``), a reward model folder, an async function, one reading ``trainer_state`` and calling
``log_metric``/``log_extra``, and ones returning None, bools or numpy values, score the same raw prompts and
completions exactly as TRL's own ``GRPOTrainer._calculate_rewards`` scores them, for string and message-list
prompts; what they log reaches the metrics; failures are named."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer
from support.tiny import make_tiny_llama_dir, save_tokenizer

from hf_fsdp2.methods.grpo.rewards import (
    RewardContext,
    RewardError,
    combine,
    extra_columns,
    resolve_reward_functions,
    reward_metrics,
    score_completions,
)

# Copied from TRL's docs (docs/source/grpo_trainer.md, "Using a custom reward function": examples 1.1, 2, 3, 4, 5),
# with example 4's helper written out; then functions using what TRL passes beside the completions.
DOC_REWARDS = r'''
import asyncio
import re

import numpy as np


def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def boxed_reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def check_math_solution(prompt, completion):
    return "4" in (completion if isinstance(completion, str) else completion[0]["content"])


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
    progress = trainer_state.global_step / trainer_state.max_steps
    log_metric("curriculum/progress", progress)
    log_metric("curriculum/batch", float(len(completions)))
    log_extra("chars", [len(str(c)) for c in completions])
    return [progress * (i % 2) for i in range(len(completions))]


def numpy_and_bools(completion_ids, **kwargs):
    return [np.float32(len(ids) / 4) if i % 3 == 0 else (np.bool_(len(ids) > 2) if i % 3 == 1 else len(ids) > 1)
            for i, ids in enumerate(completion_ids)]


def as_array(completion_ids, **kwargs):
    return np.array([float(len(ids)) for ids in completion_ids])


async def not_applicable(completions, task, **kwargs):
    return [float("nan") if t == "code" else 0.5 for t in task]
'''

TEXTS = [
    "<think>2+2 is 4</think><answer>\\boxed{4}</answer>",
    " The answer is \\boxed{5}.",
    "",
    "four, \\boxed{4}",
]
IDS = [[5, 6, 7, 8], [9, 10], [], [11, 12, 13]]
COLUMNS = {"ground_truth": ["4", "4", "2", "4"], "task": ["math", "math", "code", "math"]}
STRINGS = ["What is 2+2?", "What is 2+2?", "Write add(a, b).", "Two plus two?"]
CHATS = [[{"role": "system", "content": "Think first."}, {"role": "user", "content": p}] for p in STRINGS]
STANDARD = [
    "reward_func",
    "boxed_reward_func",
    "math_reward_func",
    "async_reward_func",
    "curriculum",
    "numpy_and_bools",
    "as_array",
    "not_applicable",
]
CONVERSATIONAL = [
    "format_reward_func",
    "math_reward_func",
    "async_reward_func",
    "curriculum",
    "not_applicable",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The policy, a reward model (a tiny Llama sequence classifier with its ChatML tokenizer, saved as
    recipes/rm.py's export is) and the module of reward functions."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("trl_rewards")
    tok = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    tok.pad_token = tok.eos_token
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(3)
    rm = root / "tiny-rm"
    LlamaForSequenceClassification(config).save_pretrained(rm)
    save_tokenizer(tok, rm)
    (root / "doc_rewards.py").write_text(DOC_REWARDS)
    return {"policy": make_tiny_llama_dir(root / "policy", seed=2), "rm": rm, "root": root}


@pytest.fixture(scope="module")
def trainer(folders: dict[str, Path]) -> Any:
    """TRL 1.16's GRPOTrainer with an async reward function (it starts its event loop) and the reward model."""
    import sys

    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(folders["root"]))
    import doc_rewards

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=8,
            report_to="none",
        )
        return GRPOTrainer(
            model=str(folders["policy"]),
            reward_funcs=[doc_rewards.async_reward_func, str(folders["rm"])],
            args=config,
            train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 4),
            processing_class=AutoTokenizer.from_pretrained(folders["policy"]),
        )


def _trls(trainer: Any, names: list[str], prompts: list[Any]) -> torch.Tensor:
    """TRL's ``_calculate_rewards`` on the raw prompts, with completions shaped as its
    ``_generate_and_score_completions`` shapes decoded texts (a message list for message-list prompts)."""
    import doc_rewards

    rm, rm_tokenizer = trainer.reward_funcs[-1], trainer.reward_processing_classes[-1]
    trainer.reward_funcs = [*(getattr(doc_rewards, n) for n in names), rm]
    trainer.reward_processing_classes = [*(None for _ in names), rm_tokenizer]
    trainer.reward_func_names = [*names, "tiny-rm"]
    chat = isinstance(prompts[0], list)
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS] if chat else list(TEXTS)
    inputs = [{"prompt": p, **{k: v[i] for k, v in COLUMNS.items()}} for i, p in enumerate(prompts)]
    return trainer._calculate_rewards(inputs, prompts, completions, IDS).cpu()


@pytest.mark.parametrize("kind", ["string", "conversational"])
def test_trls_reward_functions_and_a_reward_model_score_as_in_trl(folders, trainer, kind: str) -> None:  # type: ignore[no-untyped-def]
    from transformers import TrainerState

    prompts, names = (STRINGS, STANDARD) if kind == "string" else (CHATS, CONVERSATIONAL)
    trainer.state.global_step, trainer.state.max_steps = 3, 12
    trainer._pending_metrics.clear()
    trainer._pending_extra_logs.clear()
    theirs = _trls(trainer, names, prompts)
    context = RewardContext(state=lambda: TrainerState(global_step=3, max_steps=12))
    functions = resolve_reward_functions(
        [*(f"doc_rewards:{n}" for n in names), str(folders["rm"])],
        context=context,
        device=torch.device("cpu"),
    )
    assert functions[-1].name == "tiny-rm"  # TRL's name: the model id's last part
    ours = score_completions(functions, prompts, TEXTS, IDS, COLUMNS)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=1e-6, atol=1e-6)
    assert ours[:, :-1].isnan().any() and not ours[:, -1].isnan().any()  # None / NaN: not applicable
    assert ours[:, -1].abs().sum() > 0  # the reward model's logits[:, 0]
    # What the functions logged, as TRL holds it, then averaged into the step's metrics.
    assert (
        context.metrics
        == dict(trainer._pending_metrics)
        == {"curriculum/progress": [0.25], "curriculum/batch": [4.0]}
    )
    assert (
        context.extras
        == dict(trainer._pending_extra_logs)
        == {
            "chars": [
                len(str(c))
                for c in (
                    [[{"role": "assistant", "content": t}] for t in TEXTS] if kind != "string" else TEXTS
                )
            ]
        }
    )
    assert [row["chars"] for row in extra_columns(functions, len(TEXTS))] == context.extras["chars"]
    score_completions(functions, prompts, TEXTS, IDS, COLUMNS)  # a second batch before the log
    assert reward_metrics(functions, torch.device("cpu")) == {
        "curriculum/progress": 0.25,
        "curriculum/batch": 4.0,
    }
    assert context.metrics == {} and reward_metrics(functions, torch.device("cpu")) == {}
    # The weighted sum skips the functions that did not apply.
    rewards = combine(ours, functions)
    assert not rewards.isnan().any()


def test_the_builtins_read_message_completions_and_trl_rewards_run_unchanged() -> None:
    from trl.rewards import think_format_reward

    functions = resolve_reward_functions(
        ["exact_match", "format", "trl.rewards:think_format_reward"], format_pattern=r"<think>.*</think>.*"
    )
    texts = ["<think>x</think>4", "4", "<think>y</think> 5"]
    chats = [[{"role": "user", "content": "2+2?"}]] * 3
    table = score_completions(
        functions, chats, texts, [[1], [2], [3]], {"answer": ["<think>x</think>4", "4", "4"]}
    )
    assert table[:, 0].tolist() == [1.0, 1.0, 0.0] and table[:, 1].tolist() == [1.0, 0.0, 1.0]
    shaped = [[{"role": "assistant", "content": t}] for t in texts]
    assert table[:, 2].tolist() == think_format_reward(shaped)


def test_async_functions_run_together_and_failures_are_named(folders: dict[str, Path], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(folders["root"]))
    (folders["root"] / "slow_rewards.py").write_text(
        "import asyncio, time\n"
        "async def slow_a(completions, **kw):\n    await asyncio.sleep(0.4)\n    return [1.0] * len(completions)\n"
        "async def slow_b(completions, **kw):\n    await asyncio.sleep(0.4)\n    return [2] * len(completions)\n"
        "async def broken(completions, **kw):\n"
        "    if any(c == 'bad' for c in completions):\n        raise KeyError('no key here')\n"
        "    return [0.0] * len(completions)\n"
        "def loud(completions, **kw):\n    return [float('inf')] * len(completions)\n"
        "def wordy(completions, **kw):\n    return ['good'] * len(completions)\n"
    )
    import time

    functions = resolve_reward_functions(["slow_rewards:slow_a", "slow_rewards:slow_b"])
    start = time.perf_counter()
    table = score_completions(functions, ["p", "q"], ["a", "b"], [[1], [2]], {})
    assert table.tolist() == [[1.0, 2.0], [1.0, 2.0]] and time.perf_counter() - start < 0.75  # concurrently
    broken = resolve_reward_functions(["slow_rewards:broken"])
    with pytest.raises(
        RewardError, match=r"'slow_rewards:broken' raised KeyError: 'no key here' on example 8 "
    ):
        score_completions(broken, ["p", "q"], ["ok", "bad"], [[1], [2]], {}, indices=[7, 8])
    with pytest.raises(
        RewardError, match=r"'slow_rewards:loud' returned inf for completion 0: give a finite"
    ):
        score_completions(resolve_reward_functions(["slow_rewards:loud"]), ["p"], ["a"], [[1]], {})
    with pytest.raises(RewardError, match=r"'slow_rewards:wordy' returned 'good' for completion 0"):
        score_completions(resolve_reward_functions(["slow_rewards:wordy"]), ["p"], ["a"], [[1]], {})


def test_reward_model_names_are_checked(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardError, match="is a folder without config.json"):
        resolve_reward_functions([str(tmp_path / "empty")])
    with pytest.raises(RewardError, match="nor a reward model"):
        resolve_reward_functions(["no such thing"])
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "config.json").write_text('{"model_type": "nothing_known"}')
    (fn,) = resolve_reward_functions([str(tmp_path / "not_a_model")])
    with pytest.raises(RewardError, match="cannot be loaded as a sequence classifier"):
        fn.fn.load(torch.device("cpu"))  # type: ignore[attr-defined]


def test_evaluation_logs_what_the_functions_logged(folders: dict[str, Path], caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The eval pass (one process here): the functions' log_metric values as ``eval_<name>`` (TRL's eval names),
    their log_extra columns beside each eval sample in the log."""
    import logging

    from transformers import TrainerState

    from hf_fsdp2.methods.grpo.data import tokenize_prompts
    from hf_fsdp2.methods.grpo.objective import GrpoEvaluator

    class Fixed:  # a generator answering the same ids for every prompt
        device = torch.device("cpu")
        eos_ids = [2]

        def generate(self, prompts: Any, *, seed: int, greedy: bool = False) -> list[list[int]]:
            return [[22172, 3186]] * len(prompts)

    monkeypatch.syspath_prepend(str(folders["root"]))
    tok = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    records = [
        {"prompt": [{"role": "user", "content": p}], "ground_truth": "x", "task": "math"} for p in STRINGS
    ]
    prompts = tokenize_prompts(records, tok, limit=64, long_examples="error", source="eval")
    context = RewardContext(state=lambda: TrainerState(global_step=6, max_steps=12))
    functions = resolve_reward_functions(
        ["doc_rewards:curriculum", "doc_rewards:format_reward_func"], context=context
    )
    with caplog.at_level(logging.INFO, logger="hf_fsdp2"):
        out = GrpoEvaluator(prompts, Fixed(), functions, tokenizer=tok, batch_size=3, samples=2).run(
            torch.nn.Linear(1, 1), 6
        )
    assert (
        out["eval_curriculum/progress"] == 0.5 and out["eval_curriculum/batch"] == 2.0
    )  # batches of 3 and 1
    samples = [r.getMessage() for r in caplog.records if "eval sample" in r.getMessage()]
    chars = len(str([{"role": "assistant", "content": "hello world"}]))  # curriculum's len(str(completion))
    assert len(samples) == 2 and all(s.endswith(f"-> 'hello world' {{'chars': {chars}}}") for s in samples), (
        samples
    )
