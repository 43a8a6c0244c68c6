"""Record formats: detecting which format a dataset holds, validating records, and normalising them into
what gets tokenized.

Formats (a column mapping renames other column names first):

* ``messages``: OpenAI chat, a list of ``{"role", "content"}`` turns (system, user, assistant);
* ``conversations``: ShareGPT, a list of ``{"from", "value"}`` turns (``human``/``gpt``/``system``...);
* ``prompt_completion``: ``prompt`` and ``completion``, two strings or two lists of chat turns;
* ``alpaca``: ``instruction``, optional ``input``, ``output`` (and optional ``system``), rendered as a
  user/assistant chat with the tokenizer's chat template;
* ``text``: one string, loss on every token.

Bad records are errors naming the source, the record index and the problem unless
``on_bad_record="skip"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


DATASET_FORMATS = ("messages", "conversations", "prompt_completion", "alpaca", "text")
"""Record formats in the order `detect_format` tries them."""

CHAT_ROLES = ("system", "user", "assistant")
CHAT_LOSSES = ("assistant", "last_assistant", "all")
"""Chat targets: every assistant turn, the last assistant turn only, or every token."""
LONG_EXAMPLE_POLICIES = ("truncate", "drop", "error")
BAD_RECORD_POLICIES = ("error", "skip")

# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


# Columns each format needs: what `detect_format` looks for and `tokenize_dataset` checks.
_FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "conversations": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}


def detect_format(column_names: Sequence[str]) -> str:
    """Decide which record format a dataset holds from its column names.

    Priority: ``messages`` > ``conversations`` > ``prompt_completion`` (needs ``prompt`` and
    ``completion``) > ``alpaca`` (needs ``instruction`` and ``output``) > ``text``.

    Args:
        column_names: The dataset's column names (after any column mapping).

    Returns:
        One of ``DATASET_FORMATS``.

    Raises:
        ValueError: None of the formats' columns are present; the message lists what was found.
    """
    columns = set(column_names)
    for name in DATASET_FORMATS:
        if columns.issuperset(_FORMAT_COLUMNS[name]):
            return name
    expected = "; ".join(f"{name}: {list(cols)}" for name, cols in _FORMAT_COLUMNS.items())
    raise ValueError(
        f"Cannot detect the dataset format from columns {list(column_names)}. Expected one of "
        f"({expected}). Rename the columns with dataset_column_mapping (e.g. 'question=prompt,answer=completion')."
    )


class RecordError(ValueError):
    """A record that cannot become a training example: names the source, the record and the problem.

    Attributes:
        reason: A short category (``"wrong role order"``, ``"missing field"``...) used to count skipped
            records by reason.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through their args; the extra attribute must survive `num_proc` workers.
        return (RecordError, (str(self), self.reason))


def _record_error(
    source: str, index: int, columns: Sequence[str], problem: str, fix: str, reason: str
) -> RecordError:
    where = f"{source} record {index}" if source else f"record {index}"
    return RecordError(f"{where}: {problem} (columns found: {list(columns)}). {fix}", reason)


_FIX = "Fix or drop the record, or set on_bad_record=skip to skip such records."


def _required_string(record: Mapping[str, Any], column: str, source: str, index: int) -> str:
    value = record.get(column)
    if value is None:
        raise _record_error(
            source, index, list(record), f"column {column!r} is missing or None", _FIX, "missing field"
        )
    if not isinstance(value, str):
        raise _record_error(
            source,
            index,
            list(record),
            f"column {column!r} must be a string, got {type(value).__name__}",
            _FIX,
            "non-string content",
        )
    return value


def _validated_turns(
    turns_value: Any,
    record: Mapping[str, Any],
    source: str,
    index: int,
    *,
    column: str,
    role_key: str,
    content_key: str,
    role_names: Mapping[str, str],
) -> list[dict[str, str]]:
    """Check a list of chat turns and return them as ``{"role", "content"}`` dicts (other keys dropped)."""
    columns = list(record)
    if turns_value is None:
        raise _record_error(
            source, index, columns, f"column {column!r} is missing or None", _FIX, "missing field"
        )
    if not isinstance(turns_value, list) or not turns_value:
        raise _record_error(
            source,
            index,
            columns,
            f"{column!r} must be a non-empty list of {{{role_key!r}, {content_key!r}}} dicts, got {turns_value!r:.200}",
            _FIX,
            "missing field",
        )
    turns: list[dict[str, str]] = []
    for turn_index, message in enumerate(turns_value):
        if not isinstance(message, Mapping):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} must be a dict with {role_key!r} and {content_key!r}, got "
                f"{type(message).__name__}",
                _FIX,
                "missing field",
            )
        raw_role, content = message.get(role_key), message.get(content_key)
        role = role_names.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} has unknown role {raw_role!r}; supported roles: {list(role_names)}",
                "Map the role to one of the supported ones or drop the record.",
                "unknown role",
            )
        if content is None and content_key not in message:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} ({role}) has no {content_key!r}",
                _FIX,
                "missing field",
            )
        if not isinstance(content, str):
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} ({role}) content must be a string, got {type(content).__name__}",
                "Only text content is supported; flatten multi-part content to a string.",
                "non-string content",
            )
        if role == "assistant" and not content.strip():
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} is an empty assistant turn",
                "Drop the record or the empty turn: it would teach the model to answer with nothing.",
                "empty assistant turn",
            )
        # Only role and content are passed on: Arrow fills keys that other records have (name,
        # tool_calls, ...) with None, and templates test such keys with `is defined`.
        turns.append({"role": role, "content": content})
    return turns


