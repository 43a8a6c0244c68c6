"""Records to tokens: `BatchTokenizer`, the per-batch function of `tokenize_dataset`'s map.

Each record is normalised (`hf_fsdp2.data.records`), becomes the strings it needs encoded, and after
one tokenizer call for the whole batch its ``input_ids`` and ``labels`` are assembled: chats by the
chat template's prefix renders (`hf_fsdp2.data.chat_mask`), plain prompt/completion and text as
``[bos] + prompt + completion + [eos]``. Each output row also carries a status (kept, truncated,
dropped as too long, bad) with the reason and message, for `tokenize_dataset` to count and remove.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.data.chat_mask import chat_labels, chat_strings, special_ids
from hf_fsdp2.data.records import RecordError, _Chat, _normalise_record, _Plain, _record_error
from hf_fsdp2.labels import IGNORE_INDEX

# The status of each output row, in the bookkeeping columns the map writes and `tokenize_dataset` removes.
OK, TRUNCATED, DROPPED_LONG, BAD = 0, 1, 2, 3
BOOKKEEPING = ["_status", "_reason", "_message"]
# Declared rather than inferred: a batch of only skipped records would otherwise infer list<null>.
TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int32"),
        "num_targets": datasets.Value("int32"),
        "_status": datasets.Value("int8"),
        "_reason": datasets.Value("string"),
        "_message": datasets.Value("string"),
    }
)


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before the text when adding special tokens (usually just BOS).

    Found by encoding a probe with and without special tokens rather than trusting ``bos_token_id``:
    some tokenizers define a BOS they never add (Qwen), others add one without naming it.
    """
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    special = tokenizer.encode(probe, add_special_tokens=True)
    for start in range(len(special) - len(plain) + 1):
        if special[start : start + len(plain)] == plain:
            return list(special[:start])
    return []


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's EOS id, which ends 'text' and 'prompt_completion' examples.

    Raises:
        ValueError: The tokenizer has no EOS token.
    """
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise ValueError(
            f"The tokenizer has no eos_token (eos_token_id={eos!r}), needed to end 'text' and "
            "'prompt_completion' examples. Set tokenizer.eos_token to the model's end-of-sequence token."
        )
    return eos


def plain_labels(
    plain: _Plain, encoded: list[list[int]], leading: list[int], eos: int
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``leading + prompt + completion + [eos]`` from the encoded prompt and
    completion (encoded apart, so their boundary is a token boundary); the prompt is a target only when
    ``plain.train_prompt``."""
    prompt_ids = leading + encoded[0] if plain.prompt else leading
    completion_ids = encoded[1] + [eos]
    prompt_labels = prompt_ids if plain.train_prompt else [IGNORE_INDEX] * len(prompt_ids)
    return prompt_ids + completion_ids, prompt_labels + completion_ids


