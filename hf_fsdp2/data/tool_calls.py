"""Tool-calling conversations: the ``tools`` schemas a chat template receives, assistant ``tool_calls``, ``tool``
turns and reasoning, checked and normalised the way the Hugging Face chat-template convention wants them.

A record may carry ``tools`` (a list of JSON schemas, or a JSON string of that list; ``tokenize_dataset(tools=)``
gives one list to every record of a source that has none). Assistant turns may carry ``tool_calls``
(``[{"type": "function", "function": {"name", "arguments"}}]`` or the bare ``{"name", "arguments"}``) and
``reasoning_content`` / ``thinking``; ``tool`` turns carry the result (and optional ``name``, ``tool_call_id``).
Arguments given as a JSON string are parsed to the dict every tool-capable template expects (Llama 3.1 writes
``arguments | tojson``, which would quote a string twice).

Arrow-backed datasets (JSONL read with ``datasets``) store a list of dicts as one struct type, filling the keys other
records have with null: ``{"city": "Paris"}`` comes back as ``{"city": "Paris", "query": None}``. Nulls inside
``tools`` schemas and dict ``arguments`` are therefore dropped; a real null survives when the value is written as a
JSON string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Keys of a message passed on to the chat template besides role and content, by role. Others are dropped: Arrow fills
# keys that other records have with None, and templates test keys with `is defined`.
ASSISTANT_KEYS = ("tool_calls", "reasoning_content", "thinking")
TOOL_KEYS = ("name", "tool_call_id")
REASONING_KEYS = ("reasoning_content", "thinking")


class ToolDataError(ValueError):
    """A malformed ``tools`` value or tool call: the message names the problem (the caller adds the record)."""


def drop_nulls(value: Any) -> Any:
    """``value`` with every None-valued dict key removed, recursively (Arrow's fill for keys a record lacks)."""
    if isinstance(value, Mapping):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """A record's ``tools``: None, ``[]`` or ``""`` -> None (no tools: the template renders no tool preamble, as TRL's
    ``tools or None``); a list of schema dicts or a JSON string of one -> the list.

    Raises:
        ToolDataError: Not valid JSON, not a list, or an element that is not a dict.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise ToolDataError(f"'tools' is a string but not valid JSON ({err}): {value!r:.120}") from err
    else:
        parsed = drop_nulls(value)
    if isinstance(parsed, Mapping):
        raise ToolDataError(
            f"'tools' must be a list of JSON schemas, got one schema {dict(parsed)!r:.120}; wrap it in a list"
        )
    if not isinstance(parsed, list) or not all(isinstance(t, Mapping) for t in parsed):
        raise ToolDataError(
            f"'tools' must be a list of JSON schema dicts (or a JSON string of one), got {value!r:.120}"
        )
    return [dict(t) for t in parsed] or None


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ToolDataError(
                f"{where} arguments are a string but not valid JSON ({err}): {value!r:.120}"
            ) from err
    elif value is None:
        value = {}
    else:
        value = drop_nulls(value)
    if not isinstance(value, Mapping):
        raise ToolDataError(
            f"{where} arguments must be a JSON object (a dict or its JSON string), got {value!r:.120}"
        )
    return dict(value)


def normalise_tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """An assistant turn's ``tool_calls`` in the HF shape ``{"type": "function", "function": {"name", "arguments"}}``
    (plus ``id`` when given), arguments as a dict; None or ``[]`` -> None.

    Raises:
        ToolDataError: Not a list of dicts, a call without a function name, or arguments that are not a JSON object.
    """
    if value is None or (isinstance(value, list) and not value):
        return None
    if not isinstance(value, list):
        raise ToolDataError(
            f"'tool_calls' must be a list of calls, got {type(value).__name__}: {value!r:.120}"
        )
    calls = []
    for i, call in enumerate(value):
        where = f"tool call {i}"
        if not isinstance(call, Mapping):
            raise ToolDataError(f"{where} must be a dict, got {call!r:.120}")
        function = call.get("function") if call.get("function") is not None else call
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(name, str) or not name:
            raise ToolDataError(f"{where} has no function name: {drop_nulls(dict(call))!r:.160}")
        out: dict[str, Any] = {
            "type": call.get("type") or "function",
            "function": {"name": name, "arguments": _arguments(function.get("arguments"), where)},
        }
        if call.get("id") is not None:
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _shown(text: str, rendered: str) -> bool:
    # Templates write a string as is or through `tojson` (Llama 3.1 quotes every tool result).
    text = text.strip()
    return (
        text in rendered or json.dumps(text, ensure_ascii=False) in rendered or json.dumps(text) in rendered
    )


def render_problem(
    chat_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    trained: list[int] | None,
    rendered: str,
) -> str:
    """What of a conversation's tool-calling parts the chat template left out of ``rendered`` ("" when nothing):
    the tools' names, each call's function name, each tool result and the reasoning of each trained turn must
    appear, or the model would be trained on a conversation the data does not describe. (Templates may drop the
    reasoning of earlier turns, as Qwen3 does before the last user turn: that context is theirs to choose.)"""
    missing = []
    for tool in tools or []:
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str) and name not in rendered:
            missing.append(f"tool schema {name!r}")
    for i, message in enumerate(chat_messages):
        for call in message.get("tool_calls") or []:
            if call["function"]["name"] not in rendered:
                missing.append(f"message {i}'s call to {call['function']['name']!r}")
        if (
            message["role"] == "tool"
            and message["content"].strip()
            and not _shown(message["content"], rendered)
        ):
            missing.append(f"message {i}'s tool result")
        for key in REASONING_KEYS if trained is None or i in trained else ():
            text = message.get(key)
            if isinstance(text, str) and text.strip() and not _shown(text, rendered):
                missing.append(f"message {i}'s {key}")
    return ", ".join(missing)


def template_name(tokenizer: Any) -> str:
    """How an error names a chat template: the tokenizer's source and the template's first characters."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named variants: the default one renders
        template = template.get("default", next(iter(template.values()), ""))
    head = " ".join(str(template or "").split())[:60]
    owner = (
        f"the chat template of {tokenizer.name_or_path!r}" if tokenizer.name_or_path else "the chat template"
    )
    return f"{owner} (starting {head!r})"


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads ``tools`` at all (one that does not would drop the schemas silently)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in texts)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A raw message as the chat template should see it: Arrow's null-filled keys dropped, ``tool_calls`` in the HF
    shape with dict arguments (`normalise_tool_calls`), a tool-calling turn's null content as ``""``. For the prompts
    of GRPO and the preference methods, which pass message lists to the template as given.

    Raises:
        ToolDataError: A malformed tool call.
    """
    out = {k: v for k, v in message.items() if v is not None}
    calls = normalise_tool_calls(out.pop("tool_calls", None))
    if calls:
        out["tool_calls"] = calls
        out.setdefault("content", "")
    return out


def read_tools_option(value: str | None) -> list[dict[str, Any]] | None:
    """The recipe's ``dataset_tools``: a JSON list of schemas, or the path of a ``.json`` file holding one.

    Raises:
        ValueError: A missing file, or text that is not a JSON list of schema dicts; names the key and the value.
    """
    if value is None or not value.strip():
        return None
    text = value
    if not value.lstrip().startswith(("[", "{")):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(
                f"dataset_tools={value!r} is neither a JSON list of tool schemas nor an existing .json file; give "
                "one of them."
            )
        text = path.read_text()
    try:
        return parse_tools(text)
    except ToolDataError as err:
        raise ValueError(f"dataset_tools={value:.120}: {err}.") from err
