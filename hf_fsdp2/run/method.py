"""What the loop runs: a training method (its config section, data, objective and what the memory plan, doctor and
model card need to know of it) and the objective it builds once the model is sharded.

The loop (:func:`hf_fsdp2.run.loop.run`), checkpoints, metrics and the export are shared; a method differs by its
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

from hf_fsdp2.composite import CompositeSpec, composite_spec
from hf_fsdp2.config import Config
from hf_fsdp2.model import load_model_config
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.step import LossStep, Step, StepLoss, StepSettings, TokenLoss
from hf_fsdp2.vision.processor import dummy_image_inputs
from hf_fsdp2.vision.tower import run_tower_always, unwrap_model

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
        model.module,
        optimizer,
        scheduler,
        settings=step_settings(session, model),
        device=session.device,
        new_loss=new_loss,
        reads_per_step=session.cfg.train.gradient_accumulation_steps,
    )


def _build_token_step(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    if data.processor is not None:
        # Image records: every forward runs the vision tower (on a dummy image where a micro-batch has none), so a
        # rank with a text-only micro-batch runs the tower's collectives as the ranks with images do.
        run_tower_always(model.module, dummy_image_inputs(data.processor, unwrap_model(model.module)))
    step = loss_step(
        session, model, optimizer, scheduler, lambda: TokenLoss(model.loss_plan, session.device, model.module)
    )
    return step, None  # the SFT evaluator on data.eval_set


TOKEN_OBJECTIVE = Objective(_build_token_step)
"""Token-level cross entropy on the target tokens (SFT, continued pre-training): :class:`~hf_fsdp2.train.step.TokenLoss`
in the shared step."""


def token_objective(cfg: Config) -> Objective:
    """The token-level objective of SFT and CPT (no keys of its own to check)."""
    return TOKEN_OBJECTIVE


def composite_of(cfg: Config) -> tuple[CompositeSpec, Any] | None:
    """The composite checkpoint the run's ``model_name_or_path`` names and its config, read from its config.json
    (every rank reads the same file), for a method's start-up checks before any loading.

    Returns:
        ``(spec, model config)``; None for a causal LM, or for a config that does not load or names an architecture
        the toolkit does not train (the session refuses those, naming them, before any loading).
    """
    m = cfg.model
    try:
        config = load_model_config(
            m.model_name_or_path or "", revision=m.model_revision, trust_remote_code=m.trust_remote_code
        )
        spec = composite_spec(config)
    except (OSError, ValueError):  # ConfigError is a ValueError: the session's refusal names it
        return None
    return None if spec is None else (spec, config)


def _one_row(cfg: Config) -> int:
    return 1


def _no_notes(cfg: Config, plan: Any, model_config: Any) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """The layouts a method's step supports beyond FSDP2 and HSDP (which every method runs); each is verified by the
    tests named at the method's ``METHOD``. :func:`~hf_fsdp2.run.registry.check_capabilities` refuses the others before any work.

    Attributes:
        context_parallel: ``cp_size > 1`` with the all-to-all exchange: the step splits each sequence over the cp
            ranks and counts a cp group's rows once (token CE; DPO's all-reduced row sums).
        ring_attention: ``cp_backend: ring``: the step shards its rows in torch's load-balanced layout.
        tensor_parallel: ``tp_size > 1``: the step counts a tensor-parallel group's batch once (token CE).
        float8: ``mixed_precision: fp8``: verified with the method's step and the models it loads (the policy only,
            no reference or reward model beside it, no weights sent elsewhere).
        expert_parallel: ``ep_size > 1``: verified with the method's step and the models it loads, each MoE layer's
            routed experts split over the ep ranks (the policy only: no reference, reward or score model beside it,
            no weights sent elsewhere).
        images: image records, so a composite's vision tower and projector can train (``freeze_vision_tower`` /
            ``freeze_multi_modal_projector: false``; the data builder refuses them where the data has no image).
    """

    context_parallel: bool = False
    ring_attention: bool = False
    tensor_parallel: bool = False
    float8: bool = False
    expert_parallel: bool = False
    images: bool = False


@dataclass(frozen=True, kw_only=True)
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
            error. None: the SFT data builder's reading (:func:`hf_fsdp2.data.mixture.preview_sft`).
        tags: model-card tags beyond the name.
        capabilities: the layouts beyond FSDP2/HSDP its step supports (:class:`Capabilities`), checked by
            :func:`~hf_fsdp2.run.registry.check_capabilities` before any work.
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
    capabilities: Capabilities = Capabilities()

    def __post_init__(self) -> None:
        if self.batch_rows not in BATCH_ROWS:
            raise ValueError(
                f"method {self.name!r}: batch_rows={self.batch_rows!r} is not one of {BATCH_ROWS}"
            )
        if not self.name.isidentifier():
            raise ValueError(
                f"method name {self.name!r} must be a Python identifier (it names recipes/NAME.py)"
            )
