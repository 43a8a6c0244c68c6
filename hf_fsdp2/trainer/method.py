"""What the loop runs: a training method (its config section, data, objective and what the memory plan, doctor and
model card need to know of it) and the objective it builds once the model is sharded.

The loop (:func:`hf_fsdp2.trainer.loop.run`), checkpoints, metrics and the export are shared; a method differs by its
data and its objective. Its objective builds a :class:`~hf_fsdp2.train.step.Step`: the shared skeleton
(:func:`~hf_fsdp2.train.step.train_step`) with the method's loss of a micro-batch
(:class:`~hf_fsdp2.train.step.StepLoss`); every step returns a :class:`~hf_fsdp2.train.step.StepOutput`.

The methods themselves live in :mod:`hf_fsdp2.methods` (one package each) and are found through its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.train.step import LossStep, Step, StepLoss, StepSettings
from hf_fsdp2.trainer.data import TrainData
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.session import Session

BATCH_ROWS = ("as_configured", "corpus", "padded")
"""How a method lays out its rows: ``as_configured`` (the data keys packing / padding_free decide), ``corpus``
(rows of several documents unless ``cross_document_attention``, full already), ``padded`` (one padded row per
sequence: pairs, unpaired examples, prompt + completion)."""


@dataclass(frozen=True)
class Objective:
    """A method's objective.

    Attributes:
        build: ``(session, model, optimizer, scheduler, data) -> (step function, evaluator or None)``; called by
            every rank once the model is sharded and before a checkpoint is resumed (the weights are still the
            loaded ones). An evaluator has ``run(model, step, log) -> metrics``; None: the SFT evaluator on
            ``data.eval_set``.
        no_dropout: every dropout of the model set to 0 before sharding.
        reward_model: the model is loaded with a scalar score head (``AutoModelForSequenceClassification``).
    """

    build: Callable[[Session, TrainModel, torch.optim.Optimizer, Any, TrainData], tuple[Step, Any]]
    no_dropout: bool = False
    reward_model: bool = False


def step_settings(session: Session, model: TrainModel) -> StepSettings:
    """How the run's steps run: its loss plan, ``max_grad_norm`` and ``fsdp_sync_each_microbatch``."""
    cfg = session.cfg
    return StepSettings(model.loss_plan, cfg.train.max_grad_norm, cfg.fsdp.fsdp_sync_each_microbatch)


def loss_step(
    session: Session,
    model: TrainModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    new_loss: Callable[[], StepLoss],
) -> LossStep:
    """The run's step for a method whose micro-batches come straight from its data stream: the shared skeleton with
    a new ``new_loss()`` each step, ``gradient_accumulation_steps`` stream batches a step."""
    return LossStep(
        model.module, optimizer, scheduler, settings=step_settings(session, model), device=session.device,
        new_loss=new_loss, reads_per_step=session.cfg.train.gradient_accumulation_steps,
    )  # fmt: skip


def _one_row(cfg: Config) -> int:
    return 1


