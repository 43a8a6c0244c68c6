"""The GRPO recipe's data: prompts (strings, or message lists rendered with the chat template and the generation
prompt; or SFT chat records, the turns before the last answer) with the dataset's other columns for the reward
functions, sharded per rank like every recipe's data."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.sources import parse_column_mapping
from hf_fsdp2.data.loading import apply_column_mapping, load_source
from hf_fsdp2.data.tool_calls import ToolDataError, parse_tools, template_message
from hf_fsdp2.methods.grpo.batching import generation_stream
from hf_fsdp2.methods.grpo.config import GrpoArgs, json_mapping
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.session import Session

logger = logging.getLogger("hf_fsdp2")


def _prompt_ids(
    prompt: Any, tokenizer: Any, where: str, template_kwargs: Mapping[str, Any], tools: Any = None
) -> list[int]:
    """A prompt's ids as TRL 1.16's ``GRPOTrainer._tokenize_prompts`` makes them: a string with the tokenizer's
    special tokens (the BOS of Llama, Gemma, Mistral), a message list through the chat template with the generation
    prompt and ``chat_template_kwargs`` (the template writes its own BOS). A record's ``tools`` (JSON schemas, or
    their JSON string) reach the template as TRL's ``tools`` do; tool calls in the prompt are passed in the HF shape
    (`hf_fsdp2.data.tool_calls.template_message`)."""
    if isinstance(prompt, list):
        if tokenizer.chat_template is None:
            raise ConfigError(
                f"{where}: the prompt is a message list but the tokenizer has no chat template; give "
                "chat_template, or plain string prompts"
            )
        try:
            schemas = parse_tools(tools)
            messages = [template_message(m) if isinstance(m, Mapping) else m for m in prompt]
        except ToolDataError as err:
            raise ConfigError(f"{where}: {err}") from err
        # A record's tools win over chat_template_kwargs' (which then act as every record's default).
        kwargs = {
            **template_kwargs,
            **({"tools": schemas} if schemas or "tools" not in template_kwargs else {}),
        }
        out = tokenizer.apply_chat_template(
            [messages], add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
        )
        return list(out["input_ids"][0])
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: prompt={prompt!r} is not a non-empty string or message list")
    return list(tokenizer(text=[prompt])["input_ids"][0])


def _as_prompt_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``prompt`` record as is; a chat record (``messages`` ending with an assistant turn, the SFT format) as its
    turns before that answer, the answer's text given to the reward functions as ``answer`` (unless the record has
    one)."""
    if "prompt" in record:
        return record
    turns = record.get("messages")
    if (
        isinstance(turns, list)
        and turns
        and isinstance(turns[-1], dict)
        and turns[-1].get("role") == "assistant"
    ):
        out = {k: v for k, v in record.items() if k != "messages"}
        out["prompt"] = turns[:-1]
        out.setdefault("answer", turns[-1].get("content"))
        return out
    raise ConfigError(
        f"{where}: no 'prompt' column nor 'messages' ending with an assistant turn (columns: "
        f"{sorted(record)}); rename with dataset_column_mapping"
    )


