"""GRPO's arithmetic against TRL 1.16's ``GRPOTrainer`` and a plain per-token loop written from the papers: given
fixed prompts, completions (of different lengths), rewards, old and reference log-probs, the advantages, the loss
and the gradients of every ``loss_type`` equal TRL's own ``_compute_loss`` (rel 1e-4, fp32), and the micro-batch
sums add up to the whole batch's loss however the batch is split."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.methods.grpo.loss import (
    GrpoSettings,
    completion_token_logps,
    group_advantages,
    grpo_loss,
    grpo_loss_sums,
)

TEMPERATURE, MAX_COMPLETION = 0.7, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its output head scaled 8x: a random head's next-token distributions are all near uniform
    (entropies within 0.003 of ln 2098, 1e-6 apart), so which tokens a top-entropy quantile keeps would turn on
    rounding; scaled, the batch's entropies lie 1e-3 or more apart."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama_dir(tmp_path_factory.mktemp("grpo") / "model", seed=11)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def _batch(tokenizer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """4 completions (2 prompts x 2 generations), left-padded prompts, right-padded completions of lengths 6, 3,
    1 and 5 (the mask covers each completion up to its end)."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 200, (4, 5), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[2:, :2], prompt_mask[2:, :2] = tokenizer.pad_token_id, 0  # the second prompt is shorter
    completion_ids = torch.randint(3, 200, (4, MAX_COMPLETION), generator=g)
    completion_mask = torch.zeros_like(completion_ids)
    for row, length in enumerate((6, 3, 1, 5)):
        completion_mask[row, :length] = 1
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def _trl_advantages(rewards: torch.Tensor, n: int, scale: str) -> torch.Tensor:
    """TRL 1.16's ``sum_then_normalize`` branch of ``_generate_and_score_completions``, as it is written there."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    std = (
        nanstd(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
        if scale != "batch"
        else nanstd(rewards)
    )
    advantages = rewards - mean
    return advantages / (std + 1e-4) if scale != "none" else advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_and_an_equal_group_has_none(scale: str) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0])  # the middle group: all equal
    settings = GrpoSettings(num_generations=2, scale_rewards=scale)
    advantages, flat = group_advantages(rewards, settings)
    assert torch.allclose(advantages, _trl_advantages(rewards, 2, scale), rtol=1e-6, atol=1e-7)
    assert advantages[2] == 0 and advantages[3] == 0
    if scale != "batch":
        assert flat.tolist() == [False, False, True, True, False, False]
    with pytest.raises(ValueError, match="scale_rewards='mean' is not one of"):
        GrpoSettings(scale_rewards="mean")
    with pytest.raises(ValueError, match="num_generations=1 must be >= 2"):
        GrpoSettings(num_generations=1)


def _plain_loss(logps, old, ref, advantages, mask, settings: GrpoSettings) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The papers' formula token by token, in Python loops."""
    rows, total_tokens, per_row = [], 0.0, []
    for b in range(logps.shape[0]):
        terms = []
        for t in range(logps.shape[1]):
            if not mask[b, t]:
                continue
            ratio = torch.exp(logps[b, t] - old[b, t])
            clip = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.high)
            term = -torch.min(ratio * advantages[b], clip * advantages[b])
            if settings.beta:
                d = ref[b, t] - logps[b, t]
                term = term + settings.beta * ratio * (torch.exp(d) - d - 1)
            terms.append(term)
        total_tokens += len(terms)
        rows.append(sum(terms))
        per_row.append(sum(terms) / max(len(terms), 1))
    if settings.loss_type == "grpo":
        return sum(per_row) / len(per_row)
    if settings.loss_type == "dr_grpo":
        return sum(rows) / (len(rows) * settings.max_completion_length)
    return sum(rows) / total_tokens


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_loss_and_gradients_equal_trls_grpo_trainer_and_the_plain_loop(
    model_dir: Path, loss_type: str, beta: float
):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = _batch(tokenizer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"]
    settings = GrpoSettings(
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=MAX_COMPLETION,
        num_generations=2,
    )
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.2, 0.9]), settings)
    g = torch.Generator().manual_seed(1)
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # the sampler's log-probs (a later iteration over the batch) and the reference's
        current = completion_token_logps(ours, ids, attention, MAX_COMPLETION, TEMPERATURE)
        old = current + 0.3 * torch.randn(current.shape, generator=g)  # some ratios clip
        ref = current + 0.2 * torch.randn(current.shape, generator=g)
    logps = completion_token_logps(ours, ids, attention, MAX_COMPLETION, TEMPERATURE)
    mine = grpo_loss(logps, old, ref if beta else None, advantages, mask, settings)
    mine.backward()
    plain = _plain_loss(logps.detach(), old, ref, advantages, mask, settings)
    assert math.isclose(float(mine), float(plain), rel_tol=1e-5), (float(mine), float(plain))
    with tempfile.TemporaryDirectory() as tmp:
        data = datasets.Dataset.from_list([{"prompt": "a b"}] * 4)
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=MAX_COMPLETION,
            loss_type=loss_type,
            beta=beta,
            epsilon=0.2,
            epsilon_high=0.28,
            temperature=TEMPERATURE,
            report_to="none",
        )
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = 1
        inputs = {
            **batch,
            "advantages": advantages,
            "old_per_token_logps": old,
            "num_items_in_batch": mask.sum().float(),
        }
        if beta:
            inputs["ref_per_token_logps"] = ref
        trainer.model.train()
        theirs = trainer._compute_loss(trainer.model, inputs)
        theirs.backward()
        assert math.isclose(float(mine), float(theirs), rel_tol=1e-4), (float(mine), float(theirs))
        grads = dict(trainer.model.named_parameters())
        worst = max(
            float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max().clamp(min=1e-12))
            for name, p in ours.named_parameters()
        )
        assert worst < 1e-4, worst
        clipped = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    sums = grpo_loss_sums(logps.detach(), old, ref if beta else None, advantages, mask, settings)
    region = float((sums.clipped_low + sums.clipped_high) / sums.tokens)
    assert math.isclose(region, clipped, rel_tol=1e-6, abs_tol=1e-9) and region > 0, (region, clipped)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_sums_add_up_to_the_whole_batch(loss_type: str) -> None:
    g = torch.Generator().manual_seed(2)
    logps, old = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g)
    mask = torch.ones(6, 5, dtype=torch.long)
    for row, length in enumerate((5, 2, 4, 1, 3, 5)):
        mask[row, length:] = 0
    settings = GrpoSettings(loss_type=loss_type, num_generations=3, max_completion_length=5)
    advantages, _ = group_advantages(torch.rand(6, generator=g), settings)
    whole = grpo_loss(logps, old, None, advantages, mask, settings)
    parts = [
        grpo_loss_sums(logps[s], old[s], None, advantages[s], mask[s], settings)
        for s in (slice(0, 2), slice(2, 6))
    ]
    split = sum(p.loss for p in parts) / sum(p.count for p in parts)
    assert torch.allclose(whole, split, rtol=1e-6), (whole, split)


