"""Unit tests for hf_fsdp2.train.loss and .chunked_ce: target counting, summed CE, global-token normalisation."""

from __future__ import annotations

import math

import pytest
import torch
from support.numerics import assert_same_maths

from hf_fsdp2.train.loss import IGNORE_INDEX, backward_scale, count_target_tokens, cross_entropy_sum

X = IGNORE_INDEX


def test_count_target_tokens_skips_first_position() -> None:
    labels = torch.tensor(
        [
            [5, 6, X, 7],  # shifted targets 6, 7 -> 2 (the 5 at position 0 never counts)
            [X, X, 8, X],  # shifted target 8 -> 1
        ]
    )
    assert count_target_tokens(labels) == 3
    assert isinstance(count_target_tokens(labels), int)


def test_count_target_tokens_first_position_only_is_zero() -> None:
    assert count_target_tokens(torch.tensor([[9, X, X]])) == 0
    assert count_target_tokens(torch.full((2, 5), X)) == 0
    assert count_target_tokens(torch.tensor([[1, 2, 3], [4, 5, 6]])) == 4


def log_softmax_by_hand(row: list[float], index: int) -> float:
    return row[index] - math.log(sum(math.exp(v) for v in row))


def test_cross_entropy_sum_matches_hand_computation() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [100.0, -7.0, 5.0]]
    logits = torch.tensor([rows])
    labels = torch.tensor([[X, 2, 0]])
    # position 0 predicts labels[1] = 2, position 1 predicts labels[2] = 0; position 2 predicts nothing.
    expected = -log_softmax_by_hand(rows[0], 2) - log_softmax_by_hand(rows[1], 0)
    assert expected == pytest.approx(math.log(math.e + math.e**2 + math.e**3) - 3 + math.log(3))
    loss = cross_entropy_sum(logits, labels)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_sum_ignores_masked_positions_and_last_logits() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 1.0, -2.0]]
    labels = torch.tensor([[7, X, 0]])  # only position 1 -> label 0 counts
    loss = cross_entropy_sum(torch.tensor([rows]), labels)
    assert loss.item() == pytest.approx(math.log(3), rel=1e-6)
    # The logits of a position whose target is -100, and of the last position, do not matter.
    changed = [[50.0, -50.0, 9.0], [0.0, 0.0, 0.0], [-30.0, 30.0, 0.0]]
    assert cross_entropy_sum(torch.tensor([changed]), labels).item() == pytest.approx(math.log(3), rel=1e-6)


def test_cross_entropy_sum_over_a_batch_adds_rows() -> None:
    rows_a = [[1.0, 2.0, 3.0], [0.5, 0.0, -0.5]]
    rows_b = [[0.0, 1.0, 0.0], [2.0, 2.0, 2.0]]
    logits = torch.tensor([rows_a, rows_b])
    labels = torch.tensor([[X, 1], [X, 1]])
    expected = -log_softmax_by_hand(rows_a[0], 1) - log_softmax_by_hand(rows_b[0], 1)
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_sum_without_targets_is_zero() -> None:
    loss = cross_entropy_sum(torch.randn(2, 4, 5), torch.full((2, 4), X))
    assert loss.item() == 0.0


def test_cross_entropy_sum_is_fp32_for_bf16_logits() -> None:
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
    loss = cross_entropy_sum(torch.tensor([rows], dtype=torch.bfloat16), torch.tensor([[X, 2]]))
    assert loss.dtype == torch.float32
    # 1, 2, 3 and 0 are exact in bf16, so the value is the fp32 one.
    assert loss.item() == pytest.approx(-log_softmax_by_hand(rows[0], 2), rel=1e-6)


def test_backward_scale() -> None:
    assert backward_scale(0, 4) == 0.0
    assert backward_scale(-3, 2) == 0.0
    assert backward_scale(10, 2) == pytest.approx(0.2)
    assert backward_scale(7, 1) == pytest.approx(1 / 7)


# ---------------------------------------------------------------------------------------------------
# The normalisation property: 2 simulated ranks x 2 micro-batches with unequal target counts
# ---------------------------------------------------------------------------------------------------

