"""Training data that would silently teach nothing or something else (issue 25, item 7): data in which no example
has a target token is refused at the start naming the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.sources import DataSource
from hf_fsdp2.data.mixture import build_sft_datasets
from hf_fsdp2.trainer.sft_data import check_has_targets


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_data_whose_every_prompt_fills_max_length_is_refused_at_the_start(
    chatml_tokenizer, tmp_path: Path
) -> None:
    data = _jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 60, "completion": " yes"} for _ in range(6)])
    built = build_sft_datasets([DataSource(str(data))], chatml_tokenizer, max_length=32, seed=0)
    assert len(built.train) == 6  # kept, truncated: before the fix this trained to the end at loss 0
    with pytest.raises(ConfigError) as err:
        check_has_targets(built.stats, built.train_counts, 32)
    text = str(err.value)
    assert "no training example has a target token" in text and "long.jsonl" in text
    assert "6 of the 6 examples were cut at max_length=32" in text and "raise max_length" in text


def test_data_with_some_targets_passes(chatml_tokenizer, tmp_path: Path) -> None:
    records = [{"prompt": "word " * 60, "completion": " yes"}] * 5 + [{"prompt": "hi", "completion": " yes"}]
    built = build_sft_datasets([DataSource(str(_jsonl(tmp_path / "d.jsonl", records)))], chatml_tokenizer,
                               max_length=32, seed=0)  # fmt: skip
    check_has_targets(built.stats, built.train_counts, 32)
    assert built.stats[0].num_without_targets == 5
