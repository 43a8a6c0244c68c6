"""The GRPO recipe's objective: the rollout generator over the sharded policy; the reference (the LoRA base with the
adapter disabled, or a frozen sharded copy) when ``beta`` > 0; the step (:mod:`hf_fsdp2.methods.grpo.step`) and the
evaluator (greedy completions of the eval prompts, scored)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.config.plans import check
from hf_fsdp2.methods.grpo.batching import layout_of
from hf_fsdp2.methods.grpo.config import GrpoArgs, json_mapping, sampling_kwargs
from hf_fsdp2.methods.grpo.data import collate_prompts
from hf_fsdp2.methods.grpo.loss import GrpoSettings
from hf_fsdp2.methods.grpo.rewards import (
    RewardContext,
    RewardFunction,
    combine,
    extra_columns,
    resolve_reward_functions,
    reward_metrics,
    score_completions,
)
from hf_fsdp2.methods.grpo.rollout import SamplingSettings, TransformersGenerator, stop_token_ids
from hf_fsdp2.methods.grpo.step import GrpoStepper, GrpoStepSettings, no_grad_logps
from hf_fsdp2.methods.grpo.timing import TimedGenerator
from hf_fsdp2.methods.grpo.vllm.client import build_vllm_generator
from hf_fsdp2.run.build import TrainModel
from hf_fsdp2.run.data import TrainData
from hf_fsdp2.run.method import Objective, composite_of, step_settings
from hf_fsdp2.run.reference import load_reference
from hf_fsdp2.run.session import Session
from hf_fsdp2.train.step import Step

logger = logging.getLogger("hf_fsdp2")


class GrpoEvaluator:
    """Greedy completions of every eval prompt, scored: ``eval_reward`` and each function's mean, plus samples."""

    def __init__(
        self,
        prompts: Sequence[dict],
        generator: Any,
        functions: Sequence[RewardFunction],
        *,
        tokenizer: Any,
        batch_size: int,
        samples: int,
    ) -> None:
        self.prompts, self.generator, self.functions = list(prompts), generator, functions
        self.tokenizer, self.batch_size, self.samples = tokenizer, batch_size, samples

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        rank, world = collectives.rank(), collectives.world()
        mine = self.prompts[rank::world]
        calls = math.ceil(math.ceil(len(self.prompts) / world) / self.batch_size)  # the same on every rank
        table, texts = [], []
        for c in range(calls):
            part = mine[c * self.batch_size : (c + 1) * self.batch_size]
            real = len(part)
            part = part or self.prompts[:1]  # a rank out of prompts still enters the rollout phase
            ids = self.generator.generate([e["prompt_ids"] for e in part], seed=0, greedy=True)
            if not real:
                continue
            batch = collate_prompts(part)
            completions = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            table.append(
                score_completions(self.functions, batch["prompts"], completions, ids, batch["columns"])
            )
            texts += list(
                zip(batch["prompts"], completions, extra_columns(self.functions, len(ids)), strict=True)
            )
        local = torch.cat(table) if table else torch.zeros((0, len(self.functions)))
        rewards = combine(local, self.functions) if len(local) else torch.zeros(0)
        parts = [torch.tensor([float(rewards.nan_to_num().sum()), float((~rewards.isnan()).sum())])]
        for i in range(len(self.functions)):
            col = local[:, i] if len(local) else torch.zeros(0)
            parts.append(torch.tensor([float(col.nan_to_num().sum()), float((~col.isnan()).sum())]))
        total = collectives.all_reduce_sum(torch.cat(parts).to(self.generator.device)).cpu().tolist()
        out = {"eval_reward": total[0] / max(total[1], 1.0), "eval_prompts": float(len(self.prompts))}
        for i, f in enumerate(self.functions):
            out[f"eval_rewards/{f.name}/mean"] = total[2 + 2 * i] / max(total[3 + 2 * i], 1.0)
        # The functions' log_metric values of the eval batches (every rank), named as TRL's eval metrics.
        out.update({f"eval_{k}": v for k, v in reward_metrics(self.functions, self.generator.device).items()})
        if rank == 0:
            for prompt, completion, extra in texts[: self.samples]:  # with the functions' log_extra columns
                logger.info(
                    "eval sample at step %d: %r -> %r%s",
                    step,
                    str(prompt)[-120:],
                    completion[:200],
                    f" {extra}" if extra else "",
                )
        logger.info(
            "eval at step %d: reward %.4f over %d prompts", step, out["eval_reward"], len(self.prompts)
        )
        return out


