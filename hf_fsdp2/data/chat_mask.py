"""Chat loss masks: a conversation rendered with the chat template, and which of its tokens are trained.

The mask comes from rendering prefixes of the conversation with the chat template and diffing their
tokens, so it is right for any template (no ``{% generation %}`` markers needed) and includes the
end-of-turn token the model must learn to emit. `chat_strings` lists what to encode, `chat_labels`
assembles the ids and labels from the encoded strings (the caller encodes a whole batch in one call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from hf_fsdp2.data.records import _Chat, _record_error
from hf_fsdp2.data.tool_calls import render_problem, template_name, template_takes_tools
from hf_fsdp2.labels import IGNORE_INDEX


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokenizer's special token ids, chat markers included (where a trained turn may end)."""
    ids = set(tokenizer.all_special_ids)
    # Chat markers such as <|eot_id|> are often added tokens flagged special without being in the
    # special-token attributes, so all_special_ids alone misses them.
    ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)


def trim_after_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], start: int, end: int, special: frozenset[int]
) -> int:
    """Return the new end of the target span ``ids[start:end]``, without whitespace after end-of-turn.

    ChatML renders ``<|im_end|>\\n`` after every turn. Generation stops at ``<|im_end|>``, so the newline
    is never sampled by the model; it is template glue that the next turn's context already contains.
    The span therefore ends at its last special token when only whitespace follows it. Without a special
    token in the span (templates with a plain-text end marker) nothing is trimmed, so the model still
    learns whatever the template uses to end a turn.
    """
    last_special = next((i for i in range(end - 1, start - 1, -1) if ids[i] in special), None)
    if last_special is None or last_special == end - 1:
        return end
    trailing = tokenizer.decode(ids[last_special + 1 : end])
    if not isinstance(trailing, str) or trailing.strip():
        return end
    return last_special + 1


