"""GRPO's reward functions: the built-ins, a user function named ``module:function`` with TRL's signature (the
dataset's columns as keyword arguments), weights, unscorable completions (None) kept out of the group baseline as
TRL keeps them, and every bad function named: unknown, not importable, raising (with the example it raises on), or
returning something else than one score per completion."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from hf_fsdp2.methods.grpo.loss import GrpoSettings, group_advantages
from hf_fsdp2.methods.grpo.rewards import RewardError, combine, resolve_reward_functions, score_completions

PROMPTS = ["What is 2+2?", "What is 2+2?", "Capital of France?", "Capital of France?"]
COMPLETIONS = [" 4", "five", "Paris ", "Lyon"]
IDS = [[7], [8, 9], [10, 11, 12], [13]]
COLUMNS = {"answer": ["4", "4", "Paris", "Paris"], "topic": ["math", "math", "geo", "geo"]}


def test_the_builtins_score_as_documented() -> None:
    funcs = resolve_reward_functions(
        ["exact_match", "format", "length_penalty"],
        [1.0, 0.5, 0.1],
        format_pattern=r"[A-Z]\w+|\d+",
        max_completion_length=4,
    )
    table = score_completions(funcs, PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert table[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert table[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert table[:, 2].tolist() == [-0.25, -0.5, -0.75, -0.25]
    assert combine(table, funcs).tolist() == pytest.approx([1.475, -0.05, 1.425, 0.475])
    column = resolve_reward_functions(["exact_match"], reference_column="solution")
    with pytest.raises(RewardError, match="exact_match needs the dataset column 'solution'"):
        score_completions(column, PROMPTS, COMPLETIONS, IDS, COLUMNS)


def test_a_user_function_gets_trls_arguments_and_none_is_unscorable(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "my_rewards.py").write_text(
        "seen = {}\n"
        "def by_topic(prompts, completions, completion_ids, topic, answer, **kw):\n"
        "    seen.update(prompts=prompts, topic=topic, ids=completion_ids)\n"
        "    return [None if t == 'geo' else float(len(c)) for c, t in zip(completions, topic)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_functions(["my_rewards:by_topic"], [2.0])
    rewards = combine(score_completions(funcs, PROMPTS, COMPLETIONS, IDS, COLUMNS), funcs)
    assert rewards[:2].tolist() == [4.0, 8.0] and rewards[2:].isnan().all()
    seen = sys.modules["my_rewards"].seen
    assert seen["prompts"] == PROMPTS and seen["topic"] == COLUMNS["topic"] and seen["ids"] == IDS
    # The geo group has no scored completion: advantage 0 for both, and the math group's own baseline.
    advantages, _ = group_advantages(rewards, GrpoSettings(num_generations=2))
    assert advantages[2:].tolist() == [0.0, 0.0]
    assert advantages[:2].tolist() == pytest.approx([-2 / (math.sqrt(8) + 1e-4), 2 / (math.sqrt(8) + 1e-4)])


def test_one_unscored_completion_stays_out_of_its_groups_baseline_as_in_trl() -> None:
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, float("nan"), 3.0, 0.0, 2.0, 4.0])
    advantages, _ = group_advantages(rewards, GrpoSettings(num_generations=3))
    grouped = rewards.view(-1, 3)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(3)
    std = nanstd(grouped, dim=1).repeat_interleave(3)
    want = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.allclose(advantages, want) and advantages[1] == 0 and advantages[0] == -advantages[2]


def test_bad_functions_are_named(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bad_rewards.py").write_text(
        "def picky(prompts, completions, **kw):\n"
        "    return [1.0 / (c != 'Lyon') for c in completions]\n"  # 'Lyon': ZeroDivisionError
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def wordy(prompts, completions, **kw):\n    return ['good'] * len(completions)\n"
        "not_a_function = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for names, message in (
        (["nope"], "'nope' is not a built-in"),
        (["no_such_module:f"], "cannot be imported"),
        (["bad_rewards:missing"], "has no function 'missing'"),
        (["bad_rewards:not_a_function"], "has no function 'not_a_function'"),
        (["format"], "needs reward_format_pattern"),
        ([], "reward_funcs is empty"),
    ):
        with pytest.raises(RewardError, match=message):
            resolve_reward_functions(names)
    with pytest.raises(RewardError, match="reward_weights has 1 values for 2 reward_funcs"):
        resolve_reward_functions(["exact_match", "length_penalty"], [1.0])
    with pytest.raises(RewardError, match="is not a regular expression"):
        resolve_reward_functions(["format"], format_pattern="(")
    picky = resolve_reward_functions(["bad_rewards:picky"])
    with pytest.raises(
        RewardError, match=r"'bad_rewards:picky' raised ZeroDivisionError: .* on example 13 .*'Lyon'"
    ):
        score_completions(picky, PROMPTS, COMPLETIONS, IDS, COLUMNS, indices=[10, 11, 12, 13])
    with pytest.raises(RewardError, match="'bad_rewards:short' returned list of 1 values for 4 completions"):
        score_completions(resolve_reward_functions(["bad_rewards:short"]), PROMPTS, COMPLETIONS, IDS, COLUMNS)
    with pytest.raises(RewardError, match="'bad_rewards:wordy' returned 'good' for completion 0"):
        score_completions(resolve_reward_functions(["bad_rewards:wordy"]), PROMPTS, COMPLETIONS, IDS, COLUMNS)
