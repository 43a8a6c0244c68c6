"""Unit tests of DPO: preference records -> pairs (prompt shared, completions masked), the collator's layout, the
completion log-probs on several families (tied and untied heads, softcapped logits, MoE), the loss formulas
against hand computation, and the reference helpers' rank symmetry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.families import make_family_dir

from hf_fsdp2.data.pairs import PreferenceCollator, split_prompt, tokenize_pair, tokenize_pairs
from hf_fsdp2.data.records import RecordError
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods.dpo.loss import DPOSettings, pair_losses
from hf_fsdp2.model import disable_dropout, load_model
from hf_fsdp2.train.logps import FrozenModel, completion_logps, even_batches, precompute_reference
from hf_fsdp2.train.loss import LossPlan, plan_loss

# --- records -------------------------------------------------------------------------------------------


def test_explicit_and_implicit_prompts_split_as_trl_does() -> None:
    assert split_prompt({"prompt": "Q", "chosen": " a", "rejected": " b"}, "r") == ("Q", " a", " b")
    # No prompt: the common prefix; the space before the answers goes to the completions.
    assert split_prompt({"chosen": "Q: sky? Blue.", "rejected": "Q: sky? Red."}, "r") == (
        "Q: sky?",
        " Blue.",
        " Red.",
    )
    user = {"role": "user", "content": "hi"}
    good, bad = {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": "go away"}
    assert split_prompt({"chosen": [user, good], "rejected": [user, bad]}, "r") == ([user], [good], [bad])
    # UltraFeedback: a text prompt and conversations that repeat it.
    assert split_prompt({"prompt": "hi", "chosen": [user, good], "rejected": [user, bad]}, "r") == (
        [user],
        [good],
        [bad],
    )
    # A text prompt and bare assistant turns: the text is the user's turn.
    assert split_prompt({"prompt": "hi", "chosen": [good], "rejected": [bad]}, "r") == ([user], [good], [bad])


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "Q", "rejected": " b"}, "record 7: column 'chosen' is missing or None (columns: ['prompt', 'rejected'])"),
        ({"prompt": "Q", "chosen": "  ", "rejected": " b"}, "record 7: an empty chosen completion"),
        ({"prompt": "Q", "chosen": " a", "rejected": []}, "record 7: an empty rejected completion"),
        ({"chosen": "same", "rejected": "same"}, "record 7: chosen and rejected are the same"),
        ({"prompt": "Q", "chosen": " same", "rejected": " same"}, "record 7: chosen and rejected are the same (' same')"),
        ({"prompt": "Q", "chosen": [{"role": "assistant", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "a"}]}, "record 7: chosen and rejected are the same"),
        ({"prompt": "Q", "chosen": " a", "rejected": [{"role": "assistant", "content": "b"}]}, "must all be strings"),
    ],
)  # fmt: skip
def test_bad_records_are_named(record: dict, message: str) -> None:
    with pytest.raises(RecordError, match="^record 7: ") as err:
        split_prompt(record, "record 7")
    assert message in str(err.value)


def test_string_pairs_get_eos_and_share_the_prompt_tokens(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    prompt, chosen, rejected = tokenize_pair(tok, "The sky is", " blue", " green and red", "r")
    assert prompt == tok("The sky is")["input_ids"]
    assert prompt + chosen == tok("The sky is blue" + tok.eos_token)["input_ids"]
    assert prompt + rejected == tok("The sky is green and red" + tok.eos_token)["input_ids"]
    assert chosen[-1] == rejected[-1] == tok.eos_token_id


def test_message_pairs_use_the_chat_template(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    user = [{"role": "user", "content": "Colour of the sky?"}]
    good = [{"role": "assistant", "content": "Blue."}]
    bad = [{"role": "assistant", "content": "Green."}]
    prompt, chosen, rejected = tokenize_pair(tok, user, good, bad, "r")
    gen = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    full = tok.apply_chat_template(user + good, tokenize=True, return_dict=True)["input_ids"]
    assert prompt == list(gen) and prompt + chosen == list(full)
    assert (
        "Blue." in tok.decode(chosen)
        and "Blue." not in tok.decode(prompt)
        and "Green." in tok.decode(rejected)
    )


def test_long_pairs_are_truncated_dropped_or_refused_and_bad_ones_skipped_and_counted(
    chatml_tokenizer,
) -> None:
    tok = chatml_tokenizer
    records = [
        {"prompt": "short", "chosen": " a", "rejected": " b"},
        {"prompt": "short", "chosen": " a " * 40, "rejected": " b"},  # completion too long: truncated
        {"prompt": "word " * 40, "chosen": " a", "rejected": " b"},  # prompt fills max_length: dropped
        {"prompt": "x", "rejected": " b"},  # no chosen
    ]
    pairs, stats = tokenize_pairs(records, tok, max_length=16, on_bad_record="skip", source="d.jsonl")
    assert (stats.pairs, stats.kept, stats.truncated, stats.dropped, stats.skipped) == (
        4,
        2,
        1,
        1,
        {"missing field": 1},
    )
    assert [p["index"] for p in pairs] == [0, 1]
    assert "4 pairs, 1 truncated, 1 dropped" in stats.describe("d.jsonl")
    with pytest.raises(RecordError, match="d.jsonl record 3: column 'chosen' is missing"):
        tokenize_pairs(records, tok, max_length=16, source="d.jsonl")
    with pytest.raises(RecordError, match="d.jsonl record 1: .* more than max_length=16"):
        tokenize_pairs(records[:2], tok, max_length=16, long_examples="error", source="d.jsonl")


def test_pairs_with_the_same_chosen_and_rejected_are_named_or_skipped_and_counted(chatml_tokenizer) -> None:
    tok = chatml_tokenizer
    records = [
        {"prompt": "Q", "chosen": " a", "rejected": " b"},
        {"prompt": "Q", "chosen": " same", "rejected": " same"},  # trains at ln 2 with no gradient
        {
            "prompt": "Q",
            "chosen": " a" * 30 + " x",
            "rejected": " a" * 30 + " y",
        },  # the same within max_length
    ]
    with pytest.raises(RecordError, match="d.jsonl record 1: chosen and rejected are the same"):
        tokenize_pairs(records, tok, max_length=16, source="d.jsonl")
    with pytest.raises(
        RecordError, match="d.jsonl record 1: chosen and rejected differ only after max_length=16"
    ):
        tokenize_pairs([records[0], records[2]], tok, max_length=16, source="d.jsonl")
    pairs, stats = tokenize_pairs(records, tok, max_length=16, on_bad_record="skip", source="d.jsonl")
    assert len(pairs) == 1 and stats.skipped == {"identical pair": 1, "identical within max_length": 1}
    assert "2 bad records skipped (1 identical pair, 1 identical within max_length)" in stats.describe(
        "d.jsonl"
    )


def test_collator_puts_chosen_rows_then_rejected_rows_right_padded_with_completion_masks() -> None:
    pairs = [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "index": 4},
        {"prompt_ids": [7], "chosen_ids": [8, 9, 10, 11, 12], "rejected_ids": [13, 14], "index": 9},
    ]
    batch = PreferenceCollator(pad_token_id=0, max_length=5)(pairs)
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 4, 5],
        [7, 8, 9, 10, 11],
        [1, 2, 3, 6, 0],
        [7, 13, 14, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5, [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert batch["completion_mask"].tolist() == [
        [0, 0, 0, 1, 1],
        [0, 1, 1, 1, 1],
        [0, 0, 0, 1, 0],
        [0, 1, 1, 0, 0],
    ]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [
        [x, x, x, 4, 5],
        [x, 8, 9, 10, 11],
        [x, x, x, 6, x],
        [x, 13, 14, x, x],
    ]
    assert batch["pair_index"].tolist() == [4, 9]


# --- log-probs ---------------------------------------------------------------------------------------------


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (4, 10), generator=gen)
    attention = torch.ones_like(ids)
    attention[2, 7:] = 0
    attention[3, 5:] = 0
    completion = torch.zeros_like(ids)
    completion[0, 4:] = completion[1, 2:] = 1
    completion[2, 4:7] = completion[3, 2:5] = 1
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "labels": ids.masked_fill(completion == 0, IGNORE_INDEX),
    }


@pytest.mark.parametrize("family", ["llama_tied", "llama3_untied", "gemma2", "granite", "qwen3_moe"])
def test_completion_logps_are_the_models_own_on_the_head_hook_and_the_full_logits_paths(
    family: str, tmp_path: Path
) -> None:
    model = load_model(str(make_family_dir(tmp_path / family, family, initializer_range=0.5)))
    # fp64 where the model's kernels allow it (grouped MoE matmuls are fp32 at most): the paths then differ by
    # rounding only, far below the tolerances (fp32: a few ulps of a 1000-term logsumexp, relative 1e-5).
    exact = family != "qwen3_moe"
    model = model.double() if exact else model
    rtol, atol = (1e-12, 1e-10) if exact else (1e-5, 1e-4)
    model.eval()
    batch = _batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits  # the model's own post-processing included
        per_token = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        want = (per_token * batch["completion_mask"][:, 1:]).sum(1)
        hooked, _ = completion_logps(model, inputs, batch["labels"], plan_loss(model, 64))
        full, _ = completion_logps(model, inputs, batch["labels"], LossPlan())
    assert plan_loss(model, 64).chunk_tokens == 64  # the head-hook path was taken
    torch.testing.assert_close(hooked, want.to(hooked.dtype), rtol=rtol, atol=atol)
    torch.testing.assert_close(full, want.to(full.dtype), rtol=rtol, atol=atol)
    assert bool((want < 0).all())


def test_disable_dropout_zeroes_modules_and_attention_rates(tmp_path: Path) -> None:
    model = load_model(str(make_family_dir(tmp_path / "m", "llama3_untied")))
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.model.extra = torch.nn.Dropout(0.3)
    assert disable_dropout(model) == 3
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert model.model.extra.p == 0.0


# --- losses --------------------------------------------------------------------------------------------------


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize(
    "loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("robust", 0.1), ("hinge", 0.0)]
)
def test_pair_losses_match_the_papers_formulas(loss_type: str, eps: float) -> None:
    policy = torch.tensor([-10.0, -20.0, -14.0, -18.0], dtype=torch.float64)  # chosen (2), rejected (2)
    reference = torch.tensor([-12.0, -19.0, -13.0, -21.0], dtype=torch.float64)
    lengths = torch.tensor([4, 5, 2, 3])
    beta = 0.5
    losses, chosen, rejected, _ = pair_losses(
        policy,
        reference,
        lengths,
        DPOSettings(beta=beta, loss_type=loss_type, label_smoothing=eps),
    )
    for i in range(2):
        dc, dr = policy[i] - reference[i], policy[2 + i] - reference[2 + i]
        d = float(dc - dr)
        want = {
            "sigmoid": -(1 - eps) * math.log(_sig(beta * d)) - eps * math.log(_sig(-beta * d)),
            "ipo": (float(dc) / int(lengths[i]) - float(dr) / int(lengths[2 + i]) - 1 / (2 * beta)) ** 2,
            "robust": (-(1 - eps) * math.log(_sig(beta * d)) + eps * math.log(_sig(-beta * d)))
            / (1 - 2 * eps),
            "hinge": max(0.0, 1 - beta * d),
        }[loss_type]
        assert float(losses[i]) == pytest.approx(want, rel=1e-12)
        assert float(chosen[i]) == pytest.approx(beta * float(dc)) and float(rejected[i]) == pytest.approx(
            beta * float(dr)
        )


def _trl_self(**values: object) -> object:
    """The attributes TRL's loss methods read from their trainer (CPU, no AlphaPO)."""
    from types import SimpleNamespace

    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), alpha=0.0, **values)


