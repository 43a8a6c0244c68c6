"""Image records to tokens: `VisionBatchTokenizer`, the per-batch function of `tokenize_dataset`'s map when the data
has images (`hf_fsdp2.data.images`).

The model's processor builds the sequence: the chat template writes each image part as the family's marker and the
processor expands it into the image's tokens (their number follows the image's size for Qwen's and Idefics3's
processors), so every render of the conversation is processed with the images it holds. The loss mask is the text
one (`hf_fsdp2.data.chat_mask`: the prefix renders diffed, over the processed ids), and the image's tokens never
carry a loss whatever ``chat_loss`` says (TRL leaves them in the labels when ``assistant_only_loss`` is off).

Each example keeps its full render and its images beside ``input_ids`` and ``labels``: the collator
(`hf_fsdp2.data.vision_collate`) runs the processor again on them for the pixels, which are not cached (a
processed image is many times the size of the file).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
from datasets.fingerprint import Hasher

from hf_fsdp2.data.chat_mask import chat_labels, chat_renders, render, special_ids
from hf_fsdp2.data.encode import BAD, BOOKKEEPING, DROPPED_LONG, OK, TOKENIZED_FEATURES, TRUNCATED
from hf_fsdp2.data.images import image_parts, open_image, record_images, vision_chat
from hf_fsdp2.data.records import RecordError, _record_error
from hf_fsdp2.labels import IGNORE_INDEX

VISION_FEATURES = datasets.Features(
    {
        **TOKENIZED_FEATURES,
        "text": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
    }
)
"""The tokenized columns of an image dataset: the text ones, the full render and the record's images."""


def processor_chat_template(processor: Any) -> str:
    """The chat template a processor renders conversations with (its own, else its tokenizer's; a named set's
    ``default``).

    Raises:
        ValueError: neither has one.
    """
    template = getattr(processor, "chat_template", None) or processor.tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", next(iter(template.values()), None))
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{type(processor).__name__} has no chat template (nor has its tokenizer): image records are rendered "
            "with it; use the processor of an instruct checkpoint, or set processor.chat_template"
        )
    return template


def processed_ids(processor: Any, text: str, images: list[Any]) -> list[int]:
    """The token ids the processor gives ``text`` with ``images`` (no special tokens added: the template writes
    them)."""
    out = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    return [int(i) for i in out["input_ids"][0]]


def image_token_ids(processor: Any) -> frozenset[int]:
    """The special tokens the processor writes for an image (the image token, and the markers and grid tokens
    around it): a one-image turn's processed ids that a text-only turn's lack, special tokens only."""
    from PIL import Image

    template = processor_chat_template(processor)
    tokenizer = processor.tokenizer
    text = [{"type": "text", "text": "a"}]

    def ids(parts: list[dict[str, Any]], images: list[Any]) -> set[int]:
        turns = [{"role": "user", "content": parts}, {"role": "assistant", "content": text}]
        rendered = tokenizer.apply_chat_template(turns, tokenize=False, chat_template=template)
        return set(processed_ids(processor, rendered, images))

    with_image = ids([{"type": "image"}, *text], [Image.new("RGB", (32, 32), (127, 127, 127))])
    found = (with_image - ids(text, [])) & special_ids(tokenizer)
    own = getattr(processor, "image_token_id", None)
    return frozenset(found | ({own} if isinstance(own, int) else set()))


def processor_fingerprint(processor: Any) -> str:
    """What decides how the processor expands images: its class, its image processor's settings and its template
    (the tokenizer is fingerprinted apart)."""
    image_processor = getattr(processor, "image_processor", None)
    settings = image_processor.to_json_string() if image_processor is not None else ""
    keys = {k: v for k, v in vars(processor).items() if isinstance(v, (int, str, float, bool)) or v is None}
    return str(Hasher.hash([type(processor).__name__, settings, sorted(keys.items(), key=str)]))


