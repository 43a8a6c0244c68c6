"""Unpaired preference data for KTO: ``prompt`` / ``completion`` / ``label`` records (TRL's unpaired format) ->
tokenized examples, each with the completion of another example for the KL estimate, and their collator.

Formats, as TRL's ``KTOTrainer`` reads them: strings (EOS appended to a completion unless it ends with it) or message
lists (the prompt rendered with the generation prompt, the completion as its continuation); the prompt's tokens are
the common prefix of the prompt's and the whole sequence's. ``label`` is a boolean: true for a desirable completion,
false for an undesirable one. Paired data (``chosen`` / ``rejected``, a prompt column or not) is unpaired as TRL's
``unpair_preference_dataset`` does: within each block of 1,000 pairs, every chosen completion (label true), then
every rejected one (label false).

KL completions (KTO's reference point): the examples are grouped as the sampler deals them out in dataset order
(rank ``r``'s ``k``-th micro-batch takes positions ``r + world·(k·B + j)``) and each takes the completion of the one
before it in its group, the first the last's: TRL's rotation "by +1 within each per-device batch". With
``train_sampling_strategy: sequential`` the KL completions of a micro-batch are its own completions paired with other
prompts, as in TRL; with random sampling they are fixed mismatched completions of other examples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_fsdp2.data.pairs import (
    PreferenceCollator,
    PreferenceStats,
    length_fate,
    record_tools,
    split_prompt,
    tokenize_completions,
)
from hf_fsdp2.data.records import RecordError

UNPAIR_BLOCK = (
    1000  # pairs per block when unpairing, as datasets' map batches TRL's unpair_preference_dataset
)


def unpair(records: Sequence[Mapping[str, Any]], source: str = "") -> list[dict[str, Any]]:
    """Paired records -> unpaired ones (``prompt``, ``completion``, ``label``, ``where``: the pair it came from).

    Raises:
        RecordError: a pair :func:`~hf_fsdp2.data.pairs.split_prompt` refuses (the caller may skip it).
    """
    out: list[dict[str, Any]] = []
    for start in range(0, len(records), UNPAIR_BLOCK):
        block: list[tuple[Any, ...]] = []
        for index in range(start, min(start + UNPAIR_BLOCK, len(records))):
            where = f"{source} record {index}" if source else f"record {index}"
            try:
                block.append((where, *split_prompt(records[index], where), records[index].get("tools")))
            except RecordError as err:
                block.append((where, err))
        for label, position in ((True, 2), (False, 3)):
            for item in block:
                if isinstance(item[1], RecordError):
                    if label:  # counted once, with the pair
                        out.append({"where": item[0], "error": item[1]})
                    continue
                out.append(
                    {
                        "prompt": item[1],
                        "completion": item[position],
                        "label": label,
                        "where": item[0],
                        "tools": item[4],
                    }
                )
    return out


def check_record(record: Mapping[str, Any], where: str) -> tuple[Any, Any, bool]:
    """``(prompt, completion, label)`` of an unpaired record.

    Raises:
        RecordError: a missing or empty prompt/completion, mixed types, or a label that is not a boolean.
    """
    for column in ("prompt", "completion", "label"):
        if record.get(column) is None:
            raise RecordError(
                f"{where}: column {column!r} is missing or None (columns: {list(record)}); KTO data needs prompt, "
                "completion and a boolean label (or chosen/rejected pairs)",
                "missing field",
            )
    prompt, completion, label = record["prompt"], record["completion"], record["label"]
    if not isinstance(label, bool) and type(label).__name__ != "bool_":  # numpy's bool too
        raise RecordError(
            f"{where}: label={label!r} ({type(label).__name__}) is not a boolean: true marks a desirable completion, "
            "false an undesirable one; fix it, or set on_bad_record=skip",
            "non-boolean label",
        )
    if (isinstance(completion, str) and not completion.strip()) or (
        isinstance(completion, list) and not completion
    ):
        raise RecordError(f"{where}: an empty completion: nothing to learn from", "empty completion")
    if isinstance(prompt, str) != isinstance(completion, str):
        raise RecordError(
            f"{where}: prompt and completion must both be strings or message lists", "mixed types"
        )
    return prompt, completion, bool(label)


def tokenize_unpaired(
    records: Any,
    tokenizer: Any,
    *,
    max_length: int,
    long_examples: str = "truncate",
    on_bad_record: str = "error",
    source: str = "",
) -> tuple[list[dict[str, Any]], PreferenceStats]:
    """Tokenize unpaired records (or paired ones, unpaired first) into examples.

    Returns:
        Examples ``{"prompt_ids", "completion_ids", "label", "index"}`` (index: the position among the kept ones) and
        the counts (``pairs``: the records read; ``kept``: the examples).

    Raises:
        RecordError: a bad record (``on_bad_record=error``) or an example longer than ``max_length``
            (``long_examples=error``), naming the source and the record.
    """
    rows = list(records)
    total = len(rows)
    paired = bool(rows) and "chosen" in rows[0] and "rejected" in rows[0]
    items = (
        unpair(rows, source)
        if paired
        else [{**r, "where": f"{source} record {i}" if source else f"record {i}"} for i, r in enumerate(rows)]
    )
    examples: list[dict[str, Any]] = []
    truncated = dropped = 0
    skipped: dict[str, int] = {}
    for item in items:
        where = item["where"]
        try:
            if "error" in item:
                raise item["error"]
            prompt, completion, label = check_record(item, where)
            prompt_ids, (completion_ids,) = tokenize_completions(
                tokenizer, prompt, {"completion": completion}, where, record_tools(item, where)
            )
            if not completion_ids:
                raise RecordError(f"{where}: the completion has no token of its own", "empty completion")
        except RecordError as err:
            if on_bad_record != "skip":
                raise
            skipped[err.reason] = skipped.get(err.reason, 0) + 1
            continue
        fate = length_fate(len(prompt_ids), len(completion_ids), max_length, long_examples, where)
        dropped, truncated = dropped + (fate == "drop"), truncated + (fate == "truncate")
        if fate == "drop":
            continue
        examples.append(
            {
                "prompt_ids": prompt_ids,
                "completion_ids": completion_ids,
                "label": label,
                "index": len(examples),
            }
        )
    return examples, PreferenceStats(
        pairs=total,
        kept=len(examples),
        truncated=truncated,
        dropped=dropped,
        skipped=skipped,
        read="records",
        unit="examples",
    )


def kl_groups(n: int, *, world_size: int, batch_size: int) -> list[list[int]]:
    """The positions ``0..n-1`` grouped as the sequential sampler (or :func:`~hf_fsdp2.train.logps.even_batches`) deals
    them: rank ``r``'s ``k``-th batch is ``r + world·(k·B + j)``; the positions past a multiple of ``world`` (which the
    sampler drops) form their own group."""
    cut = n - n % world_size
    groups = []
    for rank in range(world_size):
        mine = list(range(rank, cut, world_size))
        groups += [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    if cut < n:
        groups.append(list(range(cut, n)))
    return groups


def with_kl_completions(
    examples: Sequence[Mapping[str, Any]], *, world_size: int, batch_size: int
) -> list[dict[str, Any]]:
    """Each example with ``kl_ids``: the completion of the example before it in its :func:`kl_groups` group (the
    first takes the last's), and ``index`` its position."""
    out = [dict(e, index=i) for i, e in enumerate(examples)]
    for group in kl_groups(len(out), world_size=world_size, batch_size=batch_size):
        if len(group) == 1 and len(out) > 1:  # alone in its group: another example's, not its own
            other = group[0] - 1 if group[0] else 1
            out[group[0]]["kl_ids"] = list(examples[other]["completion_ids"])
            continue
        for j, position in enumerate(group):
            out[position]["kl_ids"] = list(examples[group[j - 1]]["completion_ids"])
    return out


@dataclass
class UnpairedCollator:
    """A micro-batch of B examples: B rows of prompt + completion, then (``kl``) B rows of prompt + KL completion,
    right-padded together and cut to ``max_length`` each, as :class:`~hf_fsdp2.data.pairs.PreferenceCollator`
    lays out chosen and rejected rows; plus ``label`` (``[B]`` bool) and ``pair_index`` (the examples' indices).
    """

    pad_token_id: int
    max_length: int
    kl: bool = True

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [
            {
                "prompt_ids": e["prompt_ids"],
                "chosen_ids": e["completion_ids"],
                "rejected_ids": e["kl_ids"] if self.kl else [],
                "index": e["index"],
            }
            for e in examples
        ]
        batch = PreferenceCollator(self.pad_token_id, self.max_length)(rows)
        if not self.kl:
            b = len(rows)
            batch = {k: v if k == "pair_index" else v[:b] for k, v in batch.items()}
            width = int(batch["attention_mask"].sum(dim=1).max())
            batch = {k: v if k == "pair_index" else v[:, :width] for k, v in batch.items()}
        batch["label"] = torch.tensor([bool(e["label"]) for e in examples], dtype=torch.bool)
        return batch
