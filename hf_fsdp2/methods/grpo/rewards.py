"""GRPO's reward functions: built-ins for verifiable tasks, user functions named ``module:function`` in the YAML, and
reward models (a sequence-classification folder, e.g. what ``recipes/rm.py`` exports).

A function is called as TRL 1.16's ``GRPOTrainer`` calls it, so one written for TRL works unchanged:
``fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=..., log_extra=..., **columns)``
where ``columns`` are the dataset's other columns (one value per completion, the prompt's repeated); for
message-list prompts each completion is ``[{"role": "assistant", "content": text}]``, else the text. It returns one
value per completion: a float, int, bool or numpy scalar, or ``None`` (or NaN) for a completion it cannot score; a
completion no function scores gets no advantage and stays out of its group's baseline (as TRL). ``async def``
functions run concurrently on one event loop of a daemon thread, as TRL runs them. ``log_metric(name, value)``
values are averaged over the ranks and the steps since the last log and logged under ``name`` (``eval_<name>`` at
evaluation); ``log_extra(column, values)`` columns (one value per completion) are kept with the batch's completions
(:func:`extra_columns`), shown with the eval samples in the log, as TRL shows them in its completions table.

Built-ins (their settings are recipe keys):

- ``exact_match``: 1.0 where the completion, stripped, equals the ``reward_reference_column`` value (default
  ``answer``), else 0.0;
- ``format``: 1.0 where the stripped completion matches ``reward_format_pattern`` (a full regular-expression
  match), else 0.0;
- ``length_penalty``: minus the completion's share of ``max_completion_length`` (0 for an empty one, -1 for one
  that used every token).

A reward model scores the prompt and completion as TRL does: their text (message lists through the reward model's
chat template with ``chat_template_kwargs``) through its tokenizer, right-padded, no special tokens added; the
reward is ``logits[:, 0]``. Every rank holds a whole copy on its device (it is not sharded).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.compat import NO_HUB_KERNELS

RewardFn = Callable[..., list[float | None]]


class RewardError(ValueError):
    """A reward function that cannot be found, raises, or returns something that is not one score per completion."""


def _text(completion: Any) -> str:
    """A completion's text: the string, or the content of a ``[{"role": "assistant", "content": ...}]`` one."""
    if isinstance(completion, list) and completion and isinstance(completion[0], dict):
        return str(completion[0].get("content", ""))
    return str(completion)


def exact_match(
    prompts: Sequence[Any], completions: Sequence[Any], *, reference_column: str = "answer", **columns: Any
) -> list[float | None]:
    references = columns.get(reference_column)
    if references is None:
        raise RewardError(
            f"exact_match needs the dataset column {reference_column!r} (reward_reference_column); the columns "
            f"are {sorted(k for k in columns if k != 'completion_ids')}"
        )
    return [float(_text(c).strip() == str(r).strip()) for c, r in zip(completions, references, strict=True)]


def format_match(
    prompts: Sequence[Any], completions: Sequence[Any], *, pattern: str = "", **columns: Any
) -> list[float | None]:
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(_text(c).strip()) is not None) for c in completions]


def length_penalty(
    prompts: Sequence[Any], completions: Sequence[Any], *, max_completion_length: int = 1, **columns: Any
) -> list[float | None]:
    ids = columns["completion_ids"]
    return [-len(i) / max_completion_length for i in ids]


BUILTINS = ("exact_match", "format", "length_penalty")


@dataclass
class RewardContext:
    """What a run gives its reward functions beside the completions, as TRL's ``GRPOTrainer``: ``trainer_state``
    (``state()``: a transformers ``TrainerState`` of the step), ``log_metric`` and ``log_extra``."""

    state: Callable[[], Any] = lambda: None
    metrics: dict[str, list[float]] = field(default_factory=dict)  # logged since the last flush
    extras: dict[str, list[Any]] = field(
        default_factory=dict
    )  # the last scoring's columns, one value per completion

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar of this batch, averaged at the next log."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's ``log_extra``: a column of values, one per completion, shown with the completions."""
        self.extras.setdefault(str(column), []).extend(values)

    def flush(self, device: torch.device) -> dict[str, float]:
        """The mean of each ``log_metric`` name over every rank's values since the last flush, then forgotten.
        Collective (every rank calls it): one host gather of the names, one all-reduce of their sums and counts."""
        names = sorted({n for names in collectives.gather_objects(sorted(self.metrics)) for n in names})
        if not names:
            return {}
        local = [
            x for n in names for x in (sum(self.metrics.get(n, [])), float(len(self.metrics.get(n, []))))
        ]
        total = (
            collectives.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=device)).cpu().tolist()
        )
        self.metrics.clear()
        return {n: total[2 * i] / total[2 * i + 1] for i, n in enumerate(names) if total[2 * i + 1]}