class VisionBatchTokenizer:
    """The per-batch function of `tokenize_dataset`'s map for image records (a class so that num_proc workers can
    pickle it). Each render of a conversation is processed with the images of the turns it holds."""

    def __init__(
        self,
        processor: Any,
        *,
        max_length: int,
        chat_loss: str,
        long_examples: str,
        on_bad_record: str,
        source: str,
        image_root: Path | None,
    ) -> None:
        self.processor = processor
        self.template = processor_chat_template(processor)
        self.tokenizer = processor.tokenizer
        self.special = special_ids(self.tokenizer)
        self.image_ids = image_token_ids(processor)
        self.max_length = max_length
        self.chat_loss = chat_loss
        self.long_examples = long_examples
        self.on_bad_record = on_bad_record
        self.source = source
        self.image_root = image_root

    def _encode(
        self, record: Mapping[str, Any], index: int
    ) -> tuple[int, list[int], list[int], str, list[Any]]:
        """``(status, input_ids, labels, full render, stored images)`` of one record."""
        stored = record_images(record, self.image_root, self.source, index)
        chat = vision_chat(record, len(stored), chat_loss=self.chat_loss, source=self.source, index=index)
        columns = list(record)
        try:
            pictures = [open_image(s) for s in stored]
        except OSError as err:
            raise _record_error(
                self.source, index, columns, f"an image does not open: {err}", "Fix or drop it.", "bad image"
            ) from err
        encoded, texts = [], []
        for turns, prompt in chat_renders(chat):
            text = render(
                self.tokenizer,
                turns,
                prompt,
                source=self.source,
                index=index,
                columns=columns,
                chat_template=self.template,
            )
            encoded.append(processed_ids(self.processor, text, pictures[: image_parts(turns)]))
            texts.append(text)
        input_ids, labels = chat_labels(
            self.tokenizer, chat, encoded, self.special, source=self.source, index=index, columns=columns
        )
        labels = [
            IGNORE_INDEX if i in self.image_ids else label for i, label in zip(input_ids, labels, strict=True)
        ]
        status = OK
        if len(input_ids) > self.max_length:
            cut = [i for i in input_ids[self.max_length :] if i in self.image_ids]
            if self.long_examples == "error" or (self.long_examples == "truncate" and cut):
                why = (
                    f"cutting it there would cut {len(cut)} image tokens (the model needs every token of an image)"
                    if cut
                    else "long_examples=error"
                )
                raise _record_error(
                    self.source,
                    index,
                    columns,
                    f"the example is {len(input_ids)} tokens long, more than max_length={self.max_length}; {why}",
                    "Raise max_length, or set long_examples=drop.",
                    "longer than max_length",
                )
            status = DROPPED_LONG if self.long_examples == "drop" else TRUNCATED
            input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        return status, input_ids, labels, texts[0], stored

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        columns = list(batch)
        out: dict[str, list[Any]] = {
            name: []
            for name in ("input_ids", "labels", "length", "num_targets", "text", "images", *BOOKKEEPING)
        }
        for j, index in enumerate(indices):
            record = {c: batch[c][j] for c in columns}
            reason = message = text = ""
            input_ids: list[int] = []
            labels: list[int] = []
            images: list[Any] = []
            try:
                status, input_ids, labels, text, images = self._encode(record, index)
            except RecordError as err:
                if self.on_bad_record == "error":
                    raise
                status, reason, message = BAD, err.reason, str(err)
            if status in (DROPPED_LONG, BAD):
                input_ids, labels, text, images = [], [], "", []
            out["input_ids"].append(input_ids)
            out["labels"].append(labels)
            out["length"].append(len(input_ids))
            # labels[0] is never predicted (nothing precedes it), so it does not count as a target.
            out["num_targets"].append(sum(label != IGNORE_INDEX for label in labels[1:]))
            out["text"].append(text)
            out["images"].append(images)
            out["_status"].append(status)
            out["_reason"].append(reason)
            out["_message"].append(message)
        return out