VOCAB = 5
WORLD = 2


def make_step() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[rank][micro_batch] -> (inputs [b, s, 3], labels [b, s])`` with very unequal target counts."""
    gen = torch.Generator().manual_seed(0)

    def labels(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows)

    label_sets = [
        [labels([[1, 2, 3, 4, 0, 1]]), labels([[X, X, X, X, X, 2]])],  # rank 0: 5 then 1 targets
        [labels([[X, 3, X, X, X, X], [X, X, 4, X, X, X]]), labels([[0, 1, 2, 3, 4, 0]])],  # rank 1: 2 then 5
    ]
    return [
        [(torch.randn(lab.shape[0], lab.shape[1], 3, generator=gen), lab) for lab in rank]
        for rank in label_sets
    ]


def per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Per-target-token CE, by log-softmax and indexing (independent of cross_entropy_sum)."""
    out = []
    logp = torch.log_softmax(logits.double(), dim=-1)
    for b in range(labels.shape[0]):
        for s in range(1, labels.shape[1]):
            target = int(labels[b, s])
            if target != X:
                out.append(-logp[b, s - 1, target])
    return out


def test_step_data_has_unequal_counts() -> None:
    counts = [[count_target_tokens(lab) for _, lab in rank] for rank in make_step()]
    assert counts == [[5, 1], [2, 5]]


def test_scaled_micro_batch_losses_give_the_global_token_mean() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(3, VOCAB)
    step = make_step()
    global_tokens = sum(count_target_tokens(lab) for rank in step for _, lab in rank)
    assert global_tokens == 13

    with torch.no_grad():
        all_tokens = [ce for rank in step for x, lab in rank for ce in per_token_ce(head(x), lab)]
        global_mean = torch.stack(all_tokens).mean().item()
        # What each rank accumulates, then FSDP's average over ranks.
        per_rank = [
            sum(cross_entropy_sum(head(x), lab) * backward_scale(global_tokens, WORLD) for x, lab in rank)
            for rank in step
        ]
        reported = (sum(per_rank) / WORLD).item()
        mean_of_means = (
            sum(
                (cross_entropy_sum(head(x), lab) / count_target_tokens(lab)).item()
                for rank in step
                for x, lab in rank
            )
            / 4
        )

    assert len(all_tokens) == 13
    assert reported == pytest.approx(global_mean, rel=1e-6)
    # The property is not vacuous: the mean of per-batch means is a different number for this data.
    assert abs(mean_of_means - global_mean) > 1e-3


def test_accumulated_gradient_equals_gradient_of_global_token_mean() -> None:
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, VOCAB).double()  # float64: the two sides sum in different orders
    step = [[(x.double(), lab) for x, lab in rank] for rank in make_step()]
    global_tokens = sum(count_target_tokens(lab) for rank in step for _, lab in rank)

    # Reference: one backward of the mean over every target token of the step.
    reference.zero_grad()
    all_tokens = [ce for rank in step for x, lab in rank for ce in per_token_ce(reference(x), lab)]
    torch.stack(all_tokens).mean().backward()
    expected = [p.grad.clone() for p in reference.parameters()]

    # Each simulated rank holds a replica, accumulates scaled micro-batch losses, then grads are averaged.
    rank_grads = []
    for rank in step:
        replica = torch.nn.Linear(3, VOCAB).double()
        replica.load_state_dict(reference.state_dict())
        for x, lab in rank:
            (cross_entropy_sum(replica(x), lab) * backward_scale(global_tokens, WORLD)).backward()
        rank_grads.append([p.grad.clone() for p in replica.parameters()])
    averaged = [(g0 + g1) / WORLD for g0, g1 in zip(*rank_grads, strict=True)]

    for got, want in zip(averaged, expected, strict=True):
        assert_same_maths(got, want, terms=global_tokens * VOCAB)
    assert any(g.abs().sum() > 0 for g in expected)

    # And it differs from the gradient of the mean of per-batch means.
    reference.zero_grad()
    mean_of_means = (
        sum(
            cross_entropy_sum(reference(x), lab) / count_target_tokens(lab)
            for rank in step
            for x, lab in rank
        )
        / 4
    )
    mean_of_means.backward()
    assert not torch.allclose(reference.weight.grad, expected[0], rtol=1e-3, atol=1e-5)


