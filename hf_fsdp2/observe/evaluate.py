"""Evaluation during training: eval loss and perplexity over every rank, and samples from fixed prompts.

The eval loss is token-weighted like the training loss: the sum of next-token cross entropy over every
target token of the eval set (on all ranks) divided by the number of those tokens, not a mean of
per-batch means. Every example is evaluated exactly once; every rank runs the same number of forward
passes (FSDP2 gathers parameters in each one), a rank that has run out of examples runs its last
batch again with every label masked, which adds nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.collectives import all_reduce_sum
from hf_fsdp2.parallel.all_to_all import pad_to_multiple, shard_sequence, whole_sequences
from hf_fsdp2.parallel.compiling import eager
from hf_fsdp2.parallel.ring import ring_context, ring_mesh, shard_ring
from hf_fsdp2.train.loss import (
    IGNORE_INDEX,
    LossPlan,
    causal_lm_loss_sum,
    count_target_tokens,
    shifted_target_rows,
)

logger = logging.getLogger("hf_fsdp2")


@dataclass(frozen=True)
class EvalResult:
    """Eval loss of the whole eval set (all ranks).

    Attributes:
        loss: summed CE / target tokens.
        perplexity: ``exp(loss)``.
        tokens: target tokens evaluated.
        seconds: wall time of the evaluation.
    """

    loss: float
    perplexity: float
    tokens: int
    seconds: float

    def record(self) -> dict[str, float]:
        """The metrics.jsonl / tracker fields."""
        return {
            "eval_loss": self.loss,
            "eval_perplexity": self.perplexity,
            "eval_tokens": self.tokens,
            "eval_time_s": self.seconds,
        }


def eval_batches(
    dataset: Any,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's eval batches: examples ``rank, rank + world_size, ...``, the same count on every rank.

    Args:
        dataset: tokenized eval examples (``input_ids``, ``labels``), indexable.
        rank: this rank.
        world_size: ranks evaluating together.
        batch_size: examples per batch.
        collator: the training collator (padded or padding-free batches alike).

    Yields:
        Collated host batches; after this rank's share, copies of a batch with every label masked.

    Raises:
        ValueError: an empty eval set or ``batch_size < 1``.
    """
    n = len(dataset)
    if n == 0 or batch_size < 1:
        raise ValueError(
            f"eval needs examples and batch_size >= 1 (got {n} examples, batch_size={batch_size})"
        )
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size)  # the same on every rank
    last: dict[str, torch.Tensor] | None = None
    for b in range(per_rank):
        indices = mine[b * batch_size : (b + 1) * batch_size]
        if indices:
            last = collator([dataset[i] for i in indices])
            yield last
        else:
            filler = dict(last if last is not None else collator([dataset[0]]))
            filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
            yield filler


def evaluate_loss(
    model: torch.nn.Module,
    batches: Iterator[dict[str, torch.Tensor]],
    device: torch.device,
    *,
    plan: LossPlan | None = None,
) -> EvalResult:
    """Token-weighted eval loss of ``model`` over every rank's batches (every rank calls it).

    Runs under ``torch.no_grad`` in eval mode (dropout off) and restores the training mode after. Compiled
    modules run eagerly here (:func:`hf_fsdp2.parallel.compiling.eager`): eval's no-grad shapes would be new
    graphs, each counted against the recompile limit training needs. The chunked loss gets its target rows
    from the host labels, so a batch reads the device only for its loss (never for ``nonzero``).

    Args:
        model: the (FSDP2-sharded) model.
        batches: this rank's batches from :func:`eval_batches`.
        device: where the model computes.
        plan: the training run's loss plan (chunked or plain, the model's logit post-processing); the router
            auxiliary loss is left out of the eval loss. Default: plain logits.

    Returns:
        The :class:`EvalResult` (NaN loss when the eval set has no target token).
    """
    start = time.perf_counter()
    plan = dataclasses.replace(plan or LossPlan(), router_aux_coef=0.0)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    ring = ring_mesh(model) if collectives.cp_size() > 1 else None
    shard = shard_ring if ring is not None else shard_sequence
    with torch.no_grad(), eager(), ring_context(ring):
        for batch in batches:
            # Sequence parallel splits a length that is a multiple of tp; context parallel then takes this rank's
            # part of each sequence, as in training (the padding carries no target).
            if collectives.tp_size() > 1 and ring is None:
                batch = pad_to_multiple(batch, collectives.tp_size() * collectives.cp_size())
            if collectives.cp_size() > 1:
                batch = shard(batch, collectives.cp_size(), collectives.cp_rank())
            tokens += count_target_tokens(batch["labels"])  # host labels: no device read
            rows = shifted_target_rows(batch["labels"]) if plan.chunk_tokens > 0 else None
            on_device = {k: v.to(device) for k, v in batch.items()}
            inputs = {k: v for k, v in on_device.items() if k != "labels"}
            loss_sum += causal_lm_loss_sum(model, inputs, on_device["labels"], plan, rows).double()
    model.train(was_training)
    # Every rank: one all_reduce of (summed CE, target tokens).
    totals = all_reduce_sum(
        torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64, device=device)])
    )
    total_loss, count = totals.tolist()  # the pass's one device read
    # The ranks of a tensor-parallel group score the same batches: each counted the loss and the tokens.
    total_loss, total_tokens = total_loss / collectives.tp_size(), int(count) // collectives.tp_size()
    loss = total_loss / total_tokens if total_tokens else float("nan")
    perplexity = math.exp(loss) if math.isfinite(loss) and loss < 700 else float("inf")
    return EvalResult(loss, perplexity, total_tokens, time.perf_counter() - start)


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt: a user turn with the chat template when the tokenizer has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def generate_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    device: torch.device,
) -> list[str]:
    """Greedy completions of ``prompts`` (every rank calls it and gets the same texts).

    Every rank decodes exactly ``max_new_tokens`` tokens per prompt and the text is cut at the first
    end-of-sequence token: stopping early on one rank only would leave the others
    waiting in FSDP2's parameter gathers. Compiled modules run eagerly here (a sequence one token longer
    per forward, no grad, eval mode: see :func:`hf_fsdp2.parallel.compiling.eager`).

    Args:
        model: the (FSDP2-sharded) causal LM.
        tokenizer: its tokenizer.
        prompts: user messages (or plain text without a chat template).
        max_new_tokens: tokens decoded per prompt.
        device: where the model computes.

    Returns:
        One completion per prompt, special tokens removed.
    """
    eos = tokenizer.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) - {None}
    was_training = model.training
    model.eval()
    texts = []
    # Every rank decodes the same whole sequence: context-parallel attention would read them as parts of one.
    with torch.no_grad(), eager(), whole_sequences(model):
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)], dtype=torch.long, device=device)
            for _ in range(max_new_tokens):
                # The whole sequence each time, no KV cache: with FSDP2 a forward is dominated by
                # gathering the parameters, and the cache API of transformers is still moving.
                logits = model(input_ids=ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1, :].argmax(dim=-1, keepdim=True)], dim=1)
            new = ids[0, -max_new_tokens:].tolist()
            cut = next((i for i, t in enumerate(new) if t in stop), len(new))
            texts.append(tokenizer.decode(new[:cut], skip_special_tokens=True))
    model.train(was_training)
    return texts


