"""Unit tests of KTO's data and settings: unpaired records -> examples (bad records named or skipped and counted;
pairs unpaired as TRL does), the KL completions dealt as the sampler deals the examples, the collator's layout,
the loss per example against the paper's formula, and the recipes' refusals of each other's settings."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.data.records import RecordError
from hf_fsdp2.data.unpaired import UnpairedCollator, kl_groups, tokenize_unpaired, unpair, with_kl_completions
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.methods.kto.objective import kto_objective
from hf_fsdp2.methods.kto.step import KTOSettings, kto_losses


def parse_config(argv: list[str], recipe: str = "kto") -> Config:
    return parse_method_config(
        recipe, ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "out", *argv]
    )


@pytest.mark.parametrize(
    "record, message, reason",
    [
        ({"prompt": "Q", "completion": " a", "label": "yes"}, "label='yes' (str) is not a boolean", "non-boolean label"),
        ({"prompt": "Q", "completion": " a", "label": 1}, "label=1 (int) is not a boolean", "non-boolean label"),
        ({"prompt": "Q", "completion": " a"}, "column 'label' is missing", "missing field"),
        ({"prompt": "Q", "label": True}, "column 'completion' is missing", "missing field"),
        ({"prompt": "Q", "completion": "  ", "label": True}, "an empty completion", "empty completion"),
        ({"prompt": "Q", "completion": [{"role": "assistant", "content": "a"}], "label": True}, "both be strings",
         "mixed types"),
    ],
)  # fmt: skip
def test_bad_records_are_named_with_their_index_or_skipped_and_counted(
    chatml_tokenizer, record: dict, message: str, reason: str
) -> None:
    good = {"prompt": "Q", "completion": " fine", "label": False}
    with pytest.raises(RecordError, match=f"^d.jsonl record 1: .*{message.split('(')[0]}") as err:
        tokenize_unpaired([good, record], chatml_tokenizer, max_length=32, source="d.jsonl")
    assert message in str(err.value) and err.value.reason == reason
    examples, stats = tokenize_unpaired(
        [good, record, good], chatml_tokenizer, max_length=32, on_bad_record="skip", source="d.jsonl"
    )
    assert [e["index"] for e in examples] == [0, 1] and stats.skipped == {reason: 1}
    assert stats.describe("d.jsonl").endswith("1 bad records skipped (1 " + reason + ") -> 2 examples")


def test_strings_get_eos_and_message_lists_the_chat_template(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    (text,), _ = tokenize_unpaired(
        [{"prompt": "The sky is", "completion": " blue", "label": True}], tok, max_length=64
    )
    assert text["prompt_ids"] + text["completion_ids"] == tok("The sky is blue" + tok.eos_token)["input_ids"]
    assert tok.decode(text["completion_ids"]).strip() == "blue" + tok.eos_token
    assert text["label"] is True
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    (chat,), _ = tokenize_unpaired(
        [{"prompt": [user], "completion": [answer], "label": False}], tok, max_length=64
    )
    rendered = tok.apply_chat_template([user, answer], tokenize=True, return_dict=True)["input_ids"]
    assert chat["prompt_ids"] + chat["completion_ids"] == list(rendered)
    assert chat["prompt_ids"] == list(
        tok.apply_chat_template([user], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_pairs_are_unpaired_as_trls_unpair_preference_dataset(chatml_tokenizer) -> None:
    pairs = [
        {"prompt": "A", "chosen": " good", "rejected": " bad"},
        {"prompt": "B", "chosen": " yes", "rejected": " no"},
        {"prompt": "C", "chosen": " same", "rejected": " same"},
    ]
    rows = unpair(pairs, "p.jsonl")
    assert [(r.get("prompt"), r.get("completion"), r.get("label")) for r in rows if "error" not in r] == [
        ("A", " good", True),
        ("B", " yes", True),
        ("A", " bad", False),
        ("B", " no", False),
    ]
    with pytest.raises(RecordError, match="p.jsonl record 2: chosen and rejected are the same"):
        tokenize_unpaired(pairs, chatml_tokenizer, max_length=32, source="p.jsonl")
    examples, stats = tokenize_unpaired(pairs, chatml_tokenizer, max_length=32, on_bad_record="skip")
    assert len(examples) == 4 and stats.pairs == 3 and stats.skipped == {"identical pair": 1}


def test_kl_completions_rotate_within_the_samplers_micro_batches() -> None:
    # 2 ranks, batch 2: rank 0 takes positions 0, 2 | 4, 6; rank 1 takes 1, 3 | 5, 7; position 8 is dropped by the
    # sampler (not a multiple of the world) and stands alone.
    assert kl_groups(9, world_size=2, batch_size=2) == [[0, 2], [4, 6], [1, 3], [5, 7], [8]]
    assert kl_groups(8, world_size=1, batch_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # TRL's chunks
    examples = [{"prompt_ids": [1], "completion_ids": [100 + i], "label": i % 2 == 0} for i in range(9)]
    dealt = with_kl_completions(examples, world_size=2, batch_size=2)
    kl = {i: e["kl_ids"][0] - 100 for i, e in enumerate(dealt)}
    assert kl == {0: 2, 2: 0, 4: 6, 6: 4, 1: 3, 3: 1, 5: 7, 7: 5, 8: 7}  # a lone example takes another's
    trl = with_kl_completions(examples[:4], world_size=1, batch_size=4)
    assert [e["kl_ids"][0] - 100 for e in trl] == [3, 0, 1, 2]  # (x1, y4), (x2, y1), ...: TRL's +1 rotation


def test_the_collator_lays_out_the_examples_then_their_kl_rows() -> None:
    examples = [
        {"prompt_ids": [1, 2], "completion_ids": [3], "kl_ids": [4, 5, 6], "label": True, "index": 7},
        {"prompt_ids": [8], "completion_ids": [9, 10], "kl_ids": [3], "label": False, "index": 2},
    ]
    batch = UnpairedCollator(pad_token_id=0, max_length=8)(examples)
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 0, 0],
        [8, 9, 10, 0, 0],
        [1, 2, 4, 5, 6],
        [8, 3, 0, 0, 0],
    ]
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 3, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["label"].tolist() == [True, False] and batch["pair_index"].tolist() == [7, 2]
    plain = UnpairedCollator(pad_token_id=0, max_length=8, kl=False)(examples)  # APO-zero: no KL rows
    assert plain["input_ids"].tolist() == [[1, 2, 3], [8, 9, 10]] and plain["completion_mask"].shape == (2, 3)


def test_the_losses_are_the_papers_per_example() -> None:
    settings = KTOSettings(beta=0.5, desirable_weight=1.5, undesirable_weight=0.8)
    policy, reference = torch.tensor([-3.0, -2.0, -5.0]), torch.tensor([-4.0, -2.5, -4.0])
    good, kl = torch.tensor([True, False, False]), torch.tensor(0.3)
    losses, rewards = kto_losses(policy, reference, good, kl, settings)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [
        1.5 * (1 - sig(0.5 * (1.0 - 0.3))),
        0.8 * (1 - sig(0.5 * (0.3 - 0.5))),
        0.8 * (1 - sig(0.5 * (0.3 + 1))),
    ]
    assert losses.tolist() == pytest.approx(want, rel=1e-6) and rewards.tolist() == pytest.approx(
        [0.5, 0.25, -0.5]
    )
    apo = KTOSettings(beta=0.5, loss_type="apo_zero_unpaired")
    losses, _ = kto_losses(policy, reference, good, kl, apo)
    assert losses.tolist() == pytest.approx([1 - sig(0.5), sig(0.25), sig(-0.5)], rel=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--loss_type", "ipo"),
            "loss_type='ipo' is not a loss of the KTO recipe.*paired objectives of recipes/dpo.py",
        ),
        (("--per_device_train_batch_size", "1"), "per_device_train_batch_size=1: KTO estimates its KL"),
        (
            ("--label_smoothing", "0.1"),
            "'label_smoothing' in the command line is a key of the dpo recipe, not of the kto",
        ),
    ],
)
def test_the_kto_recipe_refuses_dpo_settings(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kto_objective(parse_config(["--per_device_train_batch_size", "2", *args]))


def test_the_kto_recipe_reads_the_default_loss_as_kto_and_the_dpo_recipe_refuses_kto() -> None:
    cfg = parse_config(["--per_device_train_batch_size", "2"])
    kto_objective(cfg)
    assert cfg.method.loss_type == "kto"
    kto_objective(parse_config(["--loss_type", "apo_zero_unpaired", "--per_device_train_batch_size", "1"]))
    with pytest.raises(ConfigError, match="loss_type='kto' is not a loss of the DPO recipe.*recipes/kto.py"):
        parse_config(["--loss_type", "kto"], "dpo")
    with pytest.raises(
        ConfigError, match="'desirable_weight' in the command line is a key of the kto recipe"
    ):
        parse_config(["--desirable_weight", "2"], "dpo")


@pytest.mark.parametrize(
    "good, bad, unused, used, fix",
    [
        (8, 0, "undesirable_weight=1.5 does nothing", "desirable_weight=2 only scales", "label false"),
        (0, 8, "desirable_weight=2 does nothing", "undesirable_weight=1.5 only scales", "label true"),
    ],
)
def test_one_kind_only_says_the_other_kinds_weight_does_nothing(
    good: int, bad: int, unused: str, used: str, fix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """All-desirable (or all-undesirable) KTO data once said "one kind only" and no more; the weight of
    the missing kind then weights nothing, and the message says so, with the fix."""
    from hf_fsdp2.methods.kto.data import _warn_balance

    with caplog.at_level("WARNING", logger="hf_fsdp2"):
        _warn_balance(good, bad, 2.0, 1.5)
    [message] = [r.getMessage() for r in caplog.records]
    assert f"{good} desirable and {bad} undesirable examples: one kind only" in message
    assert unused in message and used in message and fix in message


def test_balanced_kto_data_warns_nothing_and_unbalanced_suggests_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hf_fsdp2.methods.kto.data import _warn_balance

    with caplog.at_level("WARNING", logger="hf_fsdp2"):
        _warn_balance(4, 4, 1.0, 1.0)
        _warn_balance(5, 4, 1.0, 1.0)  # 1.25: inside [1, 4/3]
        assert not caplog.records
        _warn_balance(9, 1, 1.0, 1.0)
    assert "= 9.00, outside [1, 4/3]" in caplog.records[0].getMessage()
