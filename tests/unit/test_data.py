"""Unit tests for hf_fsdp2.data: sources and formats, tokenization and loss masks, caching, mixtures
and eval sets, bad records, collation, sharded sampling.

Token expectations are written by hand against the Llama-2 tokenizer (see tests/conftest.py): its
normalizer prepends "▁" to every text run between special tokens, so "\\n" after a special token is
("▁", "<0x0A>"), and "\\n" is byte-fallback token <0x0A> = 13.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.data.loader import DataStream, PaddingCollator, ShardedSampler, build_dataloader
from hf_fsdp2.data.loading import load_raw_dataset
from hf_fsdp2.data.records import RecordError, detect_format
from hf_fsdp2.data.tokenize import tokenize_dataset
from hf_fsdp2.labels import IGNORE_INDEX

T, F = True, False  # is the token a loss target?


def tokenize_one(
    tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], **kwargs: Any
) -> tuple[list[int], list[int]]:
    kwargs.setdefault("max_length", 512)
    tokenized, stats = tokenize_dataset(datasets.Dataset.from_list([record]), tokenizer, **kwargs)
    assert tokenized.column_names == ["input_ids", "labels", "length", "num_targets"]
    assert stats.num_records == stats.num_kept == 1
    example = tokenized[0]
    assert example["length"] == len(example["input_ids"])
    assert example["num_targets"] == sum(label != IGNORE_INDEX for label in example["labels"][1:])
    return example["input_ids"], example["labels"]


def as_token_targets(
    tokenizer: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]
) -> list[tuple[str, bool]]:
    """Pair each token string with whether it is a target; checks targets carry their own id."""
    for token_id, label in zip(input_ids, labels, strict=True):
        assert label in (IGNORE_INDEX, token_id)
    tokens = tokenizer.convert_ids_to_tokens(input_ids)
    return [(token, label != IGNORE_INDEX) for token, label in zip(tokens, labels, strict=True)]


def target_text(tokenizer: PreTrainedTokenizerBase, labels: list[int]) -> str:
    return str(tokenizer.decode([label for label in labels if label != IGNORE_INDEX]))


# ---------------------------------------------------------------------------------------------------
# detect_format / load_raw_dataset
# ---------------------------------------------------------------------------------------------------


def test_detect_format_priority() -> None:
    assert detect_format(["messages", "conversations", "prompt", "completion", "text"]) == "messages"
    assert detect_format(["conversations", "prompt", "completion", "text"]) == "conversations"
    assert detect_format(["prompt", "completion", "instruction", "output", "text"]) == "prompt_completion"
    assert detect_format(["instruction", "input", "output", "text"]) == "alpaca"
    assert detect_format(["instruction", "output"]) == "alpaca"  # input is optional
    assert detect_format(["prompt", "text"]) == "text"
    assert detect_format(["id", "text"]) == "text"


def test_detect_format_error_names_found_and_expected_columns() -> None:
    with pytest.raises(ValueError, match=r"\['dialog', 'id'\]") as info:
        detect_format(["dialog", "id"])
    for expected in ("messages", "conversations", "prompt", "completion", "instruction", "output", "text"):
        assert expected in str(info.value)
    assert "dataset_column_mapping" in str(info.value)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_load_local_jsonl_json_parquet_and_folder(tmp_path: Path) -> None:
    records = [{"text": f"line {i}"} for i in range(5)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    assert load_raw_dataset(str(jsonl))["text"][:] == [r["text"] for r in records]

    json_file = tmp_path / "b.json"
    json_file.write_text(json.dumps(records))
    assert len(load_raw_dataset(str(json_file))) == 5

    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(parquet))
    assert load_raw_dataset(str(parquet))["text"][:] == [r["text"] for r in records]

    # A folder of shards, nested as in a hub snapshot; hidden folders are caches and are skipped.
    folder = tmp_path / "snapshot"
    write_jsonl(folder / "data" / "train-0.jsonl", records[:2])
    write_jsonl(folder / "data" / "train-1.jsonl", records[2:])
    write_jsonl(folder / ".cache" / "junk.jsonl", [{"other": 1}])
    assert sorted(load_raw_dataset(str(folder))["text"][:]) == [r["text"] for r in records]

    # Slices work on local data through the split name.
    assert len(load_raw_dataset(str(jsonl), split="train[:2]")) == 2
    assert len(load_raw_dataset(str(jsonl), split="validation")) == 5


def test_load_missing_path_raises_file_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("./nope", "missing.jsonl", str(tmp_path / "nope"), "~/surely-missing-hf-fsdp2.parquet"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load_raw_dataset(name)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="No data files"):
        load_raw_dataset("./empty_dir")


def test_load_rejects_bad_local_input(tmp_path: Path) -> None:
    xml = tmp_path / "data.xml"
    xml.write_text("<text>hi</text>\n")
    with pytest.raises(ValueError, match=r"Unsupported dataset file type '\.xml'"):
        load_raw_dataset(str(xml))

    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "a.jsonl", [{"text": "a"}])
    datasets.Dataset.from_list([{"text": "b"}]).to_parquet(str(mixed / "b.parquet"))
    with pytest.raises(ValueError, match="mixes data file types"):
        load_raw_dataset(str(mixed))

    jsonl = write_jsonl(tmp_path / "ok.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="only apply to hub datasets"):
        load_raw_dataset(str(jsonl), revision="main")

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_raw_dataset(str(empty))
    header_only = tmp_path / "header.csv"
    header_only.write_text("prompt,completion\n")
    with pytest.raises(ValueError, match="is empty"):
        load_raw_dataset(str(header_only))
    no_rows = tmp_path / "no_rows.parquet"
    datasets.Dataset.from_dict({"text": []}).to_parquet(str(no_rows))
    with pytest.raises(ValueError, match="is empty"):
        load_raw_dataset(str(no_rows))


def test_load_hub_id_goes_to_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_load_dataset(*args: Any, **kwargs: Any) -> datasets.Dataset:
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"text": "x"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    load_raw_dataset("org/some-dataset", split="test", config_name="en", revision="v1")
    assert calls == [(("org/some-dataset", "en"), {"split": "test", "revision": "v1"})]


# ---------------------------------------------------------------------------------------------------
# text / prompt_completion
# ---------------------------------------------------------------------------------------------------


def test_text_tokens_and_labels(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(llama2_tokenizer, {"text": "Hello world", "id": 7})
    # <s>=1, ▁Hello=15043, ▁world=3186, </s>=2: BOS as the tokenizer adds it, EOS appended.
    assert input_ids == [1, 15043, 3186, 2]
    assert labels == input_ids


def test_prompt_completion_tokens_and_masks(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    record = {"prompt": "2+2=", "completion": "4"}
    input_ids, labels = tokenize_one(llama2_tokenizer, record)
    # Prompt and completion are tokenized separately, so each starts with the normalizer's "▁".
    assert as_token_targets(llama2_tokenizer, input_ids, labels) == [
        ("<s>", F),
        ("▁", F),
        ("2", F),
        ("+", F),
        ("2", F),
        ("=", F),
        ("▁", T),
        ("4", T),
        ("</s>", T),
    ]
    assert input_ids[0] == 1 and input_ids[-1] == 2

    all_ids, all_labels = tokenize_one(llama2_tokenizer, record, completion_only_loss=False)
    assert all_ids == input_ids
    assert all_labels == input_ids


def test_explicit_format_overrides_detection(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    record = {"prompt": "2+2=", "completion": "4", "text": "Hello world"}
    input_ids, _ = tokenize_one(llama2_tokenizer, record, dataset_format="text")
    assert input_ids == [1, 15043, 3186, 2]
    with pytest.raises(ValueError, match="Unknown dataset_format 'chat'"):
        tokenize_one(llama2_tokenizer, record, dataset_format="chat")
    with pytest.raises(ValueError, match=r"needs columns \['messages'\]"):
        tokenize_one(llama2_tokenizer, record, dataset_format="messages")


# ---------------------------------------------------------------------------------------------------
# messages: prefix-diff assistant masks on two templates
# ---------------------------------------------------------------------------------------------------

SINGLE_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]

TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


def test_chatml_single_turn_hand_checked(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(chatml_tokenizer, {"messages": SINGLE_TURN})
    # Targets: the reply and <|im_end|> (the model must learn to stop), not the "\n" the template
    # writes after <|im_end|>, and nothing of the system/user turns or the assistant header.
    assert as_token_targets(chatml_tokenizer, input_ids, labels) == [
        ("<|im_start|>", F),
        ("▁system", F),
        ("<0x0A>", F),
        ("Be", F),
        ("▁brief", F),
        (".", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("Hello", T),
        ("!", T),
        ("<|im_end|>", T),
        ("▁", F),
        ("<0x0A>", F),
    ]
    assert input_ids[:3] == [32000, 1788, 13]
    assert [label for label in labels if label != IGNORE_INDEX] == [10994, 29991, 32001]


def test_chatml_default_system_turn_and_two_assistant_turns(
    chatml_tokenizer: PreTrainedTokenizerBase,
) -> None:
    input_ids, labels = tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS})
    pairs = as_token_targets(chatml_tokenizer, input_ids, labels)
    # The template inserts a default system turn; it is context, never a target.
    system = [
        ("<|im_start|>", F),
        ("▁system", F),
        ("<0x0A>", F),
        ("You", F),
        ("▁are", F),
        ("▁a", F),
        ("▁helpful", F),
        ("▁A", F),
        ("I", F),
        ("▁assistant", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
    ]
    rest = [
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("Hello", T),
        ("!", T),
        ("<|im_end|>", T),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("By", F),
        ("e", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("See", T),
        ("▁you", T),
        (".", T),
        ("<|im_end|>", T),
        ("▁", F),
        ("<0x0A>", F),
    ]
    assert pairs == system + rest
    assert target_text(chatml_tokenizer, labels) == "Hello!<|im_end|>See you.<|im_end|>"


def test_llama3_single_turn_hand_checked(llama3_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(llama3_tokenizer, {"messages": SINGLE_TURN})
    # BOS comes from the template ({{ bos_token }}); <|eot_id|> ends the turn with nothing after it.
    assert as_token_targets(llama3_tokenizer, input_ids, labels) == [
        ("<s>", F),
        ("<|start_header_id|>", F),
        ("▁system", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("Be", F),
        ("▁brief", F),
        (".", F),
        ("<|eot_id|>", F),
        ("<|start_header_id|>", F),
        ("▁user", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|eot_id|>", F),
        ("<|start_header_id|>", F),
        ("▁assistant", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("Hello", T),
        ("!", T),
        ("<|eot_id|>", T),
    ]
    assert input_ids[0] == 1
    assert [label for label in labels if label != IGNORE_INDEX] == [10994, 29991, 32002]


def test_llama3_two_assistant_turns(llama3_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(llama3_tokenizer, {"messages": TWO_TURNS})
    assert target_text(llama3_tokenizer, labels) == "Hello!<|eot_id|>See you.<|eot_id|>"
    eot = llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    # Four turns end in <|eot_id|>: the two assistant ones are targets, the two user ones are not.
    eot_targets = [label == eot for token_id, label in zip(input_ids, labels, strict=True) if token_id == eot]
    assert eot_targets == [False, True, False, True]


def test_chat_loss_all_trains_on_everything(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    masked_ids, _ = tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS})
    input_ids, labels = tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS}, chat_loss="all")
    assert input_ids == masked_ids
    assert labels == input_ids


# ChatML that, like Qwen3's template, drops the reasoning of every assistant turn but the last one.
STRIP_PAST_REASONING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_template_rewriting_past_turns_is_reported(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer = copy.deepcopy(chatml_tokenizer)
    tokenizer.chat_template = STRIP_PAST_REASONING_TEMPLATE
    thinking = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    dataset = datasets.Dataset.from_list([{"messages": TWO_TURNS}, {"messages": thinking}])
    with pytest.raises(
        ValueError, match=r"^chat\.jsonl record 1: .*conversation through assistant turn 1 does not tokenize"
    ):
        tokenize_dataset(dataset, tokenizer, max_length=128, source="chat.jsonl")
    # Without assistant masks no prefix is needed.
    _, stats = tokenize_dataset(dataset, tokenizer, max_length=128, chat_loss="all")
    assert stats.num_records == stats.num_kept == 2
    # last_assistant only renders the prefixes of the last turn, which this template keeps stable.
    tokenized, _ = tokenize_dataset(dataset, tokenizer, max_length=128, chat_loss="last_assistant")
    assert target_text(tokenizer, tokenized[1]["labels"]) == "See you.<|im_end|>"


def test_template_errors_and_assistant_first_name_the_record(
    chatml_tokenizer: PreTrainedTokenizerBase,
) -> None:
    assistant_first = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"}]
    dataset = datasets.Dataset.from_list([{"messages": SINGLE_TURN}, {"messages": assistant_first}])
    with pytest.raises(RecordError, match=r"^chat\.jsonl record 1: wrong role order \['assistant', 'user'\]"):
        tokenize_dataset(dataset, chatml_tokenizer, max_length=128, source="chat.jsonl")

    no_system = copy.deepcopy(chatml_tokenizer)
    no_system.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + chatml_tokenizer.chat_template
    )
    dataset = datasets.Dataset.from_list([{"messages": TWO_TURNS}, {"messages": SINGLE_TURN}])
    with pytest.raises(ValueError, match=r"^record 1: the chat template failed .*System role not supported"):
        tokenize_dataset(dataset, no_system, max_length=128)


# ---------------------------------------------------------------------------------------------------
# chat_loss choices, other chat formats, and a cross-check against {% generation %} markers
# ---------------------------------------------------------------------------------------------------


def test_last_assistant_chatml_hand_checked(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS}, chat_loss="last_assistant")
    assert input_ids == tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS})[0]
    pairs = as_token_targets(chatml_tokenizer, input_ids, labels)
    # The first reply is context now; only the last one and its <|im_end|> are targets.
    assert pairs[13:] == [
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("Hello", F),
        ("!", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("By", F),
        ("e", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("See", T),
        ("▁you", T),
        (".", T),
        ("<|im_end|>", T),
        ("▁", F),
        ("<0x0A>", F),
    ]
    assert not any(target for _, target in pairs[:13])  # the default system turn


def test_last_assistant_llama3_hand_checked(llama3_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(llama3_tokenizer, {"messages": TWO_TURNS}, chat_loss="last_assistant")
    assert as_token_targets(llama3_tokenizer, input_ids, labels) == [
        ("<s>", F),
        ("<|start_header_id|>", F),
        ("▁user", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|eot_id|>", F),
        ("<|start_header_id|>", F),
        ("▁assistant", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("Hello", F),
        ("!", F),
        ("<|eot_id|>", F),
        ("<|start_header_id|>", F),
        ("▁user", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("By", F),
        ("e", F),
        ("<|eot_id|>", F),
        ("<|start_header_id|>", F),
        ("▁assistant", F),
        ("<|end_header_id|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<0x0A>", F),
        ("See", T),
        ("▁you", T),
        (".", T),
        ("<|eot_id|>", T),
    ]


# ChatML with {% generation %} markers around what the assistant generates, content and <|im_end|>.
GENERATION_MARKED_CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_prefix_diff_masks_equal_the_templates_own_generation_markers(
    chatml_tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokenizer = copy.deepcopy(chatml_tokenizer)
    tokenizer.chat_template = GENERATION_MARKED_CHATML
    for messages in (SINGLE_TURN, TWO_TURNS):
        input_ids, labels = tokenize_one(tokenizer, {"messages": messages})
        marked = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert input_ids == marked["input_ids"]
        assert [label != IGNORE_INDEX for label in labels] == [bool(m) for m in marked["assistant_masks"]]


SHAREGPT_SINGLE_TURN = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "Hello!"},
]


def test_sharegpt_conversations(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    expected = tokenize_one(chatml_tokenizer, {"messages": SINGLE_TURN})
    assert tokenize_one(chatml_tokenizer, {"conversations": SHAREGPT_SINGLE_TURN, "id": 3}) == expected
    # A separate system column becomes the system turn.
    assert (
        tokenize_one(chatml_tokenizer, {"conversations": SHAREGPT_SINGLE_TURN[1:], "system": "Be brief."})
        == expected
    )
    input_ids, labels = expected
    assert [label for label in labels if label != IGNORE_INDEX] == [10994, 29991, 32001]  # Hello ! <|im_end|>


def test_alpaca_renders_as_a_user_assistant_chat(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    input_ids, labels = tokenize_one(chatml_tokenizer, {"instruction": "Hi", "input": "", "output": "Hello!"})
    # No input: the user turn is the instruction alone; SmolLM2's default system turn comes first.
    assert as_token_targets(chatml_tokenizer, input_ids, labels)[13:] == [
        ("<|im_start|>", F),
        ("▁user", F),
        ("<0x0A>", F),
        ("Hi", F),
        ("<|im_end|>", F),
        ("▁", F),
        ("<0x0A>", F),
        ("<|im_start|>", F),
        ("▁assistant", F),
        ("<0x0A>", F),
        ("Hello", T),
        ("!", T),
        ("<|im_end|>", T),
        ("▁", F),
        ("<0x0A>", F),
    ]
    with_input = tokenize_one(
        chatml_tokenizer, {"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "Be brief."}
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add.\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert with_input == tokenize_one(chatml_tokenizer, {"messages": chat})
    assert target_text(chatml_tokenizer, with_input[1]) == "5<|im_end|>"


def test_conversational_prompt_completion(llama3_tokenizer: PreTrainedTokenizerBase) -> None:
    record = {"prompt": SINGLE_TURN[:2], "completion": SINGLE_TURN[2:]}
    assert tokenize_one(llama3_tokenizer, record) == tokenize_one(llama3_tokenizer, {"messages": SINGLE_TURN})
    # Only the completion's assistant turns are targets, even with earlier assistant turns in the prompt.
    multi = {"prompt": TWO_TURNS[:3], "completion": TWO_TURNS[3:]}
    input_ids, labels = tokenize_one(llama3_tokenizer, multi)
    assert target_text(llama3_tokenizer, labels) == "See you.<|eot_id|>"
    all_ids, all_labels = tokenize_one(llama3_tokenizer, multi, completion_only_loss=False)
    assert all_ids == input_ids and all_labels == input_ids


# ---------------------------------------------------------------------------------------------------
# truncation and stats
# ---------------------------------------------------------------------------------------------------


def test_truncation_and_records_without_targets(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": "Hello", "completion": "world"},  # <s> ▁Hello ▁world </s>: fits
            {"prompt": "one two three four five six seven", "completion": "eight"},  # prompt alone > 6
            {"prompt": "Hello", "completion": "one two three four five"},  # completion cut: keeps targets
        ]
    )
    tokenized, stats = tokenize_dataset(dataset, llama2_tokenizer, max_length=6)
    assert (stats.num_records, stats.num_kept, stats.num_truncated, stats.num_without_targets) == (3, 3, 2, 1)
    assert stats.num_dropped_long == 0 and stats.skipped == {}
    assert [len(ids) for ids in tokenized["input_ids"]] == [4, 6, 6]
    assert tokenized[1]["labels"] == [IGNORE_INDEX] * 6
    assert tokenized[2]["labels"][:2] == [IGNORE_INDEX] * 2
    assert IGNORE_INDEX not in tokenized[2]["labels"][2:]

    _, stats = tokenize_dataset(dataset, llama2_tokenizer, max_length=64)
    assert (stats.num_records, stats.num_kept, stats.num_truncated, stats.num_without_targets) == (3, 3, 0, 0)


def test_chat_truncation_keeps_aligned_labels(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    full_ids, full_labels = tokenize_one(chatml_tokenizer, {"messages": TWO_TURNS})
    tokenized, stats = tokenize_dataset(
        datasets.Dataset.from_list([{"messages": TWO_TURNS}]), chatml_tokenizer, max_length=30
    )
    assert stats.num_truncated == 1 and stats.num_without_targets == 0
    assert tokenized[0]["input_ids"] == full_ids[:30]
    assert tokenized[0]["labels"] == full_labels[:30]


# ---------------------------------------------------------------------------------------------------
# bad records
# ---------------------------------------------------------------------------------------------------

GOOD_CHAT = {"messages": SINGLE_TURN, "id": "a"}


@pytest.mark.parametrize(
    ("records", "index", "problem"),
    [
        ([GOOD_CHAT, {"messages": None, "id": "b"}], 1, "column 'messages' is missing or None"),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": "Hi"}], "id": "b"}],
            1,
            r"the conversation has no assistant turn \(roles: \['user'\]\)",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}],
                         "id": "b"}],
            1,
            "message 1 is an empty assistant turn",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "x"}],
                         "id": "b"}],
            1,
            r"wrong role order \['tool', 'assistant'\]: it must start with a user turn",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}],
                         "id": "b"}],
            1,
            r"message 0 \(user\) content must be a string, got NoneType",
        ),
        (
            [{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": 6}], "id": "a"}],
            0,
            r"message 0 \(user\) content must be a string, got int",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                      {"role": "assistant", "content": "c"}], "id": "b"}],
            1,
            r"wrong role order \['user', 'user', 'assistant'\]",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                      {"role": "system", "content": "c"}], "id": "b"}],
            1,
            r"wrong role order \['user', 'assistant', 'system'\]",
        ),
        (
            [GOOD_CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                      {"role": "user", "content": "c"}], "id": "b"}],
            1,
            r"wrong role order .*ending with assistant",
        ),
    ],
)  # fmt: skip
def test_bad_chat_records_name_source_index_and_columns(
    chatml_tokenizer: PreTrainedTokenizerBase, records: list[dict[str, Any]], index: int, problem: str
) -> None:
    dataset = datasets.Dataset.from_list(records)
    with pytest.raises(ValueError, match=rf"chat\.jsonl record {index}: {problem}") as info:
        tokenize_dataset(dataset, chatml_tokenizer, max_length=64, source="chat.jsonl")
    assert "columns found: ['messages', 'id']" in str(info.value)


@pytest.mark.parametrize(
    ("records", "index", "problem"),
    [
        ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}], 1,
         "column 'completion' is missing or None"),
        ([{"prompt": 1, "completion": 2}], 0, "column 'prompt' must be a string, got int"),
    ],
)  # fmt: skip
def test_bad_prompt_completion_records(
    llama2_tokenizer: PreTrainedTokenizerBase, records: list[dict[str, Any]], index: int, problem: str
) -> None:
    dataset = datasets.Dataset.from_list(records)
    with pytest.raises(ValueError, match=rf"pc\.parquet record {index}: {problem}") as info:
        tokenize_dataset(dataset, llama2_tokenizer, max_length=64, source="pc.parquet")
    assert "columns found: ['prompt', 'completion']" in str(info.value)


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "x"}]},
         "message 1 has unknown role 'robot'"),
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": None}]},
         r"message 1 \(assistant\) content must be a string, got NoneType"),
        ({"instruction": "Hi", "output": None}, "column 'output' is missing or None"),
        ({"instruction": "Hi", "output": "  "}, "column 'output' is an empty assistant turn"),
        ({"instruction": "Hi", "input": 3, "output": "x"}, "column 'input' must be a string, got int"),
        ({"prompt": "Hi", "completion": ""}, "column 'completion' is empty"),
        ({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "x"}]},
         r"the conversation has no assistant turn \(roles: \['user', 'user'\]\)"),
        ({"prompt": [{"role": "assistant", "content": "Hi"}], "completion": [{"role": "assistant", "content": "x"}]},
         r"wrong role order \['assistant', 'assistant'\]"),
        ({"text": " "}, "column 'text' is empty"),
    ],
)  # fmt: skip
def test_bad_records_of_other_formats(
    chatml_tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], problem: str
) -> None:
    with pytest.raises(RecordError, match=rf"^src record 0: {problem}"):
        tokenize_dataset(datasets.Dataset.from_list([record]), chatml_tokenizer, max_length=64, source="src")


def test_bad_text_record(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    dataset = datasets.Dataset.from_list([{"text": "ok"}, {"text": None}])
    with pytest.raises(
        ValueError, match=r"^record 1: column 'text' is missing or None \(columns found: \['text'\]\)"
    ):
        tokenize_dataset(dataset, llama2_tokenizer, max_length=64)


def test_tokenizer_requirements(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="has no chat_template"):
        tokenize_one(llama2_tokenizer, GOOD_CHAT)
    no_eos = copy.deepcopy(llama2_tokenizer)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="has no eos_token"):
        tokenize_one(no_eos, {"text": "hi"})
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        tokenize_one(llama2_tokenizer, {"text": "hi"}, max_length=0)


# ---------------------------------------------------------------------------------------------------
# collator
# ---------------------------------------------------------------------------------------------------


def test_padding_collator_right_pads() -> None:
    examples = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8], "labels": [8]},
    ]
    batch = PaddingCollator(pad_token_id=0)(examples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]

    padded = PaddingCollator(pad_token_id=2, pad_to_multiple_of=4)(examples)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 2], [8, 2, 2, 2]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert padded["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    exact = PaddingCollator(pad_token_id=2, pad_to_multiple_of=3)(examples)
    assert exact["input_ids"].shape == (2, 3)


def test_padding_collator_rejects_misaligned_example() -> None:
    with pytest.raises(ValueError, match="Example 1 of the batch has 2 input_ids but 1 labels"):
        PaddingCollator(pad_token_id=0)(
            [{"input_ids": [1], "labels": [1]}, {"input_ids": [1, 2], "labels": [1]}]
        )


# ---------------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------------


def rank_orders(num_examples: int, world_size: int, seed: int, epoch: int = 0) -> list[list[int]]:
    orders = []
    for rank in range(world_size):
        sampler = ShardedSampler(num_examples, rank=rank, world_size=world_size, seed=seed)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def test_sampler_deterministic_disjoint_and_covering() -> None:
    num_examples, world_size, seed = 23, 4, 1234
    orders = rank_orders(num_examples, world_size, seed)
    assert orders == rank_orders(num_examples, world_size, seed)  # same seed, same order
    assert orders != rank_orders(num_examples, world_size, seed + 1)
    assert all(len(order) == 5 for order in orders)  # 23 // 4; the 3-index tail is dropped
    assert len(set().union(*orders)) == 20  # disjoint

    # The union, interleaved, is the first 20 of the epoch's seeded permutation.
    permutation = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    interleaved = [orders[i % world_size][i // world_size] for i in range(20)]
    assert interleaved == permutation[:20]
    sampler = ShardedSampler(num_examples, rank=2, world_size=world_size, seed=seed)
    assert sampler.global_order(0) == permutation[:20]
    assert len(sampler) == 5
    assert sampler.global_order(0)[2::world_size] == orders[2]


def test_sampler_set_epoch_and_no_shuffle() -> None:
    assert rank_orders(20, 2, seed=0, epoch=0) != rank_orders(20, 2, seed=0, epoch=1)
    sampler = ShardedSampler(20, rank=1, world_size=2, seed=0)
    sampler.set_epoch(3)
    assert sampler.global_order(3) == torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()

    unshuffled = ShardedSampler(7, rank=1, world_size=3, seed=0, shuffle=False)
    assert list(unshuffled) == [1, 4]
    unshuffled.set_epoch(1)
    assert list(unshuffled) == [1, 4]


def test_sampler_starts_mid_epoch_exactly() -> None:
    sampler = ShardedSampler(50, rank=1, world_size=3, seed=7)
    sampler.set_epoch(2)
    full_epoch = sampler.global_order(2)[1::3]
    resumed = ShardedSampler(50, rank=1, world_size=3, seed=7)
    resumed.start_at(2, 6)
    resumed.set_epoch(2)  # a recipe re-entering the same epoch keeps the position
    assert list(resumed) == full_epoch[6:]
    assert list(resumed) == []  # exhausted until the next epoch
    resumed.set_epoch(3)
    assert list(resumed) == sampler.global_order(3)[1::3]


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        ShardedSampler(10, rank=2, world_size=2, seed=0)
    with pytest.raises(ValueError, match="3 examples but there are 4 ranks"):
        ShardedSampler(3, rank=0, world_size=4, seed=0)
    sampler = ShardedSampler(10, rank=0, world_size=2, seed=0)
    with pytest.raises(ValueError, match="position=6 does not fit"):
        sampler.start_at(0, 6)


# ---------------------------------------------------------------------------------------------------
# dataloader end to end
# ---------------------------------------------------------------------------------------------------


def test_dataloader_batches_and_resume(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    records = [{"prompt": f"question {i}", "completion": "answer " * (i % 4 + 1)} for i in range(21)]
    tokenized, _ = tokenize_dataset(datasets.Dataset.from_list(records), llama2_tokenizer, max_length=32)
    collator = PaddingCollator(pad_token_id=0)

    def loader(sampler: ShardedSampler) -> torch.utils.data.DataLoader[dict[str, Any]]:
        return build_dataloader(tokenized, batch_size=3, collator=collator, sampler=sampler)

    sampler = ShardedSampler(len(tokenized), rank=0, world_size=2, seed=0)
    batches = list(loader(sampler))
    assert len(batches) == 3  # 10 indices for this rank, drop_last leaves 3 batches of 3
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
        assert batch["input_ids"].shape[0] == 3

    # The stream counts consumed micro-batches; a new one started there gives the rest of the epoch, then the
    # next epoch.
    sampler = ShardedSampler(len(tokenized), rank=0, world_size=2, seed=0)
    stream = iter(DataStream(loader(sampler), sampler, batch_size=3))
    first = next(stream)
    resumed_sampler = ShardedSampler(len(tokenized), rank=0, world_size=2, seed=0)
    resumed_stream = DataStream(loader(resumed_sampler), resumed_sampler, batch_size=3)
    resumed_stream.start_at(0, 1)
    rest = [b for _, b in zip(range(2), resumed_stream, strict=False)]
    assert [b["input_ids"].tolist() for b in [first, *rest]] == [b["input_ids"].tolist() for b in batches]
    assert (resumed_stream.epoch, resumed_stream.batches_in_epoch) == (0, 3)
    next(iter(resumed_stream))
    assert (resumed_stream.epoch, resumed_stream.batches_in_epoch) == (1, 1)

    with pytest.raises(ValueError, match="fewer than batch_size=11"):
        build_dataloader(tokenized, batch_size=11, collator=collator, sampler=sampler)


def test_dataloader_order_does_not_depend_on_workers(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    records = [{"text": f"record {i} " + "word " * (i % 5)} for i in range(24)]
    tokenized, _ = tokenize_dataset(datasets.Dataset.from_list(records), llama2_tokenizer, max_length=32)

    def batches(num_workers: int, position: int = 0) -> list[list[list[int]]]:
        sampler = ShardedSampler(len(tokenized), rank=1, world_size=2, seed=9)
        sampler.start_at(1, position)
        loader = build_dataloader(
            tokenized,
            batch_size=3,
            collator=PaddingCollator(pad_token_id=0),
            sampler=sampler,
            num_workers=num_workers,
        )
        return [b["input_ids"].tolist() for b in loader]

    assert batches(0) == batches(2)
    # Restored mid-epoch (as a recipe does from its count of consumed batches) the rest is the same too.
    assert batches(2, position=6) == batches(0)[2:]


def test_the_test_models_tokenizer_files_load_the_same_tokenizer(tmp_path: Path) -> None:
    """tests/support/tiny.py's save_tokenizer lists the added tokens in tokenizer_config.json (a faster load): the
    tokenizer loaded from it is the one a plain save_pretrained folder gives."""
    from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer
    from support.tiny import save_tokenizer
    from transformers import AutoTokenizer

    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(tmp_path / "plain")
    save_tokenizer(tokenizer, tmp_path / "listed")
    plain, listed = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("plain", "listed"))
    assert "added_tokens_decoder" in json.loads((tmp_path / "listed" / "tokenizer_config.json").read_text())
    messages = [
        {"role": "user", "content": "alpha <|im_end|> bravo </s>"},
        {"role": "assistant", "content": "x"},
    ]
    for attr in (
        "all_special_ids",
        "all_special_tokens",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "chat_template",
    ):
        assert getattr(listed, attr) == getattr(plain, attr), attr
    assert listed.added_tokens_decoder == plain.added_tokens_decoder and len(listed) == len(plain) == 32002
    assert listed.apply_chat_template(messages) == plain.apply_chat_template(messages)
    assert listed("<|im_start|>user\nhi</s>").input_ids == plain("<|im_start|>user\nhi</s>").input_ids