def render(
    tokenizer: PreTrainedTokenizerBase,
    turns: list[dict[str, Any]],
    generation_prompt: bool,
    *,
    source: str,
    index: int,
    columns: Sequence[str],
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """``turns`` rendered by the chat template (``chat_template``, else the tokenizer's), which receives ``tools`` (as
    TRL's SFTTrainer passes them); a template error becomes a `RecordError` naming the record.

    Raises:
        ValueError: The tokenizer has no chat template.
        RecordError: The template rejected the conversation, or it has tools and the template reads no ``tools``.
    """
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError(
            f"{source or 'The dataset'} has conversational prompt/completion records but the tokenizer "
            "has no chat_template; set tokenizer.chat_template."
        )
    tool_use = bool(tools) or any(t["role"] == "tool" or t.get("tool_calls") for t in turns)
    if tools and not template_takes_tools(tokenizer):
        raise _record_error(
            source,
            index,
            list(columns),
            f"the record has tools but {template_name(tokenizer)} never reads 'tools', so the schemas would be "
            "dropped",
            "Use a chat template with tool support (Qwen2.5/Qwen3, Llama 3.1/3.2, Mistral...), or drop the "
            "record's tools.",
            "template without tools",
        )
    try:
        rendered = tokenizer.apply_chat_template(
            turns,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=chat_template,
        )
    except Exception as err:
        if tool_use:
            raise _record_error(
                source,
                index,
                list(columns),
                f"{template_name(tokenizer)} failed on this tool-calling conversation: {err}",
                "Use a chat template with tool support (Qwen2.5/Qwen3, Llama 3.1/3.2, Mistral...), or fix the record "
                "to the shape the template expects.",
                "template cannot render tools",
            ) from err
        # Templates reject conversations with raise_exception (e.g. "roles must alternate"); the
        # bare message would not say which record.
        raise _record_error(
            source,
            index,
            list(columns),
            f"the chat template failed on this conversation: {err}",
            "Fix or drop the record, or use a template that accepts it.",
            "chat template error",
        ) from err
    assert isinstance(rendered, str), type(rendered)
    return rendered


def chat_renders(chat: _Chat) -> list[tuple[list[dict[str, Any]], bool]]:
    """The renders `chat_strings` makes, as ``(turns, generation prompt)``: the whole conversation, then for each
    trained assistant turn the turns before it (with the generation prompt) and the turns through it."""
    renders = [(chat.messages, False)]
    for turn in chat.trained or []:
        renders += [(chat.messages[:turn], True), (chat.messages[: turn + 1], False)]
    return renders


def chat_strings(
    tokenizer: PreTrainedTokenizerBase,
    chat: _Chat,
    *,
    source: str,
    index: int,
    columns: Sequence[str],
    chat_template: str | None = None,
) -> list[str]:
    """What `chat_labels` needs encoded: the renders of `chat_renders` (``chat_template``: a processor's, else the
    tokenizer's)."""
    strings = [
        render(
            tokenizer,
            turns,
            prompt,
            source=source,
            index=index,
            columns=columns,
            tools=chat.tools,
            chat_template=chat_template,
        )
        for turns, prompt in chat_renders(chat)
    ]
    missing = render_problem(chat.messages, chat.tools, chat.trained, strings[0])
    if missing:
        raise _record_error(
            source,
            index,
            list(columns),
            f"{template_name(tokenizer)} rendered this tool-calling conversation without {missing}",
            "Use a chat template that renders tools, tool calls, tool results and reasoning (Qwen2.5/Qwen3, Llama "
            "3.1/3.2, Mistral...), or drop what it cannot show from the record.",
            "template cannot render tools",
        )
    return strings


_TOOL_PREFIX_HINT = (
    " Tool-calling templates such as Qwen3's render an assistant turn differently when it is the last message (an "
    "empty <think></think> block) and drop the reasoning of turns before the last user turn: give each assistant "
    "turn after the last user turn its reasoning_content, train the last turn only (chat_loss=last_assistant), or "
    "split the conversation into one record per assistant turn."
)


def _tool_use(chat: _Chat) -> bool:
    return bool(chat.tools) or any(
        m["role"] == "tool" or m.get("tool_calls") or m.get("reasoning_content") for m in chat.messages
    )


def chat_labels(
    tokenizer: PreTrainedTokenizerBase,
    chat: _Chat,
    encoded: list[list[int]],
    special: frozenset[int],
    *,
    source: str,
    index: int,
    columns: Sequence[str],
) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a conversation from the encoded `chat_strings`: each trained turn is the
    tokens between the render before it and the render through it, less whitespace after its end-of-turn.

    Raises:
        RecordError: A prefix render does not tokenize to a prefix of the whole conversation, or a trained
            turn renders to no tokens.
    """
    input_ids = encoded[0]
    if chat.trained is None:
        return input_ids, list(input_ids)
    labels = [IGNORE_INDEX] * len(input_ids)
    for k, turn in enumerate(chat.trained):
        before, through = encoded[1 + 2 * k], encoded[2 + 2 * k]
        for name, prefix in (("prompt before", before), ("conversation through", through)):
            if input_ids[: len(prefix)] != prefix:
                raise _record_error(
                    source,
                    index,
                    list(columns),
                    f"the chat template's render of the {name} assistant turn {turn} does not tokenize to a "
                    "prefix of the whole conversation, so assistant tokens cannot be located",
                    "Use a chat template that renders earlier turns identically whatever follows, or set "
                    "chat_loss=all (assistant_only_loss=false)."
                    + (_TOOL_PREFIX_HINT if _tool_use(chat) else ""),
                    "chat template not prefix-stable",
                )
        end = trim_after_end_of_turn(tokenizer, input_ids, len(before), len(through), special)
        if end <= len(before):
            raise _record_error(
                source,
                index,
                list(columns),
                f"assistant turn {turn} rendered to no tokens with this chat template",
                "Check that the chat template renders assistant content.",
                "empty assistant turn",
            )
        labels[len(before) : end] = input_ids[len(before) : end]
    return input_ids, labels