class RewardModel:
    """A sequence-classification model (a folder, e.g. ``recipes/rm.py``'s export, or a hub id) as a reward
    function, scored as TRL's ``GRPOTrainer`` scores one (module docstring). Loaded on ``device``; without one
    (checking a config) it loads on first use."""

    def __init__(
        self,
        path: str,
        *,
        device: torch.device | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.path, self.template_kwargs = path, dict(template_kwargs or {})
        self.model: Any = None
        self.tokenizer: Any = None
        if device is not None:
            self.load(device)

    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                self.path, num_labels=1, **NO_HUB_KERNELS
            )
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as err:
            raise RewardError(
                f"reward model {self.path!r} cannot be loaded as a sequence classifier with its "
                f"tokenizer ({err}); give a folder saved by AutoModelForSequenceClassification "
                "(recipes/rm.py's export) with its tokenizer"
            ) from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The model scores its last non-pad token: it must know the tokenizer's pad id (TRL sets it so too).
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float | None]:
        if self.model is None:
            self.load(torch.device("cpu"))
        if prompts and _conversational(prompts[0]):
            texts = [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **self.template_kwargs)
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        device = next(self.model.parameters()).device
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(device)
        with torch.inference_mode():
            return [float(v) for v in self.model(**inputs).logits[:, 0].float().cpu()]


@dataclass(frozen=True)
class RewardFunction:
    """A named reward function, its weight, and the run's :class:`RewardContext` it is called with."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    context: RewardContext | None = None


def resolve_reward_functions(
    names: Sequence[str],
    weights: Sequence[float] | None = None,
    *,
    reference_column: str = "answer",
    format_pattern: str | None = None,
    max_completion_length: int = 256,
    context: RewardContext | None = None,
    device: torch.device | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[RewardFunction]:
    """The functions ``names`` (built-ins, ``module:function``, or a reward model's folder or hub id) with
    ``weights`` (default 1.0 each), called with ``context``; reward models are loaded on ``device`` (none: later).

    Raises:
        RewardError: an unknown name, a module or attribute that is not there, a bad weight count, a built-in
            missing its setting, a folder that is not a model, naming the value and the fix.
    """
    if not names:
        raise RewardError(
            "reward_funcs is empty: name at least one (exact_match, format, length_penalty, "
            "module:function or a reward model folder)"
        )
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise RewardError(
            f"reward_weights has {len(weights)} values for {len(names)} reward_funcs {list(names)}: "
            "give one weight per function"
        )
    out = []
    for name, weight in zip(names, weights, strict=True):
        shown = name
        if name == "exact_match":
            fn: RewardFn = functools.partial(exact_match, reference_column=reference_column)
        elif name == "format":
            if not format_pattern:
                raise RewardError(
                    "reward 'format' needs reward_format_pattern, a regular expression the whole "
                    "completion must match, e.g. '\\d+ \\w+ \\d{4}'"
                )
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
        elif _model_name(name):
            fn = RewardModel(name, device=device, template_kwargs=template_kwargs)
            shown = name.rstrip("/").split("/")[-1]  # TRL's name: the model id's last part
        else:
            raise RewardError(
                f"reward function {name!r} is not a built-in ({', '.join(BUILTINS)}), module:function "
                "(e.g. my_rewards:accuracy, importable from the working directory), nor a reward "
                "model (a folder with config.json, or a hub id org/name)"
            )
        out.append(RewardFunction(shown, fn, float(weight), context))
    return out


def _model_name(name: str) -> bool:
    """A reward model's folder (with config.json) or a hub id (``org/name``)."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RewardError(
                f"reward function {name!r} is a folder without config.json: give a model folder "
                "saved by save_pretrained (recipes/rm.py's export)"
            )
        return True
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and path.suffix != ".py"