def test_step_without_targets_has_zero_gradient() -> None:
    head = torch.nn.Linear(3, VOCAB)
    labels = torch.full((1, 4), X)
    loss = cross_entropy_sum(head(torch.randn(1, 4, 3)), labels) * backward_scale(
        count_target_tokens(labels), WORLD
    )
    loss.backward()
    assert loss.item() == 0.0
    assert head.weight.grad is not None and head.weight.grad.abs().sum().item() == 0.0


# ---- chunked cross entropy over the output head -------------------------------------------------

import pytest as _pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hf_fsdp2.train.chunked_ce import chunked_linear_cross_entropy_sum  # noqa: E402
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss_sum  # noqa: E402


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_linear_ce_equals_plain_loss_and_gradients() -> None:
    # float64: the two paths sum in different orders, so only the float64 rounding bound is CPU-independent.
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=gen)
    targets[::4] = IGNORE_INDEX
    plain = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    gh, gw = torch.autograd.grad(plain * 0.7, (hidden, weight))
    chunked = chunked_linear_cross_entropy_sum(hidden, weight, targets, 8)
    ch, cw = torch.autograd.grad(chunked * 0.7, (hidden, weight))
    assert chunked.dtype == torch.float64  # accumulated in the inputs' dtype when it is wider than fp32
    assert_same_maths(chunked, plain, terms=37 * 50, name="loss")
    assert_same_maths(ch, gh, terms=50, name="grad hidden")
    assert_same_maths(cw, gw, terms=37, name="grad weight")
    # And the bound is not vacuous: a target moved by one changes the loss far beyond it.
    wrong = targets.clone()
    wrong[1] = (wrong[1] + 1) % 50
    with _pytest.raises(AssertionError, match="not the same maths"):
        assert_same_maths(chunked_linear_cross_entropy_sum(hidden, weight, wrong, 8), plain, terms=37 * 50)


def test_chunked_linear_ce_keeps_fp32_accumulation_for_fp32_and_bf16() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=gen)
    weight = torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (9,), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        loss = chunked_linear_cross_entropy_sum(hidden.to(dtype), weight.to(dtype), targets, 4)
        assert loss.dtype == torch.float32


@_pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_causal_lm_loss_chunked_equals_plain_and_never_builds_full_logits(tmp_path, tie: bool) -> None:
    from support.tiny import make_tiny_llama_dir
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama_dir(tmp_path / "m", tie_word_embeddings=tie))
    # float64: chunked and plain sum in different orders; the float64 rounding bound holds on every CPU.
    model = model.double()
    # 4 x 40 tokens: more rows than the hidden size, so full logits outgrow the weight-sized gradient.
    ids = torch.randint(3, 1000, (4, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    labels[0, -5:] = IGNORE_INDEX
    inputs = {"input_ids": ids, "attention_mask": mask}
    results = []
    for chunk in (0, 7):
        model.zero_grad()
        spy = _LargestTensor()
        with spy:
            loss = causal_lm_loss_sum(model, inputs, labels, LossPlan(chunk))
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, spy.largest))
    (plain, g_plain, big_plain), (chunked, g_chunked, big_chunked) = results
    vocab = model.config.vocab_size
    # The longest reduction is over the vocabulary (the hidden states' gradient through the head).
    assert_same_maths(chunked, plain, terms=vocab, name="loss")
    for name in g_plain:
        assert_same_maths(g_chunked[name], g_plain[name], terms=vocab, name=name)
    # The plain path builds [4 x 40 x vocab] logits; the chunked one at most a [7 x vocab] block (or the
    # vocab x hidden weight-sized gradient).
    assert big_plain >= 4 * 39 * vocab
    assert big_chunked <= max(7 * vocab, vocab * model.config.hidden_size)
    assert big_chunked < 4 * 39 * vocab