def _reference(
    session: Session, model: TrainModel
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
    """Per-token reference log-probs of a row batch: the LoRA base (adapter disabled), or a frozen sharded copy."""
    cfg = session.cfg
    g: GrpoArgs = cfg.method
    if not g.beta:
        return None
    temperature = g.temperature
    if cfg.peft.use_peft:
        module = model.module
        logger.info("GRPO reference: the base model with the LoRA adapter disabled (no second copy)")

        def adapter_free(row: dict[str, torch.Tensor]) -> torch.Tensor:
            with module.disable_adapter():  # type: ignore[operator]
                return no_grad_logps(module, row, temperature, session.device, model.loss_plan)

        return adapter_free
    frozen = load_reference(session, model.loss_plan, None, g.ref_model_name_or_path, "GRPO")
    return lambda row: no_grad_logps(frozen.model, row, temperature, session.device, frozen.plan)  # type: ignore[attr-defined]


def _tracker_table(session: Session) -> Callable[[list[dict[str, Any]]], None]:
    """Rank 0's ``log_completions`` rows to the trackers that take tables (wandb, trackio: ``log_table``)."""

    def log(rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        data = [[v if isinstance(v, int | float) or v is None else str(v) for v in r.values()] for r in rows]
        for tracker in session.accelerator.trackers:
            if hasattr(tracker, "log_table"):
                tracker.log_table("completions", columns=columns, data=data, step=int(rows[-1]["step"]))

    return log


def _build_grpo(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[Step, Any]:
    cfg = session.cfg
    g: GrpoArgs = cfg.method
    t = cfg.train
    tokenizer = data.collator.tokenizer
    # TRL's trainer_state for the reward functions, which read it as GRPOTrainer passes it (global_step: the
    # updates done so far).
    per_epoch = max(data.steps_per_epoch, 1)

    def trainer_state() -> Any:
        from transformers import TrainerState

        done = int(getattr(scheduler, "last_epoch", 0))
        return TrainerState(
            global_step=done,
            max_steps=data.total_steps,
            epoch=done / per_epoch,
            num_train_epochs=math.ceil(data.total_steps / per_epoch),
        )

    functions = resolve_reward_functions(
        g.reward_funcs,
        g.reward_weights,
        reference_column=g.reward_reference_column,
        format_pattern=g.reward_format_pattern,
        max_completion_length=g.max_completion_length,
        context=RewardContext(state=trainer_state),
        device=session.device,
        template_kwargs=json_mapping(g.chat_template_kwargs, "chat_template_kwargs"),
    )
    grpo = GrpoSettings(
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        beta=g.beta,
        max_completion_length=g.max_completion_length,
        num_generations=g.num_generations,
        scale_rewards=g.scale_rewards,
        importance_sampling_level=g.importance_sampling_level,
    )
    # Generation batches and steps mean what TRL's do (batching.py), so a TRL recipe's numbers train the same; the
    # run's loss plan chunks the scoring.
    layout = layout_of(cfg, session.data_world)
    settings = GrpoStepSettings(
        grpo=grpo,
        temperature=g.temperature,
        num_iterations=g.num_iterations,
        seed=t.seed,
        layout=layout,
        mask_truncated_completions=g.mask_truncated_completions,
        top_entropy_quantile=g.top_entropy_quantile,
        log_completions=g.log_completions,
        num_completions_to_print=g.num_completions_to_print,
    )
    # Stop at the tokenizer's and the model's end ids (TRL's union); sample from a config built from the keys alone,
    # so the sampled distribution is the scored one.
    eos = stop_token_ids(
        tokenizer.eos_token_id, getattr(model.module.generation_config, "eos_token_id", None)
    )
    sampling = SamplingSettings(
        max_completion_length=g.max_completion_length,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        do_sample=True,
        gather=g.rollout_gather,
        repetition_penalty=g.repetition_penalty,
        min_p=g.min_p,
        generation_kwargs=sampling_kwargs(g.generation_kwargs, vllm=g.use_vllm),
    )
    generator: Any
    colocate = g.use_vllm and g.vllm_mode == "colocate"
    if colocate:  # an engine in each rank, the weights loaded in-process
        from hf_fsdp2.methods.grpo.vllm.colocate import build_colocate_generator

        generator = build_colocate_generator(
            g,
            model.module,
            optimizer,
            tokenizer,
            eos,
            sampling,
            t.mixed_precision,
            session.device,
            str(cfg.model.model_name_or_path),
            cfg.data.max_length,
            training_peak=session.memory_plan.peak if session.memory_plan is not None else None,
        )
    elif g.use_vllm:  # rollouts from the vLLM server, weights sent after each update
        generator = build_vllm_generator(
            g, model.module, optimizer, tokenizer, eos, sampling, t.mixed_precision, session.device
        )
    else:
        generator = TransformersGenerator(
            model.module,
            pad_id=int(tokenizer.pad_token_id),
            eos_ids=eos,
            settings=sampling,
            bos_id=tokenizer.bos_token_id,
        )
    if session.is_main:
        logger.info(generator.describe())
    reference = _reference(session, model)
    if session.is_main and getattr(model.module.config, "output_router_logits", False):
        logger.warning(
            "GRPO adds no MoE router load-balancing loss (TRL adds router_aux_loss_coef x aux_loss): the "
            "router trains on the policy loss alone"
        )
    logger.info(
        "loss: GRPO %s, epsilon %g/%g, beta %g, %d generations per prompt, scale_rewards %s, %d iteration(s) "
        "per generation batch; rewards %s",
        g.loss_type,
        g.epsilon,
        grpo.high,
        grpo.beta,
        g.num_generations,
        g.scale_rewards,
        g.num_iterations,
        ", ".join(f"{f.name} x{f.weight:g}" for f in functions),
    )

    logger.info(
        "GRPO batches: %d completions per generation batch (%d prompts x %d generations; %d per rank in %d "
        "generate call(s)), sampled every %d micro-batch(es); a step is one optimizer update of %d "
        "micro-batch(es) x %d completions per rank; the buffered generation batch is checkpointed with "
        "each rank's data position",
        layout.generation_batch_size,
        layout.prompts,
        g.num_generations,
        layout.per_rank,
        layout.rollout_chunks,
        layout.generate_every,
        layout.gradient_accumulation_steps,
        layout.per_device,
    )
    step = GrpoStepper(
        model.module,
        optimizer,
        scheduler,
        generator=TimedGenerator(generator),  # rollout/* metrics; the evaluator below gets the untimed one
        functions=functions,
        tokenizer=tokenizer,
        reference=reference,
        settings=settings,
        step=step_settings(session, model),
        device=session.device,
    )
    if g.log_completions and session.is_main:
        step.table_sink = _tracker_table(session)

    evaluator = None
    if data.eval_set:
        evaluator = GrpoEvaluator(
            data.eval_set,
            generator,
            functions,
            tokenizer=tokenizer,
            batch_size=cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
            samples=4 if g.num_completions_to_print is None else g.num_completions_to_print,
        )
    return step, evaluator


def check_vllm_composite(cfg: Config) -> None:
    """Refuse ``use_vllm`` (server or colocate) on a composite checkpoint (vision tower + projector + language
    model) before any loading: the weight sync sends every parameter grouped by ``layers.N`` under the model's
    names, the frozen tower's blocks too, to an engine that already holds the tower and names the composite's tensors
    its own way, and no test runs a composite engine yet. Generation with transformers' ``generate`` on the
    composite serves text prompts.

    Raises:
        ConfigError: naming the architecture, why, and the fix.
    """
    found = composite_of(cfg)
    if found is None:
        return
    spec, _ = found
    raise ConfigError(
        f"use_vllm=true (vllm_mode {cfg.method.vllm_mode}) on {spec.architecture}, a composite checkpoint (vision "
        "tower + projector + language model): the weight sync to vLLM sends the parameters layer by layer under the "
        "model's names, the frozen vision tower's too, and is not tested on a composite engine; set use_vllm: false "
        "(the rollout then generates with transformers on the composite, text prompts), or train the family's "
        "text-only checkpoint with vLLM"
    )


def grpo_objective(cfg: Config) -> Objective:
    """The GRPO objective (its keys checked by :class:`GrpoArgs`; its reward functions resolved here, so a bad
    ``module:function`` fails before any loading, every rank alike); dropouts off with ``disable_dropout``.

    Raises:
        ConfigError: packing or padding-free rows, ``max_length`` that leaves no room for a prompt, or ``use_vllm``
            on a composite checkpoint.
    """
    g: GrpoArgs = cfg.method
    d = cfg.data
    check(
        bool(g.reward_funcs),
        "reward_funcs is empty: GRPO needs at least one reward function (exact_match, "
        "format, length_penalty, or module:function)",
    )
    check(
        not (d.packing or d.padding_free),
        f"packing={d.packing}, padding_free={d.padding_free}: GRPO's rows are a "
        "prompt and one completion each, padded; set both to false",
    )
    check(
        not (g.use_vllm and cfg.peft.use_peft),
        "use_vllm with use_peft is not built: the server would need the "
        "adapter merged into each layer before it is sent; train without LoRA, or without vLLM",
    )
    if g.use_vllm:
        check_vllm_composite(cfg)
    if g.use_vllm and g.vllm_mode == "colocate":  # before any loading: this Python must import vLLM
        from hf_fsdp2.methods.grpo.vllm.colocate import require_vllm

        require_vllm()
    check(
        d.max_length > g.max_completion_length,
        f"max_length={d.max_length} must exceed max_completion_length="
        f"{g.max_completion_length}: the prompt gets what is left",
    )
    resolve_reward_functions(
        g.reward_funcs,
        g.reward_weights,
        reference_column=g.reward_reference_column,
        format_pattern=g.reward_format_pattern,
    )  # reward models: loaded later
    if not cfg.fsdp.torch_compile:
        # The rollout decodes one token at a time through the decoder layers with a growing KV cache: compiled
        # layers would see a new shape at every token (recompiles, or dynamo's fallback to eager at its limit).
        logger.info(
            "torch_compile off (GRPO's default): the rollout changes the layers' shapes at every token; "
            "torch_compile: true compiles anyway"
        )
    return Objective(_build_grpo, no_dropout=g.disable_dropout)