def tokenize_prompts(
    records: Any,
    tokenizer: Any,
    *,
    limit: int,
    long_examples: str,
    source: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[dict]:
    """Prompt examples ``{prompt_ids, prompt, columns, index}`` (ids as :func:`_prompt_ids`); a prompt over
    ``limit`` tokens is dropped (counted) or, with ``long_examples: error``, refused naming the record."""
    out: list[dict] = []
    dropped = 0
    for i, record in enumerate(records):
        where = f"{source} record {i}"
        record = _as_prompt_record(dict(record), where)
        ids = _prompt_ids(record["prompt"], tokenizer, where, chat_template_kwargs or {}, record.get("tools"))
        if len(ids) > limit:
            if long_examples == "error":
                raise ConfigError(
                    f"{where}: the prompt has {len(ids)} tokens, over max_length - max_completion_length"
                    f" = {limit}; raise max_length or drop it (long_examples: drop)"
                )
            dropped += 1
            continue
        columns = {k: v for k, v in record.items() if k != "prompt"}
        out.append({"prompt_ids": ids, "prompt": record["prompt"], "columns": columns, "index": len(out)})
    if dropped:
        logger.warning("%s: %d prompts longer than %d tokens dropped", source, dropped, limit)
    return out


def collate_prompts(examples: Sequence[dict]) -> dict[str, Any]:
    """A micro-batch of prompts: their ids, as given, the other columns (one list each) and their indices."""
    keys = sorted({k for e in examples for k in e["columns"]})
    return {
        "prompt_ids": [e["prompt_ids"] for e in examples],
        "prompts": [e["prompt"] for e in examples],
        "columns": {k: [e["columns"].get(k) for e in examples] for k in keys},
        "index": [e["index"] for e in examples],
    }


class PromptCollator:
    """:func:`collate_prompts`, carrying the tokenizer the step decodes completions with."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        return collate_prompts(examples)


def build_grpo_data(session: Session, tokenizer: Any) -> TrainData:
    """The prompts of every training source (and the eval prompts), sharded per rank like every recipe's data."""
    cfg = session.cfg
    d = cfg.data
    g: GrpoArgs = cfg.method
    limit = d.max_length - g.max_completion_length
    template_kwargs = json_mapping(g.chat_template_kwargs, "chat_template_kwargs")

    def load() -> tuple[list[dict], list[dict] | None]:
        train = []
        mapping = parse_column_mapping(d.dataset_column_mapping)
        for source in d.sources():
            raw = load_source(source, on_bad_record=d.on_bad_record)
            if mapping:
                raw = apply_column_mapping(raw, mapping, source.describe())
            train += tokenize_prompts(
                raw,
                tokenizer,
                limit=limit,
                long_examples=d.long_examples,
                source=source.describe(),
                chat_template_kwargs=template_kwargs,
            )
        evals = None
        eval_source = d.eval_source()
        if eval_source is not None:
            evals = tokenize_prompts(
                load_source(eval_source),
                tokenizer,
                limit=limit,
                long_examples=d.long_examples,
                source="eval",
                chat_template_kwargs=template_kwargs,
            )
        elif d.eval_split_fraction:
            cut = max(1, int(len(train) * d.eval_split_fraction))
            train, evals = train[cut:], train[:cut]
        for i, e in enumerate(train):
            e["index"] = i
        return train, evals

    train, evals = rank0_first(load)
    collator = PromptCollator(tokenizer)
    # One stream batch per generation batch, the same prompts on every rank (batching.py: TRL's step meaning).
    stream, steps_per_epoch, total_steps, layout = generation_stream(session, train, collator)
    logger.info(
        "GRPO data: %d prompts, %s; %d steps (%d per epoch), %d prompts x %d generations per generation "
        "batch",
        len(train),
        f"{len(evals)} eval prompts" if evals else "no eval set",
        total_steps,
        steps_per_epoch,
        layout.prompts,
        g.num_generations,
    )
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=evals,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        examples_per_step=layout.prompts,
        train_set=train,
    )


def preview_prompts(cfg: Any, tokenizer: Any, load: Callable[[Any], Any], read: int) -> list[tuple[str, str]]:
    """Doctor's reading: each source's first ``read`` records tokenized as prompts (the run's error raised)."""
    d = cfg.data
    limit = d.max_length - cfg.method.max_completion_length
    out = []
    for source in d.sources():
        rows = tokenize_prompts(
            load(source),
            tokenizer,
            limit=limit,
            long_examples=d.long_examples,
            source=source.describe(),
            chat_template_kwargs=json_mapping(cfg.method.chat_template_kwargs, "chat_template_kwargs"),
        )
        out.append((source.describe(), f"prompts, {len(rows)} of the first {read} records tokenized"))
    return out
