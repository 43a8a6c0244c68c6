"""Evaluation pieces on one process: every eval example once over the ranks with equal batch counts,
the token-weighted eval loss, and greedy samples equal to transformers' own greedy generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.numerics import assert_same_maths
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.observe.evaluate import eval_batches, evaluate_loss, generate_samples
from hf_fsdp2.train.loss import LossPlan

EXAMPLES = [
    {"input_ids": list(range(3, 3 + n)), "labels": [-100] * (n // 2) + list(range(3 + n // 2, 3 + n))}
    for n in (5, 9, 4, 7, 6, 8, 3)
]


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).double().eval()  # float64: batched vs one-by-one sums in other orders


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_batches_cover_every_example_once_with_equal_counts(world: int) -> None:
    collator = PaddingCollator(pad_token_id=0)
    per_rank = [
        list(eval_batches(EXAMPLES, rank=r, world_size=world, batch_size=2, collator=collator))
        for r in range(world)
    ]
    assert len({len(b) for b in per_rank}) == 1  # the same number of forward passes on every rank
    targets = sum(int((b["labels"][:, 1:] != -100).sum()) for batches in per_rank for b in batches)
    assert targets == sum(sum(1 for t in e["labels"][1:] if t != -100) for e in EXAMPLES)


def test_eval_loss_is_token_weighted_over_all_examples() -> None:
    model = _tiny_model()
    collator = PaddingCollator(pad_token_id=0)
    result = evaluate_loss(
        model,
        eval_batches(EXAMPLES, rank=0, world_size=1, batch_size=3, collator=collator),
        torch.device("cpu"),
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for e in EXAMPLES:  # one example at a time, no padding
            logits = model(torch.tensor([e["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(e["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    assert result.tokens == count
    want = torch.tensor(total / count, dtype=torch.float64)
    assert_same_maths(torch.tensor(result.loss, dtype=torch.float64), want, terms=40, name="eval loss")
    assert_same_maths(torch.tensor(result.perplexity, dtype=torch.float64), want.exp(), terms=40, name="ppl")
    assert model.training is False  # mode restored
    # The chunked cross entropy of training (ce_chunk_tokens) gives the same eval loss.
    chunked = evaluate_loss(
        model,
        eval_batches(EXAMPLES, rank=0, world_size=1, batch_size=3, collator=collator),
        torch.device("cpu"),
        plan=LossPlan(4),
    )
    assert chunked.tokens == count
    assert_same_maths(
        torch.tensor(chunked.loss, dtype=torch.float64), want, terms=40, name="chunked eval loss"
    )


class _Tok:
    """The smallest tokenizer generate_samples needs: ids in the text, eos id 2."""

    eos_token_id = 2
    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_samples_equal_transformers_greedy_generation() -> None:
    model = _tiny_model().train()
    prompts = ["5 6 7", "9 3"]
    texts = generate_samples(model, _Tok(), prompts, max_new_tokens=6, device=torch.device("cpu"))
    assert model.training  # mode restored
    model.eval()
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([[int(t) for t in prompt.split()]])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[0, ids.shape[1] :].tolist()
        expected = out[: out.index(2)] if 2 in out else out
        assert text == " ".join(map(str, expected))
