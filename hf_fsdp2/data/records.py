"""Record formats: detecting which format a dataset holds, validating records, and normalising them into
what gets tokenized.

Formats (a column mapping renames other column names first):

* ``messages``: OpenAI chat, a list of ``{"role", "content"}`` turns (system, user, assistant, tool), with
  optional ``tools`` schemas, assistant ``tool_calls`` and reasoning (`hf_fsdp2.data.tool_calls`);
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

from hf_fsdp2.data.tool_calls import (
    ASSISTANT_KEYS,
    TOOL_KEYS,
    ToolDataError,
    normalise_tool_calls,
    parse_tools,
)

if TYPE_CHECKING:
    pass


DATASET_FORMATS = ("messages", "conversations", "prompt_completion", "alpaca", "text")
"""Record formats in the order `detect_format` tries them."""

CHAT_ROLES = ("system", "user", "assistant")
TOOL_CHAT_ROLES = (*CHAT_ROLES, "tool")
"""Roles of OpenAI-style turns (``messages`` and conversational ``prompt_completion``): a ``tool`` turn is a result."""
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
) -> list[dict[str, Any]]:
    """Check a list of chat turns and return them as ``{"role", "content"}`` dicts, with an assistant's tool calls
    and reasoning and a tool turn's name and call id where given (other keys dropped)."""
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
    turns: list[dict[str, Any]] = []
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
        try:
            tool_calls = normalise_tool_calls(message.get("tool_calls")) if role == "assistant" else None
        except ToolDataError as err:
            raise _record_error(
                source, index, columns, f"message {turn_index}: {err}", _FIX, "bad tool call"
            ) from err
        if tool_calls and content is None:
            content = ""  # a turn that only calls tools (OpenAI writes content: null)
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
        if role == "assistant" and not content.strip() and not tool_calls:
            raise _record_error(
                source,
                index,
                columns,
                f"message {turn_index} is an empty assistant turn",
                "Drop the record or the empty turn: it would teach the model to answer with nothing.",
                "empty assistant turn",
            )
        # Only role, content and the keys of the role's kind that have a value are passed on: Arrow fills keys that
        # other records have with None, and templates test such keys with `is defined`.
        turn: dict[str, Any] = {"role": role, "content": content}
        if tool_calls:
            turn["tool_calls"] = tool_calls
        for key in ASSISTANT_KEYS[1:] if role == "assistant" else TOOL_KEYS if role == "tool" else ():
            value = message.get(key)
            if isinstance(value, str) and value:
                turn[key] = value
        turns.append(turn)
    return turns


def _tool_order_problem(turns: list[dict[str, Any]]) -> str:
    """Where a tool-calling conversation breaks the order user -> assistant; assistant with tool_calls -> one or more
    tool turns -> assistant ("" when it does not)."""
    body = turns[1:] if turns[0]["role"] == "system" else turns
    if body[0]["role"] != "user":
        return "it must start with a user turn (after an optional system turn)"
    for previous, turn in zip(body, body[1:], strict=False):
        calls = previous["role"] == "assistant" and bool(previous.get("tool_calls"))
        allowed = {"user": ("assistant",), "tool": ("tool", "assistant")}.get(
            previous["role"], ("tool",) if calls else ("user",)
        )
        if turn["role"] not in allowed:
            after = "an assistant turn with tool_calls" if calls else f"a {previous['role']} turn"
            return f"{turn['role']} after {after} (expected {' or '.join(allowed)})"
    if body[-1]["role"] != "assistant":
        return "it must end with an assistant turn"
    return ""


def _check_role_order(
    turns: list[dict[str, Any]], record: Mapping[str, Any], source: str, index: int
) -> None:
    """Optional system turn, then user and assistant alternating, starting with user, ending with assistant; an
    assistant turn with tool_calls is followed by its tool results, then the assistant again."""
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
    if "tool" in roles or any(turn.get("tool_calls") for turn in turns):
        problem = _tool_order_problem(turns)
        if problem:
            raise _record_error(
                source,
                index,
                list(record),
                f"wrong role order {roles}: {problem}; a tool-calling conversation is an optional system turn, then "
                "user -> assistant, an assistant turn with tool_calls -> its tool turns -> assistant, ending with "
                "assistant",
                _FIX,
                "wrong role order",
            )
        return
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
    """A conversation, the indices of the assistant turns to train on (None: every token), and the tool schemas the
    chat template receives (None: no tools)."""

    messages: list[dict[str, Any]]
    trained: list[int] | None
    tools: list[dict[str, Any]] | None = None