def test_the_loss_path_never_depends_on_the_batch(tmp_path) -> None:
    """A batch smaller than a chunk takes the chunked path too: ranks with small and large batches must run
    the same graph, or their FSDP2 collectives stop matching (the untied-head deadlock)."""
    from support.tiny import make_tiny_llama_dir
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama_dir(tmp_path / "m")).double()
    ids = torch.randint(3, 1000, (1, 8))
    head_inputs: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, a, o: head_inputs.append(tuple(a[0].shape))
    )
    small = causal_lm_loss_sum(model, {"input_ids": ids}, ids, LossPlan(64))  # 8 tokens, chunks of 64
    plain = causal_lm_loss_sum(model, {"input_ids": ids}, ids, LossPlan(0))
    hook.remove()
    assert head_inputs == [(1, 1, 64), (1, 8, 64)]  # chunked: the head itself ran on one position
    assert_same_maths(small, plain, terms=model.config.vocab_size, name="loss")


# ---- the model's logit post-processing inside the chunked loss; the loss plan ---------------------

from hf_fsdp2.train.chunked_ce import LogitTransform  # noqa: E402
from hf_fsdp2.train.loss import logit_transform_for, plan_loss  # noqa: E402


@_pytest.mark.parametrize(
    "transform",
    [LogitTransform(softcap=3.0), LogitTransform(scale=0.25), LogitTransform(scale=2.0, softcap=5.0)],
)
def test_chunked_loss_applies_the_heads_post_processing(transform: LogitTransform) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 16, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 50, (29,), generator=gen)
    targets[::5] = IGNORE_INDEX
    logits = transform.apply(hidden @ weight.t())
    plain = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    gh, gw = torch.autograd.grad(plain, (hidden, weight))
    chunked = chunked_linear_cross_entropy_sum(hidden, weight, targets, 8, transform)
    ch, cw = torch.autograd.grad(chunked, (hidden, weight))
    assert_same_maths(chunked, plain, terms=29 * 50, name="loss")
    assert_same_maths(ch, gh, terms=50, name="grad hidden")
    assert_same_maths(cw, gw, terms=29, name="grad weight")
    # Without the transform the loss is another number: the chunked path must know the head's transform.
    untransformed = chunked_linear_cross_entropy_sum(hidden, weight, targets, 8)
    assert abs(float(untransformed - plain)) > 1e-3 * abs(float(plain))


def test_logit_transform_from_family_configs() -> None:
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

    assert logit_transform_for(Gemma2Config()) == LogitTransform(softcap=30.0)
    assert logit_transform_for(GraniteConfig(logits_scaling=8.0)) == LogitTransform(scale=0.125)
    assert logit_transform_for(CohereConfig(logit_scale=0.0625)) == LogitTransform(scale=0.0625)
    assert logit_transform_for(LlamaConfig()) == LogitTransform()


class _DoublingLlama(__import__("transformers").LlamaForCausalLM):
    """A head post-processing that no config declares: the probe must notice it."""

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_plan_loss_probes_the_head_and_falls_back_for_unknown_post_processing(tmp_path) -> None:
    from support.tiny import make_tiny_llama_dir
    from transformers import AutoModelForCausalLM

    path = make_tiny_llama_dir(tmp_path / "m")
    plain_model = AutoModelForCausalLM.from_pretrained(path)
    plan = plan_loss(plain_model, 64)
    assert plan.chunk_tokens == 64 and "chunked cross entropy" in plan.notes[-1]
    doubling = _DoublingLlama.from_pretrained(path).train()
    plan = plan_loss(doubling, 64)
    assert plan.chunk_tokens == 0
    assert "not the head's output after the known post-processing" in plan.notes[-1]
    assert doubling.training  # the probe leaves the mode as it was
    assert plan_loss(plain_model, 0).notes[-1] == "loss on the full logits (ce_chunk_tokens=0)"


# ---- bf16 operands in the chunked loss's GEMMs -----------------------------------