@pytest.mark.parametrize(
    "loss_type, eps, gamma", [("simpo", 0.0, 0.5), ("simpo", 0.2, 1.0), ("orpo", 0.0, 0.0)]
)
def test_reference_free_losses_equal_trls_own_loss_functions(
    loss_type: str, eps: float, gamma: float
) -> None:
    """SimPO and ORPO per pair against TRL 1.16's own ``CPOTrainer.cpo_loss`` (loss_type simpo) and
    ``ORPOTrainer.odds_ratio_loss``, called on the same per-token mean log-probs; our rewards are TRL's, and ORPO's
    logged log-odds too. Includes a chosen mean log-prob near 0 (log(1 - e^a) near its cancellation)."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    policy = torch.tensor(
        [-10.0, -0.02, -3.0, -14.0, -18.0, -0.5], dtype=torch.float64
    )  # chosen (3), rejected (3)
    lengths = torch.tensor([4, 1, 2, 2, 3, 5])
    beta = 0.25
    settings = DPOSettings(beta=beta, loss_type=loss_type, label_smoothing=eps, simpo_gamma=gamma)
    losses, chosen, rejected, extras = pair_losses(policy, None, lengths, settings)
    mean = policy / lengths.double()
    if loss_type == "simpo":
        trl_self = _trl_self(beta=beta, simpo_gamma=gamma, label_smoothing=eps, loss_type="simpo")
        want, want_c, want_r = CPOTrainer.cpo_loss(trl_self, mean[:3], mean[3:])
        torch.testing.assert_close(losses, want, rtol=1e-12, atol=0)
    else:
        trl_self = _trl_self(beta=beta)
        terms, want_c, want_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(trl_self, mean[:3], mean[3:])
        # TRL returns beta x logsigmoid(log_odds) and subtracts its mean; ours is the per-pair loss it subtracts.
        # TRL computes in fp32 (it casts the log-probs to float).
        torch.testing.assert_close(losses.float(), -terms, rtol=1e-6, atol=0)
        assert float(extras["log_odds_ratio"].mean()) == pytest.approx(float(ratio), rel=1e-6)
        assert float(extras["log_odds_chosen"].mean()) == pytest.approx(float(log_odds), rel=1e-6)
    torch.testing.assert_close(chosen.to(want_c.dtype), want_c, rtol=1e-6, atol=0)
    torch.testing.assert_close(rejected.to(want_r.dtype), want_r, rtol=1e-6, atol=0)


def test_even_batches_give_every_rank_the_same_number_of_forwards_and_each_pair_once() -> None:
    pairs = [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "index": i} for i in range(7)]
    collator = PreferenceCollator(pad_token_id=0, max_length=8)
    seen = []
    counts = set()
    for rank in range(3):
        batches = list(even_batches(pairs, rank=rank, world_size=3, batch_size=2, collator=collator))
        counts.add(len(batches))
        seen += [i for batch, real in batches if real for i in batch["pair_index"].tolist()]
    assert counts == {2} and sorted(seen) == list(range(7))


def test_precomputed_reference_is_the_models_log_probs_by_pair_index(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = make_family_dir(tmp_path / "m", "qwen2", initializer_range=0.5)
    model = load_model(str(folder)).double()
    records = [{"prompt": f"question {i}", "chosen": " yes" * (i + 1), "rejected": " no"} for i in range(5)]
    pairs, _ = tokenize_pairs(records, AutoTokenizer.from_pretrained(folder), max_length=32)
    collator = PreferenceCollator(pad_token_id=0, max_length=32)
    frozen = FrozenModel(model, LossPlan())
    table = precompute_reference(frozen, pairs, collator=collator, batch_size=2, device=torch.device("cpu"))
    batch = collator([pairs[4], pairs[1]])  # another batching than the pass's
    torch.testing.assert_close(table.logps(batch), frozen.logps(batch), rtol=1e-12, atol=1e-10)
