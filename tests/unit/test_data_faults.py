"""Training data that would silently teach nothing or something else: data in which no example
has a target token is refused at the start naming the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.sources import DataSource
from hf_fsdp2.data.mixture import build_sft_datasets
from hf_fsdp2.methods.sft.data import check_has_targets


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_data_whose_every_prompt_fills_max_length_is_refused_at_the_start(
    chatml_tokenizer, tmp_path: Path
) -> None:
    data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 60, "completion": " yes"} for _ in range(6)])
    built = build_sft_datasets([DataSource(name=str(data))], chatml_tokenizer, max_length=32, seed=0)
    assert len(built.train) == 6  # kept, truncated: before the fix this trained to the end at loss 0
    with pytest.raises(ConfigError) as err:
        check_has_targets(built.stats, built.train_counts, 32)
    text = str(err.value)
    assert "no training example has a target token" in text and "long.jsonl" in text
    assert "6 of the 6 examples were cut at max_length=32" in text and "raise max_length" in text


def test_data_with_some_targets_passes(chatml_tokenizer, tmp_path: Path) -> None:
    records = [{"prompt": "word " * 60, "completion": " yes"}] * 5 + [{"prompt": "hi", "completion": " yes"}]
    built = build_sft_datasets(
        [DataSource(name=str(_jsonl(tmp_path / "d.jsonl", records)))], chatml_tokenizer, max_length=32, seed=0
    )
    check_has_targets(built.stats, built.train_counts, 32)
    assert built.stats[0].num_without_targets == 5


def test_a_data_file_changed_in_place_is_named(tmp_path: Path) -> None:
    from hf_fsdp2.data.fingerprint import changed_files, data_fingerprint

    small = _jsonl(tmp_path / "a.jsonl", [{"text": "x"}] * 3)
    big = tmp_path / "corpus"
    big.mkdir()
    (big / "b.txt").write_bytes(b"y" * (3 << 20))
    (big / ".cache").mkdir()
    (big / ".cache" / "c").write_text("ignored")
    before = data_fingerprint([str(small), str(big), "org/hub-dataset"])
    assert sorted(Path(p).name for p in before) == ["a.jsonl", "b.txt"]  # hub ids and hidden caches have none
    assert changed_files(before, data_fingerprint([str(small), str(big)])) == []
    small.write_text(small.read_text() + '{"text": "z"}\n')  # appended
    with (big / "b.txt").open("r+b") as fh:  # same size, last MiB edited
        fh.seek((3 << 20) - 10)
        fh.write(b"z")
    changed = changed_files(before, data_fingerprint([str(small), str(big)]))
    assert len(changed) == 2
    assert "a.jsonl changed (" in changed[0] and "-> " in changed[0] and "bytes)" in changed[0]
    assert "b.txt changed (same size, other bytes)" in changed[1]
    small.unlink()
    assert "a.jsonl is gone" in changed_files(before, data_fingerprint([str(small), str(big)]))[0]