# Matrix products as the dispatcher sees them (``@``/matmul arrive as mm or bmm), with their operands' positions.
_aten = torch.ops.aten
_GEMM_OPERANDS = {
    _aten.mm: slice(0, 2),
    _aten.bmm: slice(0, 2),
    _aten.addmm: slice(1, 3),  # the first argument is the addend
    _aten.addmm_: slice(1, 3),
    _aten.baddbmm: slice(1, 3),
    _aten.baddbmm_: slice(1, 3),
}


class _GemmOperands(TorchDispatchMode):
    """Records the operand dtypes of every matrix product, and every op that turns the head weight into fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight_storage = weight.untyped_storage().data_ptr()
        self.gemms: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.weight_upcasts: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        operands = _GEMM_OPERANDS.get(func.overloadpacket)
        if operands is not None:
            self.gemms.append((str(func), tuple(t.dtype for t in args[operands])))
        reads_weight = any(t.untyped_storage().data_ptr() == self.weight_storage for t in tensors)
        if reads_weight and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.weight_upcasts.append(str(func))
        return out


@_pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(softcap=3.0)], ids=["plain", "softcap"]
)
def test_chunked_loss_multiplies_bf16_operands_and_never_upcasts_the_head(transform: LogitTransform) -> None:
    """With bf16 hidden states and head, every GEMM of the chunked loss (logits, both gradients) takes bf16
    operands, so a GPU runs it at its bf16 rate with fp32 accumulation inside the kernel; fp32 GEMMs run at a
    fraction of that rate (TF32 is off by default) and an fp32 copy of a 128k x 4096 head is 2.1 GB."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(96, 32, generator=gen) / 32**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, 96, (40,), generator=gen)
    spy = _GemmOperands(weight)
    with spy:
        loss = chunked_linear_cross_entropy_sum(hidden, weight, targets, 16, transform)
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32  # the loss itself is still accumulated in fp32
    assert gh.dtype == gw.dtype == torch.bfloat16
    # 3 chunks (16 + 16 + 8 rows), three GEMMs each: logits, gradient of the hidden states, of the head.
    assert len(spy.gemms) == 9, spy.gemms
    fp32 = [(op, dtypes) for op, dtypes in spy.gemms if torch.bfloat16 not in dtypes or len(set(dtypes)) > 1]
    assert not fp32, f"GEMMs with non-bf16 operands: {fp32}"
    assert not spy.weight_upcasts, f"the head weight was turned into fp32 by {spy.weight_upcasts}"


