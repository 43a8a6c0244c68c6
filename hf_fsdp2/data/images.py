"""Image records: TRL's vision-language format read into a conversation and its images.

A record is conversational ``messages`` beside an ``images`` column (a list) or an ``image`` column (one image), as
TRL's SFTTrainer takes them. A turn's content is a string or a list of parts, ``{"type": "image"}`` and
``{"type": "text", "text": ...}``; an image part takes the record's next image, in order. When no turn has an image part
(every content a string), the images go before the text of the first user turn, as TRL places them. An image is a
path (relative to the data file's folder), bytes, a PIL image, or the ``{"bytes", "path"}`` dict the ``datasets``
Image feature stores; a record with no image (an empty or null list) is a text row of the same run.

What comes out is a :class:`~hf_fsdp2.data.records._Chat` whose contents are part lists (the chat template writes
each image part as the family's marker, which the processor expands) and the images in their stored form.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_fsdp2.data.records import (
    TOOL_CHAT_ROLES,
    _Chat,
    _check_role_order,
    _record_error,
    _trained_turns,
)

IMAGE_COLUMNS = ("images", "image")
"""The columns that hold a record's images (TRL's names): a list, or a single image."""

_FIX = "Fix or drop the record, or set on_bad_record=skip to skip such records."


def image_column(columns: Sequence[str]) -> str | None:
    """The image column among ``columns`` (``images`` first), or None for a text dataset."""
    return next((c for c in IMAGE_COLUMNS if c in columns), None)


def image_root(source_name: str) -> Path | None:
    """The folder a source's relative image paths are read from: a local data file's folder (or the folder itself);
    None for a hub dataset (the working directory)."""
    path = Path(source_name).expanduser()
    if path.is_file():
        return path.parent.resolve()
    return path.resolve() if path.is_dir() else None


def stored_image(value: Any, root: Path | None) -> dict[str, Any]:
    """``value`` in the form the ``datasets`` Image feature stores: ``{"bytes", "path"}``.

    Args:
        value: a path, bytes, a PIL image or such a dict.
        root: the folder a relative path is read from (the data file's), None: the working directory.

    Raises:
        ValueError: a value of another type, or a path that does not exist.
    """
    from PIL import Image

    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        if value.get("bytes"):
            return {"bytes": bytes(value["bytes"]), "path": None}
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": None}
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")  # lossless: the pixels the processor sees are the record's
        return {"bytes": buffer.getvalue(), "path": None}
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        if not path.is_absolute() and root is not None:
            path = root / path
        if not path.is_file():
            raise ValueError(f"image file {value!r} does not exist (resolved to {str(path.resolve())!r})")
        return {"bytes": None, "path": str(path.resolve())}
    raise ValueError(
        f"an image must be a path, bytes, a PIL image or a {{'bytes', 'path'}} dict, got {type(value).__name__}"
    )


def open_image(stored: Mapping[str, Any]) -> Any:
    """The PIL image of a :func:`stored_image` value, read in full (its file closed)."""
    from PIL import Image

    source = io.BytesIO(stored["bytes"]) if stored.get("bytes") else stored["path"]
    with Image.open(source) as image:
        image.load()
        return image.copy()  # as the record holds it: the processor converts it as for TRL (do_convert_rgb)


def record_images(
    record: Mapping[str, Any], root: Path | None, source: str, index: int
) -> list[dict[str, Any]]:
    """The record's images (``images`` list or ``image``), stored (:func:`stored_image`); [] for a text row.

    Raises:
        RecordError: a column of the wrong type or an image that cannot be read as one, naming the record.
    """
    column = image_column(list(record))
    value = record.get(column) if column else None
    if value is None:
        return []
    values = [value] if column == "image" else value
    if not isinstance(values, (list, tuple)):
        raise _record_error(
            source,
            index,
            list(record),
            f"column 'images' must be a list of images, got {type(values).__name__}",
            "Give a list (or name the column 'image' for one image per record).",
            "bad image",
        )
    try:
        return [stored_image(v, root) for v in values]
    except ValueError as err:
        raise _record_error(source, index, list(record), str(err), _FIX, "bad image") from err


def _parts(
    content: Any, record: Mapping[str, Any], source: str, index: int, turn: int
) -> list[dict[str, Any]]:
    """A turn's content as template parts: a string becomes one text part; a list keeps its image and text parts
    (keys ``datasets`` fills with None dropped)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _record_error(
            source,
            index,
            list(record),
            f"message {turn} content must be a string or a list of parts, got {type(content).__name__}",
            _FIX,
            "non-string content",
        )
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "video":
            raise _record_error(
                source,
                index,
                list(record),
                f"message {turn} has a video part: this version trains on images and text, not videos",
                "Drop the record, or give the video's frames as images.",
                "video",
            )
        if kind == "image":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise _record_error(
                source,
                index,
                list(record),
                f"message {turn} has a part {part!r:.120} that is neither {{'type': 'image'}} nor "
                "{'type': 'text', 'text': str}",
                _FIX,
                "bad content part",
            )
    return parts


def image_parts(turns: Sequence[Mapping[str, Any]]) -> int:
    """The image parts of ``turns``."""
    return sum(p["type"] == "image" for t in turns for p in t["content"])


def vision_chat(record: Mapping[str, Any], images: int, *, chat_loss: str, source: str, index: int) -> _Chat:
    """A ``messages`` record with ``images`` images as a conversation of part lists.

    Raises:
        RecordError: a bad role, role order, content or part; an empty assistant turn; or image parts that do not
            match the record's image count.
    """
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _record_error(
            source,
            index,
            list(record),
            "column 'messages' must be a non-empty list of turns",
            _FIX,
            "missing field",
        )
    videos = next((c for c in ("videos", "video") if record.get(c)), None)
    if videos:
        raise _record_error(
            source,
            index,
            list(record),
            f"the record has videos (column {videos!r}): this version trains on images and text, not videos",
            "Drop the record or the column, or give the video's frames as images.",
            "video",
        )
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in TOOL_CHAT_ROLES or role == "tool":
            raise _record_error(
                source,
                index,
                list(record),
                f"message {i} has role {role!r}; image records take the roles system, user and assistant",
                "Map the role to one of them or drop the record.",
                "unknown role",
            )
        parts = _parts(message.get("content"), record, source, index, i)
        if role == "assistant" and not any(p["type"] == "text" and p["text"].strip() for p in parts):
            raise _record_error(
                source,
                index,
                list(record),
                f"message {i} is an assistant turn without text",
                "Drop the record or the empty turn: it would teach the model to answer with nothing.",
                "empty assistant turn",
            )
        turns.append({"role": role, "content": parts})
    _check_role_order(turns, record, source, index)
    if images and not image_parts(turns):
        # TRL's placement: the images before the text of the first user turn.
        first = next(i for i, t in enumerate(turns) if t["role"] == "user")
        turns[first]["content"] = [{"type": "image"}] * images + turns[first]["content"]
    if image_parts(turns) != images:
        raise _record_error(
            source,
            index,
            list(record),
            f"the messages have {image_parts(turns)} image parts but the record has {images} images",
            "Give one image per {'type': 'image'} part (or no image part at all: the images then go before the "
            "first user text).",
            "image count mismatch",
        )
    return _Chat(turns, _trained_turns(turns, chat_loss))


def check_image_format(dataset_format: str, columns: Sequence[str], source: str) -> None:
    """Refuse image columns beside a record format other than ``messages`` (the one image format this version
    reads).

    Raises:
        ValueError: naming the columns and the fix.
    """
    if dataset_format != "messages":
        raise ValueError(
            f"{source or 'the dataset'} has an image column ({image_column(columns)!r}) beside "
            f"{dataset_format!r} records (columns: {list(columns)}); images are read with conversational "
            "'messages' records only (TRL's vision format): write the prompt and answer as user and assistant "
            "turns whose content has {'type': 'image'} parts"
        )