class BatchTokenizer:
    """The per-batch function of `tokenize_dataset`'s map (a class so that num_proc workers can pickle it).

    Each record becomes the strings it needs encoded (a conversation: its full render plus, for each
    trained assistant turn, the renders before and through that turn); the strings of the whole batch
    are encoded in one tokenizer call, then every record's ids and labels are assembled.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dataset_format: str,
        max_length: int,
        chat_loss: str,
        completion_only_loss: bool,
        long_examples: str,
        on_bad_record: str,
        source: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.dataset_format = dataset_format
        self.max_length = max_length
        self.chat_loss = chat_loss
        self.completion_only_loss = completion_only_loss
        self.long_examples = long_examples
        self.on_bad_record = on_bad_record
        self.source = source
        chat = dataset_format in ("messages", "conversations", "alpaca", "prompt_completion")
        if dataset_format in ("messages", "conversations", "alpaca") and tokenizer.chat_template is None:
            raise ValueError(
                f"{source or 'The dataset'} holds {dataset_format!r} records, rendered with the tokenizer's chat "
                "template, but the tokenizer has no chat_template. Use the tokenizer of an instruct model, or "
                "set tokenizer.chat_template."
            )
        # Resolved once, outside the per-record code, so a missing EOS fails before any record.
        self.eos = eos_id(tokenizer) if dataset_format in ("prompt_completion", "text") else None
        self.leading = leading_special_ids(tokenizer) if self.eos is not None else []
        self.special_ids = special_ids(tokenizer) if chat else frozenset()

    def _strings(self, item: _Chat | _Plain, record: Mapping[str, Any], index: int) -> list[str]:
        if isinstance(item, _Plain):
            return [item.prompt, item.completion]
        return chat_strings(self.tokenizer, item, source=self.source, index=index, columns=list(record))

    def _assemble(
        self, item: _Chat | _Plain, encoded: list[list[int]], record: Mapping[str, Any], index: int
    ) -> tuple[list[int], list[int]]:
        if isinstance(item, _Plain):
            assert self.eos is not None
            return plain_labels(item, encoded, self.leading, self.eos)
        return chat_labels(
            self.tokenizer,
            item,
            encoded,
            self.special_ids,
            source=self.source,
            index=index,
            columns=list(record),
        )

    def _example(
        self,
        item: _Chat | _Plain | RecordError,
        encoded: list[list[int]],
        record: Mapping[str, Any],
        index: int,
    ) -> tuple[int, str, str, list[int], list[int]]:
        """``(status, reason, message, input_ids, labels)`` of one record; a dropped or bad one has no ids."""
        status, reason, message = OK, "", ""
        input_ids: list[int] = []
        labels: list[int] = []
        try:
            if isinstance(item, RecordError):
                raise item
            input_ids, labels = self._assemble(item, encoded, record, index)
            if len(input_ids) > self.max_length:
                if self.long_examples == "error":
                    raise _record_error(
                        self.source,
                        index,
                        list(record),
                        f"the example is {len(input_ids)} tokens long, more than max_length={self.max_length}",
                        "Raise max_length, or set long_examples=truncate or long_examples=drop.",
                        "longer than max_length",
                    )
                status = DROPPED_LONG if self.long_examples == "drop" else TRUNCATED
                input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        except RecordError as err:
            if self.on_bad_record == "error":
                raise
            status, reason, message, input_ids, labels = BAD, err.reason, str(err), [], []
        if status == DROPPED_LONG:
            input_ids, labels = [], []
        return status, reason, message, input_ids, labels

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        columns = list(batch)
        records = [{c: batch[c][j] for c in columns} for j in range(len(indices))]
        items: list[_Chat | _Plain | RecordError] = []
        strings: list[str] = []
        spans: list[tuple[int, int]] = []
        for record, index in zip(records, indices, strict=True):
            try:
                normalised = _normalise_record(
                    record,
                    self.dataset_format,
                    chat_loss=self.chat_loss,
                    completion_only_loss=self.completion_only_loss,
                    source=self.source,
                    index=index,
                    tools=self.tools,
                )
                record_strings = self._strings(normalised, record, index)
                items.append(normalised)
            except RecordError as err:
                if self.on_bad_record == "error":
                    raise
                items.append(err)  # kept to be counted once the batch is assembled
                record_strings = []
            spans.append((len(strings), len(strings) + len(record_strings)))
            strings.extend(record_strings)
        encoded = self.tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else []

        out: dict[str, list[Any]] = {
            name: [] for name in ("input_ids", "labels", "length", "num_targets", *BOOKKEEPING)
        }
        for record, index, item, (start, stop) in zip(records, indices, items, spans, strict=True):
            status, reason, message, input_ids, labels = self._example(
                item, [list(ids) for ids in encoded[start:stop]], record, index
            )
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
            # labels[0] is never predicted (nothing precedes it), so it does not count as a target.
            out["num_targets"].append(sum(label != IGNORE_INDEX for label in labels[1:]))
            out["_status"].append(status)
            out["_reason"].append(reason)
            out["_message"].append(message)
        return out