def _roll(rewards: torch.Tensor, per_function: torch.Tensor, settings: GrpoSettings):  # type: ignore[no-untyped-def]
    from hf_fsdp2.methods.grpo.step import Rollout

    advantages, zero_std = group_advantages(rewards, settings)
    return Rollout(
        rows=[],
        rewards=rewards,
        per_function=per_function,
        advantages=advantages,
        zero_std=zero_std,
        lengths=[],
        completions=[],
        prompts=[],
    )


def test_a_step_without_a_learning_signal_is_counted_and_named() -> None:
    """The counts a step is decided from (summed over the ranks by the step's one read): completions with a
    non-zero advantage, completions, rewarded ones, each function's scored ones; the message names the cause and the
    reward functions."""
    from hf_fsdp2.methods.grpo.rewards import RewardFunction, combine
    from hf_fsdp2.methods.grpo.step import no_signal_fix, no_signal_message, signal_counts

    settings = GrpoSettings(num_generations=4)
    functions = [
        RewardFunction("mine:always_none", lambda **kw: [], 1.0),
        RewardFunction("format", lambda **kw: []),
    ]
    nothing = torch.full((8, 2), math.nan)
    counts = signal_counts(_roll(combine(nothing, functions), nothing, settings))
    assert counts == [0, 8, 0, 0, 0]
    message = no_signal_message(counts, [f.name for f in functions], 4, 7)
    assert message.startswith("no usable reward: every reward function returned None for every completion")
    assert "(at step 7: 'mine:always_none' scored 0 of 8, 'format' scored 0 of 8)" in message
    assert "return a float for the completions it can score" in no_signal_fix(counts)
    # Every group flat (one function scoring all, the other none): no advantage either.
    flat = torch.stack([torch.tensor([0.5] * 4 + [1.0] * 4), torch.full((8,), math.nan)], dim=1)
    counts = signal_counts(_roll(combine(flat, functions), flat, settings))
    assert counts == [0, 8, 8, 8, 0]
    message = no_signal_message(counts, [f.name for f in functions], 4, 7)
    assert "within every group of 4 completions of a prompt the reward was the same (zero variance" in message
    assert "8 of 8 completions rewarded; 'mine:always_none' scored 8 of 8, 'format' scored 0 of 8" in message
    assert "raise num_generations or temperature" in no_signal_fix(counts)
    # One group with a spread: a learning signal.
    spread = flat.clone()
    spread[1, 0] = 0.0
    assert signal_counts(_roll(combine(spread, functions), spread, settings))[0] == 4


