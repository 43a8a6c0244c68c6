"""The GRPO recipe's data and objective: prompts (strings, or message lists rendered with the chat template and the
generation prompt) with the dataset's other columns for the reward functions; the rollout generator over the
sharded policy; the reference (the LoRA base with the adapter disabled, or a frozen sharded copy) when ``beta`` > 0;
the step (:mod:`hf_fsdp2.train.grpo_step`) and the evaluator (greedy completions of the eval prompts, scored)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.config.grpo import GRPO_LOSS_TYPES
from hf_fsdp2.config.plans import check
from hf_fsdp2.config.sources import parse_column_mapping
from hf_fsdp2.data.loading import apply_column_mapping, load_source
from hf_fsdp2.train.grpo import GrpoSettings
from hf_fsdp2.train.grpo_step import GrpoStepSettings, grpo_step, no_grad_logps
from hf_fsdp2.train.rewards import RewardFunction, combine, resolve_reward_functions, score_completions
from hf_fsdp2.train.rollout import SamplingSettings, TransformersGenerator
from hf_fsdp2.trainer.model import TrainModel
from hf_fsdp2.trainer.objective import Objective, StepFn
from hf_fsdp2.trainer.session import Session
from hf_fsdp2.trainer.sft_data import TrainData, check_one_step, examples_per_step, sampled_stream

logger = logging.getLogger("hf_fsdp2")


def grpo_settings_check(cfg: Config) -> None:
    """The GRPO recipe's reading of the shared keys (every rank alike, before any loading): ``loss_type`` sigmoid (the
    default) means ``dapo`` (TRL's default), ``beta`` unset means 0 (no reference); DPO-only keys are refused.

    Raises:
        ConfigError: naming the key and the fix.
    """
    p, g, d = cfg.preference, cfg.grpo, cfg.data
    if p.loss_type == "sigmoid":
        p.loss_type = "dapo"
    check(p.loss_type in GRPO_LOSS_TYPES, f"loss_type={p.loss_type!r} is not a GRPO loss: one of "
          f"{', '.join(GRPO_LOSS_TYPES)}")  # fmt: skip
    if p.beta is None:
        p.beta = 0.0
    if cfg.fsdp.torch_compile is None:  # unset: off here, where the GPU default would be on
        # The rollout decodes one token at a time through the decoder layers with a growing KV cache: compiled
        # layers would see a new shape at every token (recompiles, or dynamo's fallback to eager at its limit).
        cfg.fsdp.torch_compile = False
        logger.info("torch_compile off for GRPO (unset): the rollout changes the layers' shapes at every token; "
                    "torch_compile: true compiles anyway")  # fmt: skip
    check(not p.precompute_ref_log_probs, "precompute_ref_log_probs: GRPO's completions are sampled during training, "
          "so their reference log-probs cannot be computed before it; unset it")  # fmt: skip
    check(bool(g.reward_funcs), "reward_funcs is empty: GRPO needs at least one reward function (exact_match, "
          "format, length_penalty, or module:function)")  # fmt: skip
    check(not (d.packing or d.padding_free), f"packing={d.packing}, padding_free={d.padding_free}: GRPO's rows are a "
          "prompt and one completion each, padded; set both to false")  # fmt: skip
    check(d.max_length > g.max_completion_length, f"max_length={d.max_length} must exceed max_completion_length="
          f"{g.max_completion_length}: the prompt gets what is left")  # fmt: skip


def _prompt_ids(prompt: Any, tokenizer: Any, where: str) -> list[int]:
    if isinstance(prompt, list):
        if tokenizer.chat_template is None:
            raise ConfigError(f"{where}: the prompt is a message list but the tokenizer has no chat template; give "
                              "chat_template, or plain string prompts")  # fmt: skip
        out = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(out["input_ids"] if isinstance(out, dict) else out)
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: prompt={prompt!r} is not a non-empty string or message list")
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _as_prompt_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``prompt`` record as is; a chat record (``messages`` ending with an assistant turn, the SFT format) as its
    turns before that answer, the answer's text given to the reward functions as ``answer`` (unless the record has
    one)."""
    if "prompt" in record:
        return record
    turns = record.get("messages")
    if (
        isinstance(turns, list)
        and turns
        and isinstance(turns[-1], dict)
        and turns[-1].get("role") == "assistant"
    ):
        out = {k: v for k, v in record.items() if k != "messages"}
        out["prompt"] = turns[:-1]
        out.setdefault("answer", turns[-1].get("content"))
        return out
    raise ConfigError(f"{where}: no 'prompt' column nor 'messages' ending with an assistant turn (columns: "
                      f"{sorted(record)}); rename with dataset_column_mapping")  # fmt: skip


def tokenize_prompts(
    records: Any, tokenizer: Any, *, limit: int, long_examples: str, source: str
) -> list[dict]:
    """Prompt examples ``{prompt_ids, prompt, columns, index}``; a prompt over ``limit`` tokens is dropped (counted)
    or, with ``long_examples: error``, refused naming the record."""
    out: list[dict] = []
    dropped = 0
    for i, record in enumerate(records):
        where = f"{source} record {i}"
        record = _as_prompt_record(dict(record), where)
        ids = _prompt_ids(record["prompt"], tokenizer, where)
        if len(ids) > limit:
            if long_examples == "error":
                raise ConfigError(f"{where}: the prompt has {len(ids)} tokens, over max_length - max_completion_length"
                                  f" = {limit}; raise max_length or drop it (long_examples: drop)")  # fmt: skip
            dropped += 1
            continue
        columns = {k: v for k, v in record.items() if k != "prompt"}
        out.append({"prompt_ids": ids, "prompt": record["prompt"], "columns": columns, "index": len(out)})
    if dropped:
        logger.warning("%s: %d prompts longer than %d tokens dropped", source, dropped, limit)
    return out


def collate_prompts(examples: Sequence[dict]) -> dict[str, Any]:
    """A micro-batch of prompts: their ids, as given, the other columns (one list each) and their indices."""
    keys = sorted({k for e in examples for k in e["columns"]})
    return {"prompt_ids": [e["prompt_ids"] for e in examples], "prompts": [e["prompt"] for e in examples],
            "columns": {k: [e["columns"].get(k) for e in examples] for k in keys},
            "index": [e["index"] for e in examples]}  # fmt: skip


class PromptCollator:
    """:func:`collate_prompts`, carrying the tokenizer the step decodes completions with."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        return collate_prompts(examples)


def build_grpo_data(session: Session, tokenizer: Any) -> TrainData:
    """The prompts of every training source (and the eval prompts), sharded per rank like every recipe's data."""
    cfg = session.cfg
    d, g = cfg.data, cfg.grpo
    limit = d.max_length - g.max_completion_length

    def load() -> tuple[list[dict], list[dict] | None]:
        train = []
        mapping = parse_column_mapping(d.dataset_column_mapping)
        for source in d.sources():
            raw = load_source(source, on_bad_record=d.on_bad_record)
            if mapping:
                raw = apply_column_mapping(raw, mapping, source.describe())
            train += tokenize_prompts(raw, tokenizer, limit=limit, long_examples=d.long_examples,
                                      source=source.describe())  # fmt: skip
        evals = None
        eval_source = d.eval_source()
        if eval_source is not None:
            evals = tokenize_prompts(load_source(eval_source), tokenizer, limit=limit, long_examples=d.long_examples,
                                     source="eval")  # fmt: skip
        elif d.eval_split_fraction:
            cut = max(1, int(len(train) * d.eval_split_fraction))
            train, evals = train[cut:], train[:cut]
        for i, e in enumerate(train):
            e["index"] = i
        return train, evals

    train, evals = rank0_first(load)
    check_one_step(session, len(train), "prompts", "data")
    collator = PromptCollator(tokenizer)
    stream, steps_per_epoch, total_steps = sampled_stream(session, train, collator)
    per_step = examples_per_step(session)
    logger.info("GRPO data: %d prompts, %s; %d steps (%d per epoch), %d prompts x %d generations per step",
                len(train), f"{len(evals)} eval prompts" if evals else "no eval set", total_steps, steps_per_epoch,
                per_step, g.num_generations)  # fmt: skip
    return TrainData(stream, collator, evals, steps_per_epoch, total_steps, per_step, train_set=train)


class GrpoEvaluator:
    """Greedy completions of every eval prompt, scored: ``eval_reward`` and each function's mean, plus samples."""

    def __init__(self, prompts: Sequence[dict], generator: Any, functions: Sequence[RewardFunction], tokenizer: Any,
                 batch_size: int, samples: int) -> None:  # fmt: skip
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
            texts += list(zip(batch["prompts"], completions, strict=True))
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
        if rank == 0:
            for prompt, completion in texts[: self.samples]:
                logger.info("eval sample at step %d: %r -> %r", step, str(prompt)[-120:], completion[:200])
        logger.info(
            "eval at step %d: reward %.4f over %d prompts", step, out["eval_reward"], len(self.prompts)
        )
        return out


def _reference(
    session: Session, model: TrainModel
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
    """Per-token reference log-probs of a row batch: the LoRA base (adapter disabled), or a frozen sharded copy."""
    from hf_fsdp2.trainer.preference import load_reference

    cfg = session.cfg
    if not cfg.preference.beta:
        return None
    temperature = cfg.grpo.temperature
    if cfg.peft.use_peft:
        module = model.module
        logger.info("GRPO reference: the base model with the LoRA adapter disabled (no second copy)")

        def adapter_free(row: dict[str, torch.Tensor]) -> torch.Tensor:
            with module.disable_adapter():  # type: ignore[operator]
                return no_grad_logps(module, row, temperature, session.device)

        return adapter_free
    frozen = load_reference(session, model.loss_plan, None, "GRPO")
    return lambda row: no_grad_logps(frozen.model, row, temperature, session.device)  # type: ignore[attr-defined]


def _build_grpo(
    session: Session, model: TrainModel, optimizer: torch.optim.Optimizer, scheduler: Any, data: TrainData
) -> tuple[StepFn, Any]:
    cfg = session.cfg
    p, g, t = cfg.preference, cfg.grpo, cfg.train
    tokenizer = data.collator.tokenizer
    functions = resolve_reward_functions(g.reward_funcs, g.reward_weights, reference_column=g.reward_reference_column,
                                         format_pattern=g.reward_format_pattern,
                                         max_completion_length=g.max_completion_length)  # fmt: skip
    grpo = GrpoSettings(loss_type=p.loss_type, epsilon=g.epsilon, epsilon_high=g.epsilon_high, beta=float(p.beta or 0),
                        max_completion_length=g.max_completion_length, num_generations=g.num_generations,
                        scale_rewards=g.scale_rewards)  # fmt: skip
    settings = GrpoStepSettings(grpo, g.temperature, g.num_iterations, t.max_grad_norm,
                                cfg.fsdp.fsdp_sync_each_microbatch, t.seed)  # fmt: skip
    eos = [int(i) for i in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])]
    sampling = SamplingSettings(g.max_completion_length, g.temperature, g.top_p, g.top_k, do_sample=True,
                                gather=g.rollout_gather)  # fmt: skip
    generator = TransformersGenerator(
        model.module, pad_id=int(tokenizer.pad_token_id), eos_ids=eos, settings=sampling
    )
    reference = _reference(session, model)
    if session.is_main and getattr(model.module.config, "output_router_logits", False):
        logger.warning("GRPO adds no MoE router load-balancing loss (TRL adds router_aux_loss_coef x aux_loss): the "
                       "router trains on the policy loss alone")  # fmt: skip
    logger.info("loss: GRPO %s, epsilon %g/%g, beta %g, %d generations per prompt, scale_rewards %s, %d iteration(s) "
                "per generation batch; rewards %s", p.loss_type, g.epsilon, grpo.high, grpo.beta, g.num_generations,
                g.scale_rewards, g.num_iterations, ", ".join(f"{f.name} x{f.weight:g}" for f in functions))  # fmt: skip

    def step(micro_batches: Sequence[dict[str, Any]]) -> Any:
        number = int(getattr(scheduler, "last_epoch", 0)) + 1  # restored on resume: the same sampling seeds
        return grpo_step(model.module, optimizer, scheduler, micro_batches, generator=generator, functions=functions,
                         tokenizer=tokenizer, reference=reference, settings=settings, device=session.device,
                         step=number, rank=session.rank)  # fmt: skip

    evaluator = None
    if data.eval_set:
        evaluator = GrpoEvaluator(data.eval_set, generator, functions, tokenizer,
                                  cfg.observe.per_device_eval_batch_size or t.per_device_train_batch_size,
                                  g.log_completions)  # fmt: skip
    return step, evaluator


def grpo_objective(cfg: Config) -> Objective:
    """The GRPO objective (after :func:`grpo_settings_check`); dropouts off with ``disable_dropout``."""
    grpo_settings_check(cfg)
    return Objective(_build_grpo, no_dropout=cfg.preference.disable_dropout)