SAMPLES_FILE = "samples.jsonl"


class Evaluator:
    """The recipe's evaluation: eval loss and perplexity, then samples from fixed prompts.

    Holds the eval set and what batches it; :meth:`run` is called by every rank at the same steps.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
        batch_size: int,
        rank: int,
        world_size: int,
        device: torch.device,
        tokenizer: Any = None,
        prompts: Sequence[str] = (),
        max_new_tokens: int = 32,
        output_dir: str | Path | None = None,
        is_main_process: bool = True,
        loss_plan: LossPlan | None = None,
    ) -> None:
        """Args:
        dataset: tokenized eval examples (not packed: one example per sequence).
        collator: the training collator.
        batch_size: eval examples per batch per rank.
        rank: this rank.
        world_size: ranks evaluating together.
        device: where the model computes.
        tokenizer: for the samples (needed with prompts).
        prompts: prompts completed greedily at each eval (none: no samples).
        max_new_tokens: tokens generated per prompt.
        output_dir: the main process appends samples to ``output_dir/samples.jsonl``.
        is_main_process: this rank logs and writes.
        loss_plan: the training run's loss plan.
        """
        self.dataset, self.collator, self.batch_size = dataset, collator, batch_size
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokenizer, self.prompts, self.max_new_tokens = tokenizer, list(prompts), max_new_tokens
        self.samples_path = Path(output_dir) / SAMPLES_FILE if output_dir is not None else None
        self.is_main_process = is_main_process
        self.loss_plan = loss_plan

    def run(
        self, model: torch.nn.Module, step: int, log: Callable[..., Any] | None = None
    ) -> dict[str, float]:
        """Evaluate at ``step`` (every rank calls it).

        Args:
            model: the (FSDP2-sharded) model; left in the mode it was in.
            step: the optimizer step just done.
            log: ``accelerator.log``, to send the samples to the trackers as text.

        Returns:
            ``eval_loss``, ``eval_perplexity``, ``eval_tokens``, ``eval_time_s`` (for the metrics record).
        """
        batches = eval_batches(
            self.dataset,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            collator=self.collator,
        )
        result = evaluate_loss(model, batches, self.device, plan=self.loss_plan)
        logger.info(
            "eval at step %d: loss %.4f, perplexity %.3f (%d target tokens, %d examples, %.1fs)",
            step,
            result.loss,
            result.perplexity,
            result.tokens,
            len(self.dataset),
            result.seconds,
        )
        if self.prompts:
            texts = generate_samples(
                model, self.tokenizer, self.prompts, max_new_tokens=self.max_new_tokens, device=self.device
            )
            for prompt, text in zip(self.prompts, texts, strict=True):
                logger.info("sample at step %d: %r -> %r", step, prompt, text)
            if self.is_main_process and self.samples_path is not None:
                with self.samples_path.open("a") as fh:
                    for prompt, text in zip(self.prompts, texts, strict=True):
                        fh.write(json.dumps({"step": step, "prompt": prompt, "completion": text}) + "\n")
            if log is not None:
                log(
                    {
                        f"sample_{i}": f"{prompt}\n\n→ {text}"
                        for i, (prompt, text) in enumerate(zip(self.prompts, texts, strict=True))
                    },
                    step=step,
                )
        return result.record()
