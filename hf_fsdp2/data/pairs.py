"""Preference pairs for DPO: ``prompt`` / ``chosen`` / ``rejected`` records -> token ids with the prompt shared
and a loss mask on the completions only, and the collator that puts chosen and rejected rows in one batch.

Formats (detected per record, as TRL's ``DPOTrainer`` reads them):

* strings: ``prompt`` + ``chosen`` / ``rejected`` are concatenated as text (the dataset carries any leading
  space) and EOS is appended to each completion unless it ends with it;
* message lists: ``prompt`` is rendered with the chat template and the generation prompt, each completion as
  the continuation of ``prompt + chosen`` (what the template emits, end of turn included);
* no ``prompt`` column: the prompt is the longest common prefix of ``chosen`` and ``rejected`` (whole messages
  for message lists), as in Anthropic-HH style data;
* a text ``prompt`` with message-list completions that repeat it (UltraFeedback-binarized style): the shared
  leading messages are the prompt; completions without shared messages follow the text as a user turn;
* ``conversations``-style ShareGPT turns are accepted in the message lists (``from``/``value``).

The prompt tokens are the common prefix of the prompt's tokens and each full sequence's (a token merged
across the boundary belongs to the completion). Sequences longer than ``max_length`` keep their start
(``long_examples: truncate``), or are dropped or refused; a pair whose prompt alone fills ``max_length`` has
no completion left and is dropped (counted). Bad records name their source and index; a pair whose chosen and
rejected are the same (as given, as tokens, or within ``max_length``) is one: it trains at loss ln 2 with no
gradient, teaching nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2.data.records import SHAREGPT_ROLES, RecordError
from hf_fsdp2.data.tool_calls import ToolDataError, parse_tools, template_message
from hf_fsdp2.labels import IGNORE_INDEX

PREFERENCE_COLUMNS = ("chosen", "rejected")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)


def _messages(value: list[Any], where: str, column: str) -> list[dict[str, Any]]:
    """Message dicts for the chat template: role and content, plus an assistant's tool calls and reasoning and a
    tool turn's name and call id (`hf_fsdp2.data.tool_calls.template_message`)."""
    out = []
    for i, m in enumerate(value):
        role = m.get("role", SHAREGPT_ROLES.get(str(m.get("from")), m.get("from")))
        content = m.get("content", m.get("value"))
        try:
            message = template_message({k: v for k, v in m.items() if k not in ("from", "value")})
        except ToolDataError as err:
            raise RecordError(f"{where}: {column} message {i}: {err}", "bad tool call") from err
        if message.get("tool_calls") and content is None:
            content = ""
        if role not in ("system", "user", "assistant", "tool") or not isinstance(content, str):
            raise RecordError(
                f"{where}: {column} message {i} needs a role (system/user/assistant/tool) and text content, got "
                f"{m!r:.200}",
                "bad message",
            )
        out.append({**message, "role": str(role), "content": content})
    return out


