"""GRPO's batch and step meaning as TRL 1.16's: ``per_device_train_batch_size`` counts
completions, ``generation_batch_size`` / ``steps_per_generation`` derive as ``GRPOConfig.__post_init__`` derives
them (compared with TRL's own config on one process) and refuse what it refuses, naming the numbers and the fix; a
generation batch is sampled every ``steps_per_generation x num_iterations`` micro-batches, a step is one update."""

from __future__ import annotations

import tempfile

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods.grpo.batching import generation_layout


def _layout(**kw: int | None):  # type: ignore[no-untyped-def]
    base: dict[str, int | None] = {
        "per_device": 4,
        "ranks": 1,
        "gradient_accumulation_steps": 2,
        "num_generations": 4,
        "num_iterations": 1,
        "generation_batch_size": None,
        "steps_per_generation": None,
        "rollout_batch_size": None,
    }
    return generation_layout(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "keys"),
    [
        ({}, {}),
        ({"generation_batch_size": 24}, {"generation_batch_size": 24}),
        ({"steps_per_generation": 3}, {"steps_per_generation": 3}),
    ],
)
def test_the_layout_is_trls_grpo_config(given: dict[str, int], keys: dict[str, int]) -> None:
    from trl import GRPOConfig

    with tempfile.TemporaryDirectory() as tmp:
        trl = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_generations=4,
            report_to="none",
            **keys,
        )
    ours = _layout(**given)
    assert (ours.generation_batch_size, ours.steps_per_generation) == (
        trl.generation_batch_size,
        trl.steps_per_generation,
    )
    assert (
        ours.per_rank == ours.per_device * ours.steps_per_generation
        and ours.prompts * 4 == ours.generation_batch_size
    )


def test_refusals_name_the_numbers_and_the_fix() -> None:
    with pytest.raises(
        ConfigError,
        match=r"generation_batch_size \(10\) must be divisible by the global batch size "
        r"per_device_train_batch_size\(4\) x data-parallel ranks\(2\) = 8: set it to a multiple of 8",
    ):
        _layout(ranks=2, generation_batch_size=10)
    with pytest.raises(
        ConfigError,
        match=r"generation_batch_size \(6 = per_device_train_batch_size\(3\) x "
        r"data-parallel ranks\(1\) x steps_per_generation\(2\)\) must be divisible by num_generations "
        r"\(4\).*a multiple of 4",
    ):
        _layout(per_device=3)
    with pytest.raises(ConfigError, match="both set: set one"):
        _layout(generation_batch_size=8, steps_per_generation=2)


def test_generation_batches_and_steps() -> None:
    """Default: one generation batch per update; num_iterations 2: one per 2 updates (the sampler's log-probs kept);
    steps_per_generation 1 with accumulation 2: two per update; a group spans ranks when a rank's share is not whole
    groups (8 completions of a prompt over 2 ranks of 4)."""
    one = _layout()
    assert [one.generations_in(s) for s in (1, 2, 3)] == [1, 1, 1] and not one.needs_old_logps
    assert one.steps_per_epoch(12) == 6  # 12 prompts, 2 per generation batch
    twice = _layout(num_iterations=2)
    assert [twice.generations_in(s) for s in (1, 2, 3, 4)] == [1, 0, 1, 0] and twice.needs_old_logps
    assert twice.steps_per_epoch(12) == 12
    often = _layout(steps_per_generation=1)
    assert [often.generations_in(s) for s in (1, 2)] == [2, 2] and not often.needs_old_logps
    odd = _layout(
        gradient_accumulation_steps=2, steps_per_generation=3
    )  # 3 micro-batches per generation, 2 per step
    assert [odd.generations_in(s) for s in (1, 2, 3, 4)] == [1, 1, 0, 1]
    spans = _layout(ranks=2, num_generations=8, gradient_accumulation_steps=1)
    assert spans.per_rank == 4 and spans.prompts == 1 and spans.generation_batch_size == 8
    assert (
        _layout(rollout_batch_size=3).rollout_chunks == 3
        and _layout(rollout_batch_size=99).rollout_chunks == 1
    )


def test_the_stepper_reads_a_prompt_batch_per_generation_batch_and_after_a_resume_inside_one() -> None:
    """What the loop reads per step: one prompt batch when a generation batch starts; a run started inside one (a
    resume from a checkpoint there) samples a new one first, as TRL's empty buffer does."""
    from hf_fsdp2.methods.grpo.loss import GrpoSettings
    from hf_fsdp2.methods.grpo.step import GrpoStepper, GrpoStepSettings
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.step import StepSettings

    layout = _layout(num_iterations=2)
    settings = GrpoStepSettings(
        grpo=GrpoSettings(num_generations=4), temperature=1.0, num_iterations=2, seed=0, layout=layout
    )
    stepper = GrpoStepper(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,
        generator=None,  # type: ignore[arg-type]
        functions=[],
        tokenizer=None,
        reference=None,
        settings=settings,
        step=StepSettings(LossPlan()),
        device=None,  # type: ignore[arg-type]
    )
    assert [stepper.reads(s) for s in (1, 3, 5)] == [1, 1, 1]
    assert stepper.reads(2) == 1  # nothing buffered yet: a resumed step 2 samples
    stepper.roll = object()  # type: ignore[assignment]  # a buffered generation batch
    assert [stepper.reads(s) for s in (1, 2, 3, 4)] == [1, 0, 1, 0]
