"""GRPO's reward functions: built-ins for verifiable tasks and user functions named ``module:function`` in the YAML.

Every function has TRL's signature: ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``,
where ``columns`` are the dataset's other columns (one value per completion, the prompt's repeated), so a function
written for TRL's ``GRPOTrainer`` works unchanged. ``None`` marks a completion the function cannot score; a
completion no function scores gets no advantage and stays out of its group's baseline (as TRL).

Built-ins (their settings are recipe keys):

- ``exact_match``: 1.0 where the completion, stripped, equals the ``reward_reference_column`` value (default
  ``answer``), else 0.0;
- ``format``: 1.0 where the stripped completion matches ``reward_format_pattern`` (a full regular-expression
  match), else 0.0;
- ``length_penalty``: minus the completion's share of ``max_completion_length`` (0 for an empty one, -1 for one
  that used every token).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RewardFn = Callable[..., list[float | None]]


class RewardError(ValueError):
    """A reward function that cannot be found, raises, or returns something that is not one score per completion."""


def exact_match(
    prompts: Sequence[Any], completions: Sequence[str], *, reference_column: str = "answer", **columns: Any
) -> list[float | None]:
    references = columns.get(reference_column)
    if references is None:
        raise RewardError(
            f"exact_match needs the dataset column {reference_column!r} (reward_reference_column); the columns "
            f"are {sorted(k for k in columns if k != 'completion_ids')}"
        )
    return [float(str(c).strip() == str(r).strip()) for c, r in zip(completions, references, strict=True)]


def format_match(
    prompts: Sequence[Any], completions: Sequence[str], *, pattern: str = "", **columns: Any
) -> list[float | None]:
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(str(c).strip()) is not None) for c in completions]


def length_penalty(
    prompts: Sequence[Any], completions: Sequence[str], *, max_completion_length: int = 1, **columns: Any
) -> list[float | None]:
    ids = columns["completion_ids"]
    return [-len(i) / max_completion_length for i in ids]


BUILTINS = ("exact_match", "format", "length_penalty")


@dataclass(frozen=True)
class RewardFunction:
    """A named reward function and its weight."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def resolve_reward_functions(
    names: Sequence[str],
    weights: Sequence[float] | None = None,
    *,
    reference_column: str = "answer",
    format_pattern: str | None = None,
    max_completion_length: int = 256,
) -> list[RewardFunction]:
    """The functions ``names`` (built-ins or ``module:function``) with ``weights`` (default 1.0 each).

    Raises:
        RewardError: an unknown name, a module or attribute that is not there, a bad weight count, a built-in
            missing its setting, naming the value and the fix.
    """
    if not names:
        raise RewardError("reward_funcs is empty: name at least one (exact_match, format, length_penalty or "
                          "module:function)")  # fmt: skip
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise RewardError(f"reward_weights has {len(weights)} values for {len(names)} reward_funcs {list(names)}: "
                          "give one weight per function")  # fmt: skip
    out = []
    for name, weight in zip(names, weights, strict=True):
        if name == "exact_match":
            fn: RewardFn = functools.partial(exact_match, reference_column=reference_column)
        elif name == "format":
            if not format_pattern:
                raise RewardError("reward 'format' needs reward_format_pattern, a regular expression the whole "
                                  "completion must match, e.g. '\\d+ \\w+ \\d{4}'")  # fmt: skip
            try:
                re.compile(format_pattern)
            except re.error as err:
                raise RewardError(
                    f"reward_format_pattern={format_pattern!r} is not a regular expression: {err}"
                ) from None
            fn = functools.partial(format_match, pattern=format_pattern)
        elif name == "length_penalty":
            fn = functools.partial(length_penalty, max_completion_length=max_completion_length)
        elif ":" in name:
            fn = _import(name)
        else:
            raise RewardError(f"reward function {name!r} is not a built-in ({', '.join(BUILTINS)}) nor module:function "
                              "(e.g. my_rewards:accuracy, importable from the working directory)")  # fmt: skip
        out.append(RewardFunction(name, fn, float(weight)))
    return out


def _import(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward function {spec!r}: module {module_name!r} cannot be imported ({err}); put it on "
                          "PYTHONPATH or in the working directory") from None  # fmt: skip
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def _checked(values: Any, name: str, count: int) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise RewardError(f"reward function {name!r} returned {type(values).__name__} of "
                          f"{len(values) if hasattr(values, '__len__') else '?'} values for {count} completions: "
                          "return a list with one float (or None) per completion")  # fmt: skip
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out.append(float(v))
        else:
            raise RewardError(
                f"reward function {name!r} returned {v!r} for completion {i}: give a finite float or None"
            )
    return out


def score_completions(
    functions: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    indices: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rewards [completions, functions] (NaN where a function returned None).

    Raises:
        RewardError: a function raised (named with the first completion it raises on: its example index in the
            dataset when ``indices`` gives them) or returned something else than one score per completion.
    """
    table = []
    for spec in functions:
        kwargs = {**columns, "completion_ids": list(completion_ids)}
        try:
            values = spec.fn(prompts=list(prompts), completions=list(completions), **kwargs)
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(
                _blame(spec, prompts, completions, completion_ids, columns, indices, err)
            ) from err
        table.append(_checked(values, spec.name, len(completions)))
    return torch.tensor(table, dtype=torch.float32).T.reshape(len(completions), len(functions))


def _blame(spec, prompts, completions, completion_ids, columns, indices, err) -> str:  # type: ignore[no-untyped-def]
    """The message naming the function and the first completion it raises on alone."""
    for i in range(len(completions)):
        one = {k: [v[i]] for k, v in columns.items()}
        try:
            spec.fn(
                prompts=[prompts[i]], completions=[completions[i]], completion_ids=[completion_ids[i]], **one
            )
        except Exception as single:
            where = f"example {indices[i]}" if indices is not None else f"completion {i}"
            return (f"reward function {spec.name!r} raised {type(single).__name__}: {single} on {where} "
                    f"(prompt {str(prompts[i])[:80]!r}, completion {str(completions[i])[:80]!r})")  # fmt: skip
    return (
        f"reward function {spec.name!r} raised {type(err).__name__}: {err} on the batch of {len(completions)}"
    )


def combine(rewards: torch.Tensor, functions: Sequence[RewardFunction]) -> torch.Tensor:
    """The weighted sum over functions per completion (NaN scores skipped; NaN where no function scored it)."""
    weights = torch.tensor([f.weight for f in functions], dtype=rewards.dtype)
    total = (rewards * weights).nansum(dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.full_like(total, math.nan), total)