def test_chunked_loss_keeps_fp32_gemms_for_fp32_inputs() -> None:
    """fp32 inputs are multiplied in fp32 as before: nothing is rounded to a narrower dtype."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=gen).requires_grad_()
    weight = torch.randn(96, 32, generator=gen).requires_grad_()
    targets = torch.randint(0, 96, (40,), generator=gen)
    spy = _GemmOperands(weight)
    with spy:
        loss = chunked_linear_cross_entropy_sum(hidden, weight, targets, 16)
        torch.autograd.grad(loss, (hidden, weight))
    assert len(spy.gemms) == 9 and all(dtypes == (torch.float32,) * 2 for _, dtypes in spy.gemms), spy.gemms


def _bf16_rounding_bounds(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, transform: LogitTransform
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Bounds on |chunked - plain| for the loss and, componentwise, the gradients of the hidden states and the head.

    Both paths take bf16 GEMM operands with fp32 accumulation; they differ by where they round to bf16. With
    ``x = scale * hidden @ weight.T``, ``z = transform(x)``, ``p = softmax(z)``, ``y`` the one-hot targets,
    ``u = 2**-8`` (bf16's unit roundoff) and ``X`` the row's largest ``|x|``, to first order:

    - logits: the plain path rounds the GEMM output, then each op of the transform in bf16 (scale, /cap,
      tanh, *cap): each moves ``z`` by at most ``u * |x|`` (the tanh derivative is <= 1); the chunked path rounds
      the GEMM output once and transforms in fp32. So ``|dz| <= 6 u X``, a row's loss (log-sum-exp minus the
      target's logit) moves by at most ``2 * 6 u X`` and ``|dp_k| <= 2 p_k max|dz| = 12 u p_k X``.
    - the gradient of the logits ``g = (p - y) * transform'``: the plain path rounds ``p - y`` to bf16, then each
      backward op of the transform (cap, tanh, /cap, scale: 4), and its ``1 - tanh^2`` is off by at most
      ``4 u`` (absolute; ``2 |t| |dt|`` with ``|v| sech(v)^2 tanh(v) <= 1/3``); the chunked path rounds ``g`` once.
      With ``|g| <= scale * (p + y)``: ``|dg| <= scale * u * (10 (p + y) + 12 p X)``.
    - each gradient is a GEMM over ``g`` (exact products, fp32 sums: ``2 n u32`` of the magnitudes), rounded to
      bf16 once on each side; the chunked head gradient also rounds each chunk's product to bf16 before adding
      it to its fp32 accumulator (``u`` of the magnitude once more).

    The first-order bounds are doubled to cover second-order terms (products of two roundings).

    Returns:
        ``(loss bound, d hidden bound, d weight bound)``, the tensors in float64.
    """
    u, u32 = 2.0**-8, 2.0**-24
    h, w = hidden.detach().double(), weight.detach().double()
    x = (h @ w.t()) * transform.scale
    z = torch.tanh(x / transform.softcap) * transform.softcap if transform.softcap else x
    has = (targets != IGNORE_INDEX).double()[:, None]
    p = torch.softmax(z, dim=-1) * has
    y = F.one_hot(targets.clamp(min=0), z.size(1)).double() * has
    big_x = x.abs().amax(dim=1, keepdim=True)
    scale = abs(transform.scale)
    d_g = scale * u * (10 * (p + y) + 12 * p * big_x)
    mag_g = scale * (p + y)
    mag_h, mag_w = mag_g @ w.abs(), mag_g.t() @ h.abs()
    rows, vocab = z.shape
    bound_loss = float((12 * u * big_x * has).sum())
    bound_h = d_g @ w.abs() + (2 * u + 2 * vocab * u32) * mag_h
    bound_w = d_g.t() @ h.abs() + (3 * u + 2 * rows * u32) * mag_w
    return 2 * bound_loss, 2 * bound_h, 2 * bound_w


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """The largest ``|got - want| / bound`` (<= 1: within the bound)."""
    diff = (got.double() - want.double()).abs()
    return float((diff / bound.clamp(min=torch.finfo(torch.float64).tiny)).max())


