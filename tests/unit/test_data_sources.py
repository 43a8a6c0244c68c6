"""Unit tests for hf_fsdp2.data beyond single records: source specs, file types and hub ids, column
mappings, weighted mixtures, eval sets, the tokenization cache, bad-record skipping and long examples."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import PreTrainedTokenizerBase

from hf_fsdp2.config.sources import DataSource, parse_column_mapping, parse_source, resolve_sources
from hf_fsdp2.data.loading import apply_column_mapping, load_raw_dataset
from hf_fsdp2.data.mixture import build_sft_datasets, format_trained_spans
from hf_fsdp2.data.records import RecordError
from hf_fsdp2.data.tokenize import tokenize_dataset, tokenizer_fingerprint
from hf_fsdp2.labels import IGNORE_INDEX

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]
PC_RECORDS = [{"prompt": f"question {i}", "completion": "answer " * (i % 3 + 1)} for i in range(6)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def rows(dataset: datasets.Dataset) -> list[tuple[list[int], list[int]]]:
    return [(r["input_ids"], r["labels"]) for r in dataset]


# ---------------------------------------------------------------------------------------------------
# source specs, mixtures, column mappings
# ---------------------------------------------------------------------------------------------------


def test_parse_source() -> None:
    assert parse_source("org/name") == DataSource(name="org/name")
    assert parse_source("org/name:0.5") == DataSource(name="org/name", weight=0.5)
    assert parse_source(" org/name?subset=en&split=train_sft&revision=v1:2 ", split="x") == DataSource(
        name="org/name", subset="en", split="train_sft", revision="v1", weight=2.0
    )
    assert parse_source("data/a.jsonl", split="validation") == DataSource(
        name="data/a.jsonl", split="validation"
    )
    # A ':' not followed by a number is part of the name.
    assert parse_source("/data/run:a/x.jsonl").name == "/data/run:a/x.jsonl"
    assert parse_source("org/name?subset=en").describe() == "org/name (subset=en)"


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("x:0", "positive number"),
        ("x:-1", "positive number"),
        ("x:inf", "positive number"),
        (":0.5", "no dataset name"),
        ("x?lang=en", "cannot read 'lang=en'"),
        ("x?split=", "cannot read"),
    ],
)
def test_parse_source_errors(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_source(spec)


def test_resolve_sources() -> None:
    assert resolve_sources(dataset_name="a.jsonl", dataset_split="dev", dataset_revision=None) == [
        DataSource(name="a.jsonl", split="dev")
    ]
    expected = [
        DataSource(name="a.jsonl", split="dev", weight=0.5),
        DataSource(name="org/b", split="dev", weight=2.0),
    ]
    assert resolve_sources(dataset_mixture="a.jsonl:0.5, org/b:2", dataset_split="dev") == expected
    assert resolve_sources(dataset_mixture=["a.jsonl:0.5", "org/b:2"], dataset_split="dev") == expected
    with pytest.raises(ValueError, match="exactly one of dataset_name"):
        resolve_sources()
    with pytest.raises(ValueError, match="exactly one of dataset_name"):
        resolve_sources(dataset_name="a.jsonl", dataset_mixture=["b.jsonl:1"])
    with pytest.raises(ValueError, match=r"lists \['a.jsonl'\] more than once"):
        resolve_sources(dataset_mixture="a.jsonl:1,a.jsonl:2")


def test_column_mapping() -> None:
    assert parse_column_mapping("question=prompt, answer=completion") == {
        "question": "prompt",
        "answer": "completion",
    }
    assert parse_column_mapping(["question=prompt", "answer=completion"]) == {
        "question": "prompt",
        "answer": "completion",
    }
    with pytest.raises(ValueError, match="must look like 'old_name=new_name'"):
        parse_column_mapping("question")
    with pytest.raises(ValueError, match="'answer' is not a column the pipeline reads"):
        parse_column_mapping("question=answer")
    with pytest.raises(ValueError, match="twice"):
        parse_column_mapping("q=prompt,q2=prompt")

    raw = datasets.Dataset.from_list([{"question": "2+2=", "answer": "4", "id": 1}])
    mapped = apply_column_mapping(raw, {"question": "prompt", "answer": "completion"}, "qa.jsonl")
    assert mapped.column_names == ["prompt", "completion", "id"]
    # A source already in the expected names is left alone (mixtures of differently named sources).
    assert (
        apply_column_mapping(mapped, {"question": "prompt"}, "pc.jsonl").column_names == mapped.column_names
    )
    with pytest.raises(ValueError, match=r"qa\.jsonl: dataset_column_mapping maps column 'q'"):
        apply_column_mapping(raw, {"q": "prompt"}, "qa.jsonl")
    with pytest.raises(ValueError, match="already has a column 'prompt'"):
        apply_column_mapping(mapped.add_column("question", ["x"]), {"question": "prompt"}, "qa.jsonl")


# ---------------------------------------------------------------------------------------------------
# every local file type and a hub id give the tokens of the in-memory records
# ---------------------------------------------------------------------------------------------------


def write_as(path: Path, records: list[dict[str, Any]]) -> Path:
    suffix = path.suffix
    if suffix == ".jsonl":
        return write_jsonl(path, records)
    if suffix == ".json":
        path.write_text(json.dumps(records))
    elif suffix == ".parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif suffix == ".csv":
        datasets.Dataset.from_list(records).to_csv(str(path), index=False)
    elif suffix == ".arrow":
        saved = path.parent / "saved"
        datasets.Dataset.from_list(records).save_to_disk(str(saved))
        (saved / "data-00000-of-00001.arrow").rename(path)
    else:
        raise AssertionError(suffix)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".arrow"])
def test_every_file_type_round_trips_to_the_same_tokens(
    tmp_path: Path, llama2_tokenizer: PreTrainedTokenizerBase, suffix: str
) -> None:
    expected, _ = tokenize_dataset(datasets.Dataset.from_list(PC_RECORDS), llama2_tokenizer, max_length=32)
    path = write_as(tmp_path / f"pc{suffix}", PC_RECORDS)
    data = build_sft_datasets([DataSource(name=str(path))], llama2_tokenizer, max_length=32, seed=0)
    assert rows(data.train) == rows(expected)
    assert data.stats[0].dataset_format == "prompt_completion"
    assert data.stats[0].source == str(path)


def test_chat_records_from_parquet_and_a_saved_folder(
    tmp_path: Path, chatml_tokenizer: PreTrainedTokenizerBase
) -> None:
    records = [{"messages": CHAT}, {"messages": CHAT[1:]}]
    expected, _ = tokenize_dataset(datasets.Dataset.from_list(records), chatml_tokenizer, max_length=64)
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "chat.parquet"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    for name in ("chat.parquet", "saved"):
        data = build_sft_datasets(
            [DataSource(name=str(tmp_path / name))], chatml_tokenizer, max_length=64, seed=0
        )
        assert rows(data.train) == rows(expected), name


def test_text_files_give_one_record_per_paragraph(
    tmp_path: Path, llama2_tokenizer: PreTrainedTokenizerBase
) -> None:
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("Hello world\nsecond line\n\n\n\nNext paragraph\n")
    (folder / "b.txt").write_text("\n\nLast one")
    raw = load_raw_dataset(str(folder))
    assert raw["text"][:] == ["Hello world\nsecond line", "Next paragraph", "Last one"]
    data = build_sft_datasets([DataSource(name=str(folder))], llama2_tokenizer, max_length=32, seed=0)
    assert data.train[0]["input_ids"][:3] == [1, 15043, 3186]  # <s> ▁Hello ▁world
    assert data.train[0]["input_ids"][-1] == 2 and data.train[0]["labels"] == data.train[0]["input_ids"]


def test_hub_source_with_subset_split_and_revision(
    monkeypatch: pytest.MonkeyPatch, llama2_tokenizer: PreTrainedTokenizerBase
) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_load_dataset(*args: Any, **kwargs: Any) -> datasets.Dataset:
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"question": "2+2=", "answer": "4"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = parse_source("org/qa?subset=en&split=train_sft&revision=v1:1")
    data = build_sft_datasets(
        [source],
        llama2_tokenizer,
        max_length=32,
        seed=0,
        column_mapping=parse_column_mapping("question=prompt,answer=completion"),
    )
    assert calls == [(("org/qa", "en"), {"split": "train_sft", "revision": "v1"})]
    expected, _ = tokenize_dataset(
        datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4"}]), llama2_tokenizer, max_length=32
    )
    assert rows(data.train) == rows(expected)
    assert data.stats[0].source == "org/qa (subset=en, split=train_sft, revision=v1)"


# ---------------------------------------------------------------------------------------------------
# mixtures and eval sets
# ---------------------------------------------------------------------------------------------------


def test_weighted_mixture_is_seeded_and_counted(
    tmp_path: Path, chatml_tokenizer: PreTrainedTokenizerBase
) -> None:
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [CHAT[1], {"role": "assistant", "content": f"r{i}"}]} for i in range(10)],
    )
    pc = write_jsonl(tmp_path / "pc.jsonl", PC_RECORDS)
    sources = resolve_sources(dataset_mixture=f"{chat}:0.5,{pc}:1.5")

    def build(seed: int) -> Any:
        return build_sft_datasets(sources, chatml_tokenizer, max_length=64, seed=seed)

    data = build(0)
    assert data.train_counts == [5, 9]  # half of 10; 6 once plus a seeded half of them again
    assert len(data.train) == 14
    pc_ids = {
        tuple(r["input_ids"])
        for r in build_sft_datasets([DataSource(name=str(pc))], chatml_tokenizer, max_length=64, seed=0).train
    }
    mixed_pc = [tuple(r["input_ids"]) for r in data.train.select(range(5, 14))]
    assert set(mixed_pc) == pc_ids and len(set(mixed_pc)) == 6  # every pc record at least once
    assert rows(build(0).train) == rows(data.train)  # same seed, same mixture
    assert rows(build(1).train) != rows(data.train)  # another seed, another subset
    lines = data.summary_lines(64)
    assert "5 examples in the training mixture" in lines[0] and "(messages)" in lines[0]
    assert "9 examples in the training mixture" in lines[1] and "(prompt_completion)" in lines[1]
    assert lines[-1].startswith("data: 14 training examples (max_length=64), no eval set")


def test_eval_split_fraction_is_disjoint_and_seeded(
    tmp_path: Path, llama2_tokenizer: PreTrainedTokenizerBase
) -> None:
    records = [{"text": f"record number {i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    source = DataSource(name=str(path), weight=2.0)
    data = build_sft_datasets([source], llama2_tokenizer, max_length=32, seed=3, eval_split_fraction=0.25)
    assert data.eval is not None and len(data.eval) == 5
    train_ids = {tuple(r["input_ids"]) for r in data.train}
    eval_ids = {tuple(r["input_ids"]) for r in data.eval}
    assert len(train_ids) == 15 and len(data.train) == 30  # the weight applies after the carve-out
    assert not train_ids & eval_ids
    again = build_sft_datasets([source], llama2_tokenizer, max_length=32, seed=3, eval_split_fraction=0.25)
    assert again.eval is not None and rows(again.eval) == rows(data.eval)
    assert "5 eval examples (0.25 of each source held out from train, seed 3)" in data.summary_lines(32)[-1]
    with pytest.raises(ValueError, match="holds out all 20 examples"):
        build_sft_datasets([source], llama2_tokenizer, max_length=32, seed=3, eval_split_fraction=0.99)


def test_eval_from_a_separate_source(tmp_path: Path, llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a b"}, {"text": "c d"}])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"text": "e f"}])
    data = build_sft_datasets(
        [DataSource(name=str(train))],
        llama2_tokenizer,
        max_length=32,
        seed=0,
        eval_source=parse_source(str(evaluation)),
    )
    assert data.eval is not None and len(data.eval) == 1 and len(data.train) == 2
    assert f"1 eval examples (from {evaluation})" in data.summary_lines(32)[-1]
    with pytest.raises(ValueError, match="not both"):
        build_sft_datasets(
            [DataSource(name=str(train))],
            llama2_tokenizer,
            max_length=32,
            seed=0,
            eval_source=DataSource(name=str(evaluation)),
            eval_split_fraction=0.5,
        )


# ---------------------------------------------------------------------------------------------------
# tokenization cache: a second run does not tokenize again
# ---------------------------------------------------------------------------------------------------


def counting_tokenizer(tokenizer: PreTrainedTokenizerBase) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """A copy of the tokenizer whose chat-template renders are counted (the same fingerprint)."""
    counted = copy.deepcopy(tokenizer)
    calls = [0]
    render = counted.apply_chat_template

    def apply_chat_template(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return render(*args, **kwargs)

    counted.apply_chat_template = apply_chat_template  # type: ignore[method-assign]
    return counted, calls


def test_second_tokenization_is_a_cache_hit(
    tmp_path: Path, chatml_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 4)
    tokenizer, calls = counting_tokenizer(chatml_tokenizer)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(chatml_tokenizer)

    first, _ = tokenize_dataset(load_raw_dataset(str(path)), tokenizer, max_length=64, source="chat")
    assert calls[0] == 4 * 3  # full render + before/through the assistant turn, per record
    # A later run (or another rank): a fresh load of the same file, the same tokenizer and settings.
    second, stats = tokenize_dataset(
        load_raw_dataset(str(path)), copy.deepcopy(tokenizer), max_length=64, source="chat"
    )
    assert calls[0] == 12  # nothing rendered again: loaded from the cache file
    assert second.cache_files and second.cache_files[0]["filename"] == first.cache_files[0]["filename"]
    assert rows(second) == rows(first) and stats.num_kept == 4
    # Another setting is another cache entry.
    tokenize_dataset(load_raw_dataset(str(path)), tokenizer, max_length=64, source="chat", chat_loss="all")
    assert calls[0] == 12 + 4


def test_tokenizer_fingerprint_follows_what_changes_tokens(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    same = copy.deepcopy(chatml_tokenizer)
    same("warm up the backend", truncation=True, max_length=4)  # transient state is not part of it
    assert tokenizer_fingerprint(same) == tokenizer_fingerprint(chatml_tokenizer)
    other = copy.deepcopy(chatml_tokenizer)
    other.chat_template = other.chat_template.replace("helpful", "harmless")
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(chatml_tokenizer)


def test_num_proc_gives_the_same_examples(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    raw = datasets.Dataset.from_list(PC_RECORDS * 3)
    one, _ = tokenize_dataset(raw, llama2_tokenizer, max_length=32)
    two, stats = tokenize_dataset(raw, llama2_tokenizer, max_length=32, num_proc=2)
    assert rows(two) == rows(one) and stats.num_kept == 18


# ---------------------------------------------------------------------------------------------------
# bad records skipped and counted; long examples
# ---------------------------------------------------------------------------------------------------

BAD_MIX = [
    {"messages": CHAT},
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]},
    {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "c"}]},
    {"messages": None},
    {"messages": CHAT[1:]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]},
]  # fmt: skip


def test_on_bad_record_skip_counts_by_reason(
    tmp_path: Path, chatml_tokenizer: PreTrainedTokenizerBase
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_MIX)
    with pytest.raises(RecordError, match=rf"^{path} record 1: wrong role order"):
        build_sft_datasets([DataSource(name=str(path))], chatml_tokenizer, max_length=64, seed=0)

    data = build_sft_datasets(
        [DataSource(name=str(path))], chatml_tokenizer, max_length=64, seed=0, on_bad_record="skip"
    )
    stats = data.stats[0]
    assert (stats.num_records, stats.num_kept) == (7, 2)
    assert stats.skipped == {
        "wrong role order": 2,
        "empty assistant turn": 1,
        "non-string content": 1,
        "missing field": 1,
    }
    good, _ = tokenize_dataset(
        datasets.Dataset.from_list([BAD_MIX[0], BAD_MIX[5]]), chatml_tokenizer, max_length=64
    )
    assert rows(data.train) == rows(good)  # the kept examples, in order
    assert [m.split(":")[0] for m in stats.skipped_examples] == [f"{path} record {i}" for i in (1, 2, 3)]
    line = data.summary_lines(64)[0]
    assert (
        "5 bad records skipped (1 empty assistant turn, 1 missing field, 1 non-string content, 2 wrong role order)"
        in line
    )
    assert line.endswith("-> 2 examples; 2 examples in the training mixture")
    assert any(f"{path} record 1: wrong role order" in x for x in data.summary_lines(64))


def test_long_examples_truncate_drop_or_error(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    long_chat = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "word " * 40}]
    dataset = datasets.Dataset.from_list([{"messages": CHAT}, {"messages": long_chat}])
    truncated, stats = tokenize_dataset(dataset, chatml_tokenizer, max_length=40, source="s")
    assert (stats.num_kept, stats.num_truncated, stats.num_dropped_long) == (2, 1, 0)
    assert truncated[1]["length"] == 40
    dropped, stats = tokenize_dataset(
        dataset, chatml_tokenizer, max_length=40, long_examples="drop", source="s"
    )
    assert (stats.num_kept, stats.num_truncated, stats.num_dropped_long) == (1, 0, 1)
    assert rows(dropped) == rows(truncated.select([0]))
    assert "1 dropped as longer than max_length" in stats.describe()
    with pytest.raises(
        RecordError, match=r"^s record 1: the example is \d+ tokens long, more than max_length=40"
    ):
        tokenize_dataset(dataset, chatml_tokenizer, max_length=40, long_examples="error", source="s")
    _, stats = tokenize_dataset(
        dataset, chatml_tokenizer, max_length=40, long_examples="error", on_bad_record="skip", source="s"
    )
    assert stats.skipped == {"longer than max_length": 1} and stats.num_kept == 1


def test_bad_options_are_refused(llama2_tokenizer: PreTrainedTokenizerBase) -> None:
    dataset = datasets.Dataset.from_list([{"text": "x"}])
    for key, value in (("chat_loss", "assistants"), ("long_examples", "cut"), ("on_bad_record", "ignore")):
        with pytest.raises(ValueError, match=f"Unknown {key} '{value}'"):
            tokenize_dataset(dataset, llama2_tokenizer, max_length=8, **{key: value})


# ---------------------------------------------------------------------------------------------------
# showing the trained spans
# ---------------------------------------------------------------------------------------------------


def test_format_trained_spans(chatml_tokenizer: PreTrainedTokenizerBase) -> None:
    examples, _ = tokenize_dataset(
        datasets.Dataset.from_list([{"messages": CHAT}]), chatml_tokenizer, max_length=64
    )
    ids, labels = examples[0]["input_ids"], examples[0]["labels"]
    plain = format_trained_spans(chatml_tokenizer, ids, labels, color=False)
    # Exactly the reply and its end-of-turn token are marked; without the markers it is the plain decode.
    assert re.findall(r"\[\[(.*?)\]\]", plain, flags=re.S) == ["Hello!<|im_end|>"]
    assert plain.replace("[[", "").replace("]]", "") == chatml_tokenizer.decode(ids)
    colored = format_trained_spans(chatml_tokenizer, ids, labels, color=True)
    assert "\x1b[42;30mHello!<|im_end|>\x1b[0m" in colored
    # labels[0] is never predicted, so it is never shown as trained.
    assert format_trained_spans(chatml_tokenizer, ids[:2], ids[:2], color=False).count("[[") == 1
    assert IGNORE_INDEX not in ids


def test_show_data_cli_prints_examples_with_trained_spans(
    tmp_path: Path, chatml_tokenizer: PreTrainedTokenizerBase, capsys: pytest.CaptureFixture[str]
) -> None:
    from hf_fsdp2 import cli

    chatml_tokenizer.save_pretrained(tmp_path / "tok")
    data = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:]}, {"messages": None}]
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {tmp_path / 'tok'}\ndataset_name: {data}\noutput_dir: {tmp_path / 'out'}\n"
    )
    argv = ["show-data", "--config", str(recipe), "--num-examples", "1", "--color", "never", "--tokens"]
    # Recipe keys after the options override the YAML, as on the recipe's command line.
    assert cli.main([*argv, "--on_bad_record", "skip", "--chat_loss", "last_assistant"]) == 0
    out = capsys.readouterr().out
    assert "1 bad records skipped (1 missing field)" in out
    assert "data layout: expected padding efficiency" in out
    assert out.count("=== ") == 1 and f"=== {data} (messages): example 0, " in out
    assert re.findall(r"\[\[(.*?)\]\]", out.split("=== ", 1)[1], flags=re.S) == ["Hello!<|im_end|>"]
    assert re.search(r"^\s+\d+ T\s+32001 '<\|im_end\|>'$", out, flags=re.M)  # the --tokens table
    assert not (tmp_path / "out").exists()  # nothing is written

    # The bad record is an error without the override: one line on stderr, exit status 2.
    assert cli.main(argv) == 2
    assert (
        f"hf-fsdp2 show-data: error: {data} record 2: column 'messages' is missing or None"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        cli.main(
            ["demo-data", str(tmp_path), "--no-such-option"]
        )  # other commands still refuse unknown arguments