def _check_role_order(
    turns: list[dict[str, str]], record: Mapping[str, Any], source: str, index: int
) -> None:
    """Optional system turn, then user and assistant alternating, starting with user, ending with assistant."""
    roles = [turn["role"] for turn in turns]
    if "assistant" not in roles:
        raise _record_error(
            source,
            index,
            list(record),
            f"the conversation has no assistant turn (roles: {roles})",
            "Every conversation needs at least one assistant turn to learn from; drop the record.",
            "no assistant turn",
        )
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected or body[-1:] != ["assistant"]:
        raise _record_error(
            source,
            index,
            list(record),
            f"wrong role order {roles}: expected an optional system turn, then user and assistant turns "
            "alternating, starting with user and ending with assistant",
            _FIX,
            "wrong role order",
        )


@dataclass
class _Chat:
    """A conversation and the indices of the assistant turns to train on (None: every token)."""

    messages: list[dict[str, str]]
    trained: list[int] | None


@dataclass
class _Plain:
    """``[bos] + prompt + completion + [eos]``; ``prompt`` is a target when ``train_prompt``."""

    prompt: str
    completion: str
    train_prompt: bool


def _trained_turns(messages: list[dict[str, str]], chat_loss: str, first: int = 0) -> list[int] | None:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if chat_loss == "all":
        return None
    if chat_loss == "last_assistant":
        return assistant[-1:]
    return assistant


def _normalise_record(
    record: Mapping[str, Any],
    dataset_format: str,
    *,
    chat_loss: str,
    completion_only_loss: bool,
    source: str,
    index: int,
) -> _Chat | _Plain:
    """Turn a record of any format into a conversation or a plain prompt/completion (or text)."""
    if dataset_format == "messages":
        turns = _validated_turns(
            record.get("messages"), record, source, index,
            column="messages", role_key="role", content_key="content", role_names={r: r for r in CHAT_ROLES},
        )  # fmt: skip
        _check_role_order(turns, record, source, index)
        return _Chat(turns, _trained_turns(turns, chat_loss))
    if dataset_format == "conversations":
        turns = _validated_turns(
            record.get("conversations"), record, source, index,
            column="conversations", role_key="from", content_key="value", role_names=SHAREGPT_ROLES,
        )  # fmt: skip
        system = record.get("system")
        if isinstance(system, str) and system.strip() and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": system})
        _check_role_order(turns, record, source, index)
        return _Chat(turns, _trained_turns(turns, chat_loss))
    if dataset_format == "alpaca":
        instruction = _required_string(record, "instruction", source, index)
        output = _required_string(record, "output", source, index)
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise _record_error(
                source, index, list(record), f"column 'input' must be a string, got {type(extra).__name__}",
                _FIX, "non-string content",
            )  # fmt: skip
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        alpaca_turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        system = record.get("system")
        if isinstance(system, str) and system.strip():
            alpaca_turns.insert(0, {"role": "system", "content": system})
        if not output.strip():
            raise _record_error(
                source, index, list(record), "column 'output' is an empty assistant turn",
                "Drop the record: it would teach the model to answer with nothing.", "empty assistant turn",
            )  # fmt: skip
        return _Chat(alpaca_turns, _trained_turns(alpaca_turns, chat_loss))
    if dataset_format == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            # Conversational prompt/completion (as in TRL): two lists of turns rendered as one chat.
            names = {r: r for r in CHAT_ROLES}
            prompt_turns = _validated_turns(
                prompt,
                record,
                source,
                index,
                column="prompt",
                role_key="role",
                content_key="content",
                role_names=names,
            )
            completion_turns = _validated_turns(
                completion, record, source, index,
                column="completion", role_key="role", content_key="content", role_names=names,
            )  # fmt: skip
            turns = prompt_turns + completion_turns
            _check_role_order(turns, record, source, index)
            first = len(prompt_turns)
            return _Chat(turns, _trained_turns(turns, "assistant", first) if completion_only_loss else None)
        prompt_text = _required_string(record, "prompt", source, index)
        completion_text = _required_string(record, "completion", source, index)
        if not completion_text.strip():
            raise _record_error(
                source, index, list(record), "column 'completion' is empty",
                "Drop the record: it would teach the model to answer with nothing.", "empty completion",
            )  # fmt: skip
        return _Plain(prompt_text, completion_text, train_prompt=not completion_only_loss)
    text = _required_string(record, "text", source, index)
    if not text.strip():
        raise _record_error(source, index, list(record), "column 'text' is empty", _FIX, "empty text")
    return _Plain("", text, train_prompt=True)