@_pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@_pytest.mark.parametrize(
    "transform",
    [LogitTransform(), LogitTransform(softcap=3.0), LogitTransform(scale=0.5, softcap=2.0)],
    ids=["none", "softcap", "scale+softcap"],
)
def test_bf16_chunked_loss_gradients_equal_the_plain_bf16_path(tie: bool, transform: LogitTransform) -> None:
    """bf16 inputs: the chunked loss and its gradients are the plain path's (full bf16 logits, the model's
    transform in bf16 as Gemma-2 applies its softcap, F.cross_entropy in fp32) within the bound bf16 rounding of
    either path explains (:func:`_bf16_rounding_bounds`). Tied: the head is also the embedding table the hidden
    states come from, so its gradient adds both."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab, dim = 40, 96, 32
    table = (torch.randn(vocab, dim, generator=gen) * 2 / dim**0.5).bfloat16()
    noise = torch.randn(rows, dim, generator=gen).bfloat16()
    ids = torch.randperm(vocab, generator=gen)[:rows]  # distinct rows: the embedding's backward adds nothing
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::7] = IGNORE_INDEX

    def run(
        chunked: bool, targets: torch.Tensor = targets
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = table.clone().requires_grad_()
        hidden = weight.index_select(0, ids) + noise if tie else noise.clone().requires_grad_()
        hidden.retain_grad()
        if chunked:
            loss = chunked_linear_cross_entropy_sum(hidden, weight, targets, 16, transform)
        else:
            logits = transform.apply(hidden @ weight.t())
            loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        assert hidden.grad is not None and weight.grad is not None
        return loss.detach(), hidden.grad, weight.grad

    (loss_p, gh_p, gw_p), (loss_c, gh_c, gw_c) = run(chunked=False), run(chunked=True)
    assert gh_c.dtype == gw_c.dtype == torch.bfloat16
    hidden = table.index_select(0, ids) + noise if tie else noise
    bound_loss, bound_h, bound_w = _bf16_rounding_bounds(hidden, table, targets, transform)
    if (
        tie
    ):  # + the hidden states' gradient scattered to their rows, added to the head's in bf16 on both sides
        bound_w = bound_w + torch.zeros_like(bound_w).index_add_(0, ids, bound_h)
        bound_w = bound_w + 2.0**-8 * (gw_p.double().abs() + gw_c.double().abs())
    assert abs(float(loss_c - loss_p)) <= bound_loss
    assert _within(gh_c, gh_p, bound_h) <= 1.0, "grad hidden beyond its rounding bound"
    assert _within(gw_c, gw_p, bound_w) <= 1.0, "grad weight beyond its rounding bound"
    # The bounds are not vacuous: one target off, or the transform left out, moves the gradients beyond them.
    wrong = targets.clone()
    wrong[1] = (wrong[1] + 1) % vocab
    _, gh_wrong, gw_wrong = run(chunked=True, targets=wrong)
    assert _within(gh_wrong, gh_p, bound_h) > 1.0 and _within(gw_wrong, gw_p, bound_w) > 1.0
    if transform != LogitTransform():
        h, w = hidden.clone().requires_grad_(), table.clone().requires_grad_()
        chunked_linear_cross_entropy_sum(h, w, targets, 16).backward()
        assert _within(h.grad, gh_p, bound_h) > 1.0 and _within(w.grad, gw_p, bound_w) > 1.0


# ---- the head gradient accumulates in fp32 inside the GEMM where torch can -------------------


def test_fp32_accumulating_addmm_is_feature_tested() -> None:
    """torch 2.13 has ``addmm(..., out_dtype=float32)`` for bf16 on CUDA only: CPU takes the bf16-product path."""
    from hf_fsdp2.train import chunked_ce

    assert chunked_ce.fp32_accumulating_addmm("cpu", torch.bfloat16) is False
    if torch.cuda.is_available():  # the GPU check runs this line
        assert chunked_ce.fp32_accumulating_addmm("cuda", torch.bfloat16) is True


def test_bf16_head_gradient_uses_the_fp32_accumulating_gemm_where_available(monkeypatch) -> None:
    """Where the op exists, every chunk's head gradient goes through it (no bf16 [vocab x hidden] product), and
    the gradient stays within the bf16 bound of the plain path. The CUDA kernel is replaced by what it computes
    (bf16 operands, exact products, fp32 sums into the fp32 accumulator), since CPU torch lacks it."""
    from hf_fsdp2.train import chunked_ce

    calls: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def on_cpu(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        calls.append((acc.dtype, a.dtype, b.dtype))
        acc.addmm_(a.float(), b.float())

    monkeypatch.setattr(chunked_ce, "fp32_accumulating_addmm", lambda device_type, operand: True)
    monkeypatch.setattr(chunked_ce, "_addmm_into_fp32", on_cpu)
    gen = torch.Generator().manual_seed(1)
    rows, vocab, dim = 40, 96, 32
    hidden = torch.randn(rows, dim, generator=gen).bfloat16()
    table = (torch.randn(vocab, dim, generator=gen) * 2 / dim**0.5).bfloat16()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::5] = IGNORE_INDEX
    weight = table.clone().requires_grad_()
    chunked_linear_cross_entropy_sum(hidden, weight, targets, 16).backward()
    assert calls == [(torch.float32, torch.bfloat16, torch.bfloat16)] * 2  # 32 target rows, chunks of 16
    plain_w = table.clone().requires_grad_()
    F.cross_entropy(
        (hidden @ plain_w.t()).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
    ).backward()
    _, _, bound_w = _bf16_rounding_bounds(hidden, table, targets, LogitTransform())
    assert weight.grad is not None and plain_w.grad is not None
    assert _within(weight.grad, plain_w.grad, bound_w) <= 1.0