def test_the_guard_stops_or_warns_after_three_steps_without_a_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """stop: CollapseError at the third silent step in a row (a step with a signal starts the count again), the
    last good checkpoint named; warn: one warning, one finding reported, and the zero gradients of the silent steps
    are not taken for a collapse (the reward is the cause, not the learning rate)."""
    from hf_fsdp2.train.nonfinite import NO_SIGNAL, CollapseError, NonFiniteGuard

    guard = NonFiniteGuard("stop", last_good=lambda: "CKPT. ")
    for step, silent in ((1, True), (2, True), (3, False), (4, True), (5, True)):
        guard.no_signal(step, silent, lambda: "no usable reward: X", "FIX")
    with pytest.raises(
        CollapseError,
        match=r"no learning signal for 3 steps in a row \(steps 4..6\): no usable "
        r"reward: X; the run stopped at step 6 and exports nothing\. CKPT\. FIX\. on_collapse: warn",
    ):
        guard.no_signal(6, True, lambda: "no usable reward: X", "FIX")

    reported = []
    guard = NonFiniteGuard("stop", on_collapse="warn", report=reported.append)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with caplog.at_level("WARNING", logger="hf_fsdp2"):
        for step in range(1, 7):
            guard.no_signal(step, True, lambda: "no usable reward: X", "FIX")
            guard.before_update(optimizer, torch.zeros(()), torch.zeros(()), target_tokens=8)  # gradient 0
            guard.settle_now()
    assert [(f.kind, f.action, f.first_step, f.step) for f in reported] == [(NO_SIGNAL, "warned", 1, 3)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "on_collapse is warn" in warnings[0] and "COLLAPSE" not in warnings[0], (
        warnings
    )


@pytest.mark.parametrize(
    ("loss_type", "level", "quantile", "beta"),
    [
        ("bnpo", "token", 1.0, 0.0),
        ("grpo", "sequence", 1.0, 0.04),
        ("dapo", "sequence", 1.0, 0.0),
        ("dapo", "token", 0.5, 0.04),
        ("bnpo", "token", 0.2, 0.0),
        ("dr_grpo", "sequence", 0.5, 0.0),
    ],
)
def test_bnpo_gspo_and_the_entropy_mask_equal_trls_compute_loss(
    model_dir: Path, loss_type: str, level: str, quantile: float, beta: float
) -> None:
    """loss_type bnpo, importance_sampling_level sequence (GSPO) and top_entropy_quantile (TRL's
    get_high_entropy_mask over the micro-batch's completion tokens): loss, gradients and the entropy and clip-ratio
    metrics equal TRL 1.16's ``_compute_loss`` fed the same tensors (completions of lengths 6, 3, 1, 5)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hf_fsdp2.methods.grpo.loss import high_entropy_mask, token_logps_and_entropy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = _batch(tokenizer)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"]
    settings = GrpoSettings(
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        importance_sampling_level=level,
    )
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.2, 0.9]), settings)
    g = torch.Generator().manual_seed(3)
    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        current = completion_token_logps(ours, ids, attention, MAX_COMPLETION, TEMPERATURE)
        old = current + 0.3 * torch.randn(current.shape, generator=g)
        ref = current + 0.2 * torch.randn(current.shape, generator=g)
    logps, entropies = token_logps_and_entropy(ours, ids, attention, mask, TEMPERATURE, entropy=True)
    assert entropies is not None
    keep = high_entropy_mask(entropies, mask, 1 - quantile) if quantile < 1 else None
    sums = grpo_loss_sums(
        logps, old, ref if beta else None, advantages, mask, settings, entropy_mask=keep, entropies=entropies
    )
    mine = sums.loss / sums.count
    mine.backward()
    with tempfile.TemporaryDirectory() as tmp:
        data = datasets.Dataset.from_list([{"prompt": "a b"}] * 4)
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            num_generations=2,
            per_device_train_batch_size=4,
            max_completion_length=MAX_COMPLETION,
            loss_type=loss_type,
            beta=beta,
            epsilon=0.2,
            epsilon_high=0.28,
            temperature=TEMPERATURE,
            report_to="none",
            importance_sampling_level=level,
            top_entropy_quantile=quantile,
        )
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
        )
        trainer.current_gradient_accumulation_steps = 1
        inputs = {
            **batch,
            "advantages": advantages,
            "old_per_token_logps": old,
            "num_items_in_batch": mask.sum().float(),
        }
        if beta:
            inputs["ref_per_token_logps"] = ref
        trainer.model.train()
        theirs = trainer._compute_loss(trainer.model, inputs)
        theirs.backward()
        assert math.isclose(float(mine), float(theirs), rel_tol=1e-4, abs_tol=1e-7), (
            float(mine),
            float(theirs),
        )
        grads = dict(trainer.model.named_parameters())
        worst = max(
            float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max().clamp(min=1e-12))
            for name, p in ours.named_parameters()
        )
        assert worst < 1e-4, worst
        metrics = trainer._metrics["train"]
        entropy = float(sums.entropy / sums.tokens)
        assert math.isclose(entropy, metrics["entropy"][-1], rel_tol=1e-5), (entropy, metrics["entropy"][-1])
        region = float((sums.clipped_low + sums.clipped_high) / sums.clip_count)
        assert math.isclose(region, metrics["clip_ratio/region_mean"][-1], rel_tol=1e-6, abs_tol=1e-9)
        if keep is not None:  # TRL's own mask of the same entropies (one process: its gather is the identity)
            assert torch.equal(keep, trainer.get_high_entropy_mask(entropies, mask, 1 - quantile))
            assert 0 < int(keep.sum()) < int(mask.sum())


def test_truncated_completions_leave_the_loss_as_trls_mask_says() -> None:
    """mask_truncated_completions: a completion whose last token is not an end token (nor the pad id: TRL's
    ``eos_and_pad``) keeps its tokens in the rows but not in the loss mask, as TRL's ``completion_mask * ~is_truncated``;
    dapo's normaliser counts the loss tokens of every rank."""
    from hf_fsdp2.methods.grpo.batching import generation_layout
    from hf_fsdp2.methods.grpo.rewards import RewardFunction
    from hf_fsdp2.methods.grpo.step import GrpoStepSettings, rollout

    eos, pad = 2, 0
    outputs = [[5, 6, eos], [7, 8, 9], [4, pad], [3]]

    class Fixed:  # the completions in order, over the generate calls (rollout_batch_size 3: calls of 3 and 1)
        eos_ids = [eos]
        device = torch.device("cpu")
        calls: list[int] = []

        def generate(self, prompts, *, seed, greedy=False):  # type: ignore[no-untyped-def]
            done = sum(self.calls)
            self.calls.append(len(prompts))
            return [list(o) for o in outputs[done : done + len(prompts)]]

    class Tok:
        pad_token_id = pad

        def batch_decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            return [" ".join(map(str, i)) for i in ids]

    layout = generation_layout(
        per_device=2,
        ranks=1,
        gradient_accumulation_steps=2,
        num_generations=2,
        num_iterations=1,
        generation_batch_size=None,
        steps_per_generation=None,
        rollout_batch_size=3,
    )
    assert layout.rollout_chunks == 2 and layout.prompts == 2
    settings = GrpoStepSettings(
        grpo=GrpoSettings(num_generations=2),
        temperature=1.0,
        num_iterations=1,
        seed=0,
        layout=layout,
        mask_truncated_completions=True,
    )
    function = RewardFunction("len", lambda completions, **kw: [float(len(c)) for c in completions], 1.0)
    batch = {"prompt_ids": [[11, 12], [13]], "prompts": ["p", "q"], "columns": {}, "index": [0, 1]}
    roll = rollout(batch, Fixed(), [function], Tok(), settings, number=1, device=torch.device("cpu"))
    eos_and_pad = [eos, pad]
    is_truncated = torch.tensor([ids[-1] not in eos_and_pad for ids in outputs])  # TRL's line
    masks = torch.cat(
        [
            torch.nn.functional.pad(r["completion_mask"], (0, 3 - r["completion_mask"].shape[1]))
            for r in roll.rows
        ]
    )
    loss_masks = torch.cat(
        [torch.nn.functional.pad(r["loss_mask"], (0, 3 - r["loss_mask"].shape[1])) for r in roll.rows]
    )
    assert torch.equal(loss_masks, masks * (~is_truncated).unsqueeze(1).int())
    assert Fixed.calls == [3, 1] and roll.loss_tokens == int(loss_masks.sum()) == 5