def record_tools(record: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A preference record's ``tools`` (`hf_fsdp2.data.tool_calls.parse_tools`), given to the chat template as
    TRL 1.16's DPOTrainer does."""
    try:
        return parse_tools(record.get("tools"))
    except ToolDataError as err:
        raise RecordError(f"{where}: {err}", "bad tools") from err


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_prompt(record: Mapping[str, Any], where: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a record, the prompt extracted as their common prefix when absent.

    Raises:
        RecordError: a missing or empty completion, or mixed types, naming the record.
    """
    chosen: Any = record.get("chosen")
    rejected: Any = record.get("rejected")
    for column, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise RecordError(
                f"{where}: column {column!r} is missing or None (columns: {list(record)})", "missing field"
            )
        if isinstance(value, str) and not value.strip():
            raise RecordError(f"{where}: an empty {column} completion: nothing to prefer", "empty completion")
        if isinstance(value, list) and not value:
            raise RecordError(f"{where}: an empty {column} completion: nothing to prefer", "empty completion")
    prompt = record.get("prompt")
    if isinstance(prompt, str) and _is_messages(chosen) and _is_messages(rejected):
        # UltraFeedback-style: a text prompt, and conversations that already start with it; the shared
        # messages are the prompt. Otherwise the text is the user's turn before the completions.
        shared = _common_prefix(chosen, rejected)
        if shared:
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        else:
            prompt = [{"role": "user", "content": prompt}]
    if prompt is None:
        if _is_messages(chosen) and _is_messages(rejected):
            n = _common_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        elif isinstance(chosen, str) and isinstance(rejected, str):
            n = _common_prefix(chosen, rejected)
            if 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
                n -= 1  # the space before the answers belongs to the completions (as TRL splits them)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not chosen or not rejected:
        raise RecordError(f"{where}: chosen and rejected are the same: nothing to prefer", "empty completion")
    if chosen == rejected:
        raise RecordError(
            f"{where}: chosen and rejected are the same ({str(chosen)[:80]!r}): nothing to prefer (the pair would "
            "train at loss ln 2 with no gradient); fix or remove it, or set on_bad_record=skip",
            "identical pair",
        )
    if isinstance(prompt, str) != isinstance(chosen, str) or isinstance(chosen, str) != isinstance(
        rejected, str
    ):
        raise RecordError(
            f"{where}: prompt, chosen and rejected must all be strings or all message lists", "mixed types"
        )
    return prompt, chosen, rejected


@dataclass(frozen=True, kw_only=True)
class PreferenceStats:
    """What tokenizing the pairs did: counts for the start-of-run summary."""

    pairs: int
    kept: int
    truncated: int
    dropped: int
    skipped: dict[str, int] = field(default_factory=dict)
    read: str = "pairs"  # what ``pairs`` counts (unpaired data: records)
    unit: str = "pairs"  # what ``kept`` counts (unpaired data: examples)

    def describe(self, source: str) -> str:
        skipped = sum(self.skipped.values())
        parts = [
            f"{self.pairs} {self.read}",
            f"{self.truncated} truncated",
            f"{self.dropped} dropped (no room for a completion)",
        ]
        if skipped:
            parts.append(
                f"{skipped} bad records skipped ({', '.join(f'{n} {r}' for r, n in sorted(self.skipped.items()))})"
            )
        return f"preference data {source}: {', '.join(parts)} -> {self.kept} {self.unit}"


def tokenize_pair(
    tokenizer: Any,
    prompt: Any,
    chosen: Any,
    rejected: Any,
    where: str,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)``: the shared prompt and each completion's tokens."""
    prompt_ids, (chosen_ids, rejected_ids) = tokenize_completions(
        tokenizer, prompt, {"chosen": chosen, "rejected": rejected}, where, tools
    )
    return prompt_ids, chosen_ids, rejected_ids


def tokenize_completions(
    tokenizer: Any,
    prompt: Any,
    completions: Mapping[str, Any],
    where: str,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[list[int]]]:
    """The prompt's tokens shared by every completion, and each completion's tokens (``completions``: column ->
    value, strings or message lists like the prompt): strings get EOS appended unless they end with it, message
    lists are rendered with the chat template (the prompt with the generation prompt), which receives ``tools``."""
    if all(isinstance(c, str) for c in completions.values()):
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(prompt)["input_ids"]
        fulls = [
            tokenizer(prompt + (c if c.endswith(eos) else c + eos))["input_ids"] for c in completions.values()
        ]
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise RecordError(
                f"{where}: message lists need a tokenizer with a chat template", "no chat template"
            )
        prompt = _messages(prompt, where, "prompt")

        def render(messages: list[dict[str, Any]], generation: bool) -> list[int]:
            out = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=True, return_dict=True
            )
            return list(out["input_ids"])

        prompt_ids = render(prompt, True) if prompt else []
        fulls = [render(prompt + _messages(c, where, column), False) for column, c in completions.items()]
    n = min(_common_prefix(prompt_ids, full) for full in fulls)
    return list(prompt_ids[:n]), [list(full[n:]) for full in fulls]


def _check_distinct(
    prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int], max_length: int, where: str
) -> None:
    """Refuse a pair whose chosen and rejected rows are the same tokens (whole, or the first ``max_length``
    that train): DPO gets loss ln 2 and no gradient from it."""
    if chosen_ids == rejected_ids:
        raise RecordError(
            f"{where}: chosen and rejected tokenize to the same {len(chosen_ids)} tokens: nothing to prefer; fix "
            "or remove the pair, or set on_bad_record=skip",
            "identical pair",
        )
    room = max_length - len(prompt_ids)
    if room > 0 and chosen_ids[:room] == rejected_ids[:room]:
        raise RecordError(
            f"{where}: chosen and rejected differ only after max_length={max_length} tokens (prompt "
            f"{len(prompt_ids)} tokens), so the trained rows are the same: nothing to prefer; raise max_length, "
            "or set on_bad_record=skip",
            "identical within max_length",
        )