@dataclass
class _Plain:
    """``[bos] + prompt + completion + [eos]``; ``prompt`` is a target when ``train_prompt``."""

    prompt: str
    completion: str
    train_prompt: bool


def _trained_turns(messages: list[dict[str, Any]], chat_loss: str, first: int = 0) -> list[int] | None:
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if chat_loss == "all":
        return None
    if chat_loss == "last_assistant":
        return assistant[-1:]
    return assistant


def _record_tools(
    record: Mapping[str, Any], source: str, index: int, default: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    """The record's ``tools`` (`parse_tools`), else ``default``."""
    try:
        tools = parse_tools(record.get("tools"))
    except ToolDataError as err:
        raise _record_error(source, index, list(record), str(err), _FIX, "bad tools") from err
    return tools if tools is not None else default


def _normalise_record(
    record: Mapping[str, Any],
    dataset_format: str,
    *,
    chat_loss: str,
    completion_only_loss: bool,
    source: str,
    index: int,
    tools: list[dict[str, Any]] | None = None,
) -> _Chat | _Plain:
    """Turn a record of any format into a conversation or a plain prompt/completion (or text); ``tools``: the
    schemas of a record without its own ``tools`` (`hf_fsdp2.data.tool_calls`)."""
    if dataset_format == "messages":
        turns = _validated_turns(
            record.get("messages"),
            record,
            source,
            index,
            column="messages",
            role_key="role",
            content_key="content",
            role_names={r: r for r in TOOL_CHAT_ROLES},
        )
        _check_role_order(turns, record, source, index)
        return _Chat(turns, _trained_turns(turns, chat_loss), _record_tools(record, source, index, tools))
    if dataset_format == "conversations":
        turns = _validated_turns(
            record.get("conversations"),
            record,
            source,
            index,
            column="conversations",
            role_key="from",
            content_key="value",
            role_names=SHAREGPT_ROLES,
        )
        system = record.get("system")
        if isinstance(system, str) and system.strip() and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": system})
        _check_role_order(turns, record, source, index)
        # ShareGPT has no tool roles, but its system prompt may describe tools the template should list.
        return _Chat(turns, _trained_turns(turns, chat_loss), _record_tools(record, source, index, tools))
    if dataset_format == "alpaca":
        instruction = _required_string(record, "instruction", source, index)
        output = _required_string(record, "output", source, index)
        extra = record.get("input")
        if extra is not None and not isinstance(extra, str):
            raise _record_error(
                source,
                index,
                list(record),
                f"column 'input' must be a string, got {type(extra).__name__}",
                _FIX,
                "non-string content",
            )
        user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        alpaca_turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        system = record.get("system")
        if isinstance(system, str) and system.strip():
            alpaca_turns.insert(0, {"role": "system", "content": system})
        if not output.strip():
            raise _record_error(
                source,
                index,
                list(record),
                "column 'output' is an empty assistant turn",
                "Drop the record: it would teach the model to answer with nothing.",
                "empty assistant turn",
            )
        return _Chat(alpaca_turns, _trained_turns(alpaca_turns, chat_loss))
    if dataset_format == "prompt_completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            # Conversational prompt/completion (as in TRL): two lists of turns rendered as one chat.
            names = {r: r for r in TOOL_CHAT_ROLES}
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
                completion,
                record,
                source,
                index,
                column="completion",
                role_key="role",
                content_key="content",
                role_names=names,
            )
            turns = prompt_turns + completion_turns
            _check_role_order(turns, record, source, index)
            first = len(prompt_turns)
            trained = _trained_turns(turns, "assistant", first) if completion_only_loss else None
            return _Chat(turns, trained, _record_tools(record, source, index, tools))
        prompt_text = _required_string(record, "prompt", source, index)
        completion_text = _required_string(record, "completion", source, index)
        if not completion_text.strip():
            raise _record_error(
                source,
                index,
                list(record),
                "column 'completion' is empty",
                "Drop the record: it would teach the model to answer with nothing.",
                "empty completion",
            )
        return _Plain(prompt_text, completion_text, train_prompt=not completion_only_loss)
    text = _required_string(record, "text", source, index)
    if not text.strip():
        raise _record_error(source, index, list(record), "column 'text' is empty", _FIX, "empty text")
    return _Plain("", text, train_prompt=True)