def _import(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(
            f"reward function {spec!r}: module {module_name!r} cannot be imported ({err}); put it on "
            "PYTHONPATH or in the working directory"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def _checked(values: Any, name: str, count: int) -> list[float]:
    """One float per completion (NaN for None or NaN); ints, bools, numpy and 0-d torch scalars taken as TRL's
    ``torch.tensor(values)`` takes them."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__") or len(values) != count:
        raise RewardError(
            f"reward function {name!r} returned {type(values).__name__} of "
            f"{len(values) if hasattr(values, '__len__') else '?'} values for {count} completions: "
            "return a list with one float (or None) per completion"
        )
    out = []
    for i, v in enumerate(values):
        if hasattr(v, "item") and getattr(v, "shape", None) in ((), (1,)):  # numpy or torch scalars
            v = v.item()
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and not math.isinf(float(v)):
            out.append(float(v))  # NaN stays NaN: not applicable, as None
        else:
            raise RewardError(
                f"reward function {name!r} returned {v!r} for completion {i}: give a finite float, "
                "int, bool or None"
            )
    return out


def _conversational(prompt: Any) -> bool:
    """TRL's ``is_conversational`` for a prompt: a list of messages with a role."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def _is_async(fn: Any) -> bool:
    """TRL's ``is_async_callable``: an ``async def`` function, a partial of one, or an object with an async
    ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop on a daemon thread for the process, as TRL's: async functions' clients (HTTP sessions) stay
    bound to one loop across steps, and a caller's own running loop (a notebook) is not touched."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="hf_fsdp2-rewards", daemon=True).start()
            ready.wait()
            _LOOP = loop
    return _LOOP


def _run_async(coroutines: Sequence[Any]) -> list[Any]:
    """The coroutines' results (or exceptions), run concurrently on :func:`_event_loop`."""

    async def together() -> list[Any]:
        return await asyncio.gather(*coroutines, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(together(), _event_loop()).result()


def _call(spec: RewardFunction, kwargs: Mapping[str, Any]) -> Any:
    """One function's values (an async one run to completion)."""
    out = spec.fn(**kwargs)
    if inspect.isawaitable(out):
        out = _run_async([out])[0]
        if isinstance(out, BaseException):
            raise out
    return out


def score_completions(
    functions: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    indices: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rewards [completions, functions] (NaN where a function returned None), each function called as TRL's
    ``GRPOTrainer`` calls it (module docstring); ``completions`` are the decoded texts.

    Raises:
        RewardError: a function raised (named with the first completion it raises on: its example index in the
            dataset when ``indices`` gives them) or returned something else than one score per completion.
    """
    context = next((f.context for f in functions if f.context is not None), None) or RewardContext()
    context.extras.clear()  # the columns of this scoring's completions only
    shown: list[Any] = list(completions)
    if prompts and _conversational(prompts[0]):
        shown = [[{"role": "assistant", "content": c}] for c in completions]
    kwargs = {
        **columns,
        "prompts": list(prompts),
        "completions": shown,
        "completion_ids": list(completion_ids),
        "trainer_state": context.state(),
        "log_extra": context.log_extra,
        "log_metric": context.log_metric,
    }
    results: dict[int, Any] = {}
    later = [i for i, spec in enumerate(functions) if _is_async(spec.fn)]
    for i, spec in enumerate(functions):
        if i not in later:
            try:
                results[i] = spec.fn(**kwargs)
            except RewardError:
                raise
            except Exception as err:
                raise RewardError(_blame(spec, kwargs, indices, err)) from err
    if later:  # concurrently, as TRL's asyncio.gather
        for i, value in zip(later, _run_async([functions[i].fn(**kwargs) for i in later]), strict=True):
            if isinstance(value, RewardError):
                raise value
            if isinstance(value, Exception):
                raise RewardError(_blame(functions[i], kwargs, indices, value)) from value
            results[i] = value
    table = [_checked(results[i], spec.name, len(completions)) for i, spec in enumerate(functions)]
    return torch.tensor(table, dtype=torch.float32).T.reshape(len(completions), len(functions))


def _blame(
    spec: RewardFunction, kwargs: Mapping[str, Any], indices: Sequence[int] | None, err: BaseException
) -> str:
    """The message naming the function and the first completion it raises on alone (its logs discarded)."""
    prompts, completions = kwargs["prompts"], kwargs["completions"]
    quiet = RewardContext()
    for i in range(len(completions)):
        one = {
            k: (v if k == "trainer_state" else [v[i]]) for k, v in kwargs.items() if not k.startswith("log_")
        }
        try:
            _call(spec, {**one, "log_extra": quiet.log_extra, "log_metric": quiet.log_metric})
        except Exception as single:
            where = f"example {indices[i]}" if indices is not None else f"completion {i}"
            return (
                f"reward function {spec.name!r} raised {type(single).__name__}: {single} on {where} "
                f"(prompt {str(prompts[i])[:80]!r}, completion {_text(completions[i])[:80]!r})"
            )
    return (
        f"reward function {spec.name!r} raised {type(err).__name__}: {err} on the batch of {len(completions)}"
    )


def reward_metrics(functions: Sequence[RewardFunction], device: torch.device) -> dict[str, float]:
    """What the functions logged with ``log_metric`` since the last call, averaged over the ranks (collective when
    they have a context: every rank calls it with the same functions)."""
    context = next((f.context for f in functions if f.context is not None), None)
    return context.flush(device) if context is not None else {}


def extra_columns(functions: Sequence[RewardFunction], count: int) -> list[dict[str, Any]]:
    """The last scoring's ``log_extra`` columns, one dict per completion (of ``count``), as TRL's completions table
    shows them: a column of another length than the batch is left out."""
    context = next((f.context for f in functions if f.context is not None), None)
    columns = {k: v for k, v in (context.extras if context is not None else {}).items() if len(v) == count}
    return [{k: v[i] for k, v in columns.items()} for i in range(count)]


def combine(rewards: torch.Tensor, functions: Sequence[RewardFunction]) -> torch.Tensor:
    """The weighted sum over functions per completion (NaN scores skipped; NaN where no function scored it)."""
    weights = torch.tensor([f.weight for f in functions], dtype=rewards.dtype)
    total = (rewards * weights).nansum(dim=1)
    return torch.where(torch.isnan(rewards).all(dim=1), torch.full_like(total, math.nan), total)
