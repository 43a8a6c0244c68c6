"""GRPO's chunked scoring: the completion log-probs and entropies computed through the output head's
hook, ``ce_chunk_tokens`` rows at a time with the temperature inside the chunk, equal the plain full-vocabulary
log-softmax in fp64 (values and gradients, a soft-capped and scaled head too); the bytes live at the peak of a
forward + backward, measured on CPU, shrink by the factor the sizes give (no ``[tokens x vocab]`` block kept)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_fsdp2.methods.grpo.loss import _ChunkedTokenLogps, token_logps_and_entropy
from hf_fsdp2.train.chunked_ce import LogitTransform
from hf_fsdp2.train.loss import LossPlan


def _model(vocab: int, hidden: int, layers: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype)


def _rows(vocab: int, batch: int, prompt: int, width: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded completions of different lengths (one of length 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt + width), generator=g)
    attention = torch.ones_like(ids)
    completion = torch.zeros((batch, width), dtype=torch.long)
    for row in range(batch):
        pad = row % 3
        attention[row, :pad] = 0
        length = [width, width // 2, 1, 0][row % 4]
        completion[row, :length] = 1
        attention[row, prompt + length :] = 0
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _plain(logits: torch.Tensor, targets: torch.Tensor, temperature: float, transform: LogitTransform) -> Any:
    z = transform.apply(logits) / temperature
    logps = torch.log_softmax(z, -1)
    return logps.gather(-1, targets[:, None]).squeeze(-1), -(logps.exp() * logps).sum(-1)


@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)], ids=["plain", "softcap"]
)
def test_the_chunked_function_equals_the_full_log_softmax_with_gradients(transform: LogitTransform) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    upstream = torch.randn(11, dtype=torch.float64, generator=g)
    logps, entropy = _ChunkedTokenLogps.apply(hidden, weight, targets, 4, 0.7, transform, True)
    (logps * upstream).sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None
    want_logps, want_entropy = _plain(hidden @ weight.t(), targets, 0.7, transform)
    (want_logps * upstream).sum().backward()
    assert torch.allclose(logps, want_logps, atol=1e-12) and torch.allclose(entropy, want_entropy, atol=1e-12)
    assert torch.allclose(got[0], hidden.grad, atol=1e-12) and torch.allclose(got[1], weight.grad, atol=1e-12)


def test_chunked_scoring_of_a_model_equals_the_plain_path_in_fp64() -> None:
    """Through the head's hook on a real model: only the completion positions, every chunk size alike."""
    vocab, width = 300, 7
    rows = _rows(vocab, batch=5, prompt=6, width=width)
    results = []
    for plan in (None, LossPlan(chunk_tokens=4), LossPlan(chunk_tokens=1000)):
        model = _model(vocab, 32, 2, torch.float64)
        logps, entropy = token_logps_and_entropy(
            model, rows["input_ids"], rows["attention_mask"], rows["completion_mask"], 0.8, plan, entropy=True
        )
        mask = rows["completion_mask"].double()
        (logps * mask * torch.linspace(-1, 2, width, dtype=torch.float64)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logps * mask, entropy * mask, grads))  # type: ignore[operator]
    plain = results[0]
    for chunked in results[1:]:
        assert torch.allclose(chunked[0], plain[0], atol=1e-12), (chunked[0] - plain[0]).abs().max()
        assert torch.allclose(chunked[1], plain[1], atol=1e-12)
        for name, grad in plain[2].items():
            assert torch.allclose(chunked[2][name], grad, atol=1e-12), name


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensors created inside the mode that were alive at once (CPU: storages freed are swept)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _scoring_peak(plan: LossPlan | None, vocab: int, hidden: int, rows: dict[str, torch.Tensor]) -> int:
    model = _model(vocab, hidden, 1, torch.float32)
    meter = _LiveBytes()
    with meter:
        logps, _ = token_logps_and_entropy(
            model, rows["input_ids"], rows["attention_mask"], rows["completion_mask"], 0.9, plan, entropy=True
        )
        (logps * rows["completion_mask"]).sum().backward()
        del logps
    return meter.peak


def test_the_scoring_pass_peak_shrinks_by_the_expected_factor() -> None:
    """16 rows x 64 completion tokens over a 16k vocabulary (hidden 64): the plain path holds the fp32 logits and
    their log-softmax ([tokens x vocab] each, 2 x 64 MiB) at its peak; the chunked one a few [chunk x vocab]
    blocks, the head's gradient and the hidden rows."""
    vocab, hidden, chunk = 16384, 64, 128
    rows = _rows(vocab, batch=16, prompt=8, width=64)
    rows["completion_mask"][:] = (
        1  # every completion position scored: the plain path's worst case is the usual one
    )
    rows["attention_mask"][:] = 1
    tokens = 16 * 64
    plain = _scoring_peak(None, vocab, hidden, rows)
    chunked = _scoring_peak(LossPlan(chunk_tokens=chunk), vocab, hidden, rows)
    block, head = chunk * vocab * 4, vocab * hidden * 4
    assert plain >= 2 * tokens * vocab * 4, plain  # the logits and their log-softmax, at least
    bound = 4 * block + 3 * head + 64 * tokens * hidden * 4  # blocks, head (+grad, accumulator), activations
    assert chunked <= bound, (chunked, bound)
    expected = (
        2 * tokens * vocab * 4 / bound
    )  # 4.3x with these sizes; 16 rows x 1,536 tokens of a 152k vocab: more
    assert plain / chunked >= expected, (plain, chunked, expected)