def _margin(record: Mapping[str, Any], where: str) -> float | None:
    """A pair's optional ``margin`` (reward models: ``r_c - r_r`` must exceed it), a finite number or absent."""
    value = record.get("margin")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or abs(value) == float("inf")
    ):
        raise RecordError(
            f"{where}: margin={value!r} is not a finite number; fix it, or set on_bad_record=skip",
            "bad margin",
        )
    return float(value)


def length_fate(prompt: int, completion: int, max_length: int, long_examples: str, where: str) -> str:
    """What happens to a row of ``prompt + completion`` tokens: ``keep``, ``truncate`` (the start kept), or ``drop``
    (``long_examples: drop``, or a prompt that fills ``max_length``: no completion token would be left).

    Raises:
        RecordError: a row longer than ``max_length`` under ``long_examples: error``, naming the record.
    """
    if prompt + completion <= max_length:
        return "keep"
    if long_examples == "error":
        raise RecordError(
            f"{where}: {prompt + completion} tokens, more than max_length={max_length}; raise max_length, or set "
            "long_examples=truncate (keep the start) or drop",
            "too long",
        )
    return "drop" if long_examples == "drop" or prompt >= max_length else "truncate"


def tokenize_pairs(
    records: Any,
    tokenizer: Any,
    *,
    max_length: int,
    long_examples: str = "truncate",
    on_bad_record: str = "error",
    source: str = "",
) -> tuple[list[dict[str, Any]], PreferenceStats]:
    """Tokenize every record of ``records`` (a ``datasets.Dataset`` or a list of dicts) into pairs.

    Returns:
        Pairs ``{"prompt_ids", "chosen_ids", "rejected_ids", "index"}`` (index: the pair's position among the
        kept ones) and the counts.

    Raises:
        RecordError: a bad record (``on_bad_record=error``) or a pair longer than ``max_length``
            (``long_examples=error``), naming the source and the record.
    """
    pairs: list[dict[str, Any]] = []
    truncated = dropped = 0
    skipped: dict[str, int] = {}
    total = 0
    for index, record in enumerate(records):
        total += 1
        where = f"{source} record {index}" if source else f"record {index}"
        try:
            prompt_ids, chosen_ids, rejected_ids = tokenize_pair(
                tokenizer, *split_prompt(record, where), where, record_tools(record, where)
            )
            _check_distinct(prompt_ids, chosen_ids, rejected_ids, max_length, where)
            margin = _margin(record, where)
        except RecordError as err:
            if on_bad_record != "skip":
                raise
            skipped[err.reason] = skipped.get(err.reason, 0) + 1
            continue
        fate = length_fate(
            len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), max_length, long_examples, where
        )
        dropped, truncated = dropped + (fate == "drop"), truncated + (fate == "truncate")
        if fate == "drop":
            continue
        pair = {
            "prompt_ids": prompt_ids,
            "chosen_ids": chosen_ids,
            "rejected_ids": rejected_ids,
            "index": len(pairs),
        }
        if margin is not None:  # a reward model's per-pair margin (TRL's optional column)
            pair["margin"] = margin
        pairs.append(pair)
    return pairs, PreferenceStats(
        pairs=total, kept=len(pairs), truncated=truncated, dropped=dropped, skipped=skipped
    )


@dataclass
class PreferenceCollator:
    """Chosen rows then rejected rows of a micro-batch in one right-padded batch, cut to ``max_length`` each
    (keeping the start), with ``completion_mask`` on the completion tokens only and the pairs' indices.

    Returns ``input_ids``, ``attention_mask``, ``labels`` (completion tokens, ``IGNORE_INDEX`` elsewhere),
    ``completion_mask`` (``[2B, L]``) and ``pair_index`` (``[B]``).
    """

    pad_token_id: int
    max_length: int

    def __call__(self, pairs: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows, masks = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for pair in pairs:
                ids = (list(pair["prompt_ids"]) + list(pair[key]))[: self.max_length]
                mask = ([0] * len(pair["prompt_ids"]) + [1] * len(pair[key]))[: self.max_length]
                rows.append(ids)
                masks.append(mask)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        completion = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(zip(rows, masks, strict=True)):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
            completion[i, : len(mask)] = torch.tensor(mask)
        labels = input_ids.masked_fill(completion == 0, IGNORE_INDEX)
        out = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "labels": labels,
            "completion_mask": completion,
            "pair_index": torch.tensor([int(p["index"]) for p in pairs], dtype=torch.long),
        }
        if all("margin" in p for p in pairs) and pairs:
            out["margin"] = torch.tensor([float(p["margin"]) for p in pairs], dtype=torch.float32)
        return out