def _no_notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Method:
    """A training method, as the loop, ``hf-fsdp2 train``, doctor, the memory plan and the model card know it.

    Attributes:
        name: what users type: ``hf-fsdp2 train NAME``, ``recipes/NAME.py``, ``--recipe NAME``.
        title: a few words for the model card and ``--help`` ("supervised fine-tuning").
        build_data: ``(session, tokenizer) -> TrainData`` on every rank (rank 0 tokenizes first).
        objective: ``cfg -> Objective``: the method's start-up checks (ConfigError, every rank alike, before any
            loading), then its objective.
        section: the method's config section (a dataclass: its keys, defaults and ``validate()``), or None.
        defaults: this method's defaults for keys of the shared sections (applied under the YAML and the command
            line, so a value the user gives wins): e.g. GRPO's ``torch_compile: false``.
        batch_rows: one of :data:`BATCH_ROWS`: how the attention layout and the memory plan read its rows.
        rows_per_example: ``cfg -> rows`` of one example in a forward (2 for a pair; GRPO: 1, a completion).
        plan_notes: ``(cfg, plan, model_config) -> lines`` the memory plan adds (what it leaves out, other phases).
        preview_data: ``(cfg, tokenizer, load, read) -> [(source, what)]``: doctor's reading of the first ``read``
            records of each source as the run tokenizes them (``load(source)`` gives them); raises the run's data
            error. None: the SFT data builder's reading (:func:`hf_fsdp2.methods.sft.data.preview_sft`).
        tags: model-card tags beyond the name.
        context_parallel: the method's step splits each sequence over the ``cp_size`` ranks of a context-parallel
            group (its loss is the token-level CE of :func:`hf_fsdp2.train.step.train_step`); others refuse
            ``cp_size > 1``.
        tensor_parallel: the method's step is :func:`hf_fsdp2.train.step.train_step`'s token-level CE, whose counts
            and loss count a tensor-parallel group's batch once; others refuse ``tp_size > 1``
            (:func:`check_tensor_parallel`).
        float8: ``mixed_precision: fp8`` is verified with the method's step and the models it loads (the policy
            only, no reference or reward model beside it, no weights sent elsewhere): :func:`check_float8`.
    """

    name: str
    title: str
    build_data: Callable[[Session, Any], TrainData]
    objective: Callable[[Config], Objective]
    section: type | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    batch_rows: str = "as_configured"
    rows_per_example: Callable[[Config], int] = _one_row
    plan_notes: Callable[[Config, Any, Any], list[str]] = _no_notes
    preview_data: Callable[[Config, Any, Callable[[Any], Any], int], list[tuple[str, str]]] | None = None
    tags: tuple[str, ...] = ()
    context_parallel: bool = False
    tensor_parallel: bool = False
    float8: bool = False

    def __post_init__(self) -> None:
        if self.batch_rows not in BATCH_ROWS:
            raise ValueError(
                f"method {self.name!r}: batch_rows={self.batch_rows!r} is not one of {BATCH_ROWS}"
            )
        if not self.name.isidentifier():
            raise ValueError(
                f"method name {self.name!r} must be a Python identifier (it names recipes/NAME.py)"
            )


def check_tensor_parallel(method: Method, tp: int) -> None:
    """Refuse ``tp`` > 1 for a method whose step normalises its loss by its own counts over every rank (they would
    count a tensor-parallel group's batch ``tp`` times).

    Raises:
        ConfigError: naming the method, ``tp`` and the recipes that support it.
    """
    if tp > 1 and not method.tensor_parallel:
        raise ConfigError(
            f"tp_size={tp} is not supported by the {method.name} recipe in this version: its step normalises the "
            "loss by counts over every rank, which would count each tensor-parallel group's batch tp_size times; "
            "tensor parallel runs with the sft and cpt recipes. Use tp_size=1 (FSDP2 or HSDP)"
        )


def check_context_parallel(method: Method, cp: int) -> None:
    """Refuse ``cp`` > 1 for a method whose step does not split sequences (the run's check; the plan and doctor ask
    it before any process group exists).

    Raises:
        ConfigError: naming the method, ``cp`` and the recipes that support it.
    """
    if cp > 1 and not method.context_parallel:
        raise ConfigError(
            f"cp_size={cp} is not supported by the {method.name} recipe in this version: its "
            "step scores whole sequences per rank (rewards, generations, KL pairs); context parallel runs with the "
            "sft, cpt and dpo recipes. Use cp_size=1 (activation_checkpointing and ce_chunk_tokens for long "
            "sequences)"
        )


def check_float8(method: Method, mixed_precision: str) -> None:
    """Refuse ``mixed_precision: fp8`` for a method whose run has not been verified with float8 linears (a frozen
    reference or a reward model beside the policy, a score head, weights sent to a vLLM server).

    Raises:
        ConfigError: naming the method and the recipes that support it.
    """
    if mixed_precision == "fp8" and not method.float8:
        raise ConfigError(
            f"mixed_precision=fp8 is not supported by the {method.name} recipe in this version: FP8 training is "
            "verified with the sft and cpt recipes only (its reference, reward or score models and weight syncs are "
            "not). Use mixed_precision=bf16"
        )
