"""What the single-process reference loops of the parity tests share: the documented data order and padding.

Plain PyTorch only (no hf_fsdp2 code): the order is a permutation seeded with seed + epoch, truncated to
a multiple of the world size, rank r taking every world-th index, cut into micro-batches per rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def pad_batch(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``input_ids``/``labels`` examples: (input_ids, attention_mask, labels)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return ids, mask, labels


def step_micro_batches(
    n: int, *, world: int, batch_size: int, accum: int, seed: int, steps: int
) -> Iterator[list[list[int]]]:
    """For each optimizer step, the index lists of all its micro-batches on all ranks."""
    per_rank_batches = (n // world) // batch_size

    def rank_batches(epoch: int) -> list[list[list[int]]]:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        perm = perm[: n - n % world]
        return [
            [perm[r::world][k * batch_size : (k + 1) * batch_size] for k in range(per_rank_batches)]
            for r in range(world)
        ]

    epoch, cursor, batches = 0, 0, rank_batches(0)
    for _ in range(steps):
        micro: list[list[int]] = []
        for _ in range(accum):
            if cursor >= per_rank_batches:
                epoch, cursor, batches = epoch + 1, 0, rank_batches(epoch + 1)
            micro.extend(batches[r][cursor] for r in range(world))
            cursor += 1
        yield micro


def reference_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: list[torch.nn.Parameter],
    data: list[dict],
    pad_id: int,
    *,
    world: int,
    batch_size: int,
    accum: int,
    seed: int,
    steps: int,
) -> list[dict]:
    """The single-process loop of the parity tests: every rank's micro-batches of a step, the summed CE over
    the step's target tokens divided by their count, clipping at 1.0, one optimizer and scheduler step.

    Returns:
        Per step: the loss (mean over target tokens), the gradient norm and the target-token count.
    """
    import torch.nn.functional as F

    out = []
    for micro in step_micro_batches(
        len(data), world=world, batch_size=batch_size, accum=accum, seed=seed, steps=steps
    ):
        padded = [pad_batch([data[i] for i in idx], pad_id) for idx in micro]
        total_tokens = sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in padded)
        loss_sum = 0.0
        for ids, mask, lab in padded:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), reduction="sum")
            (ce / total_tokens).backward()
            loss_sum += ce.item()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out.append({"loss": loss_sum / total_tokens, "grad_norm": float(norm), "target_tokens": total_tokens})
    return out


def peft_reference_run(
    model: torch.nn.Module,
    data: list[dict],
    pad_id: int,
    *,
    lr: float,
    world: int,
    batch_size: int,
    accum: int,
    seed: int,
    steps: int,
) -> tuple[list[dict], dict[str, torch.Tensor], torch.nn.Module]:
    """The LoRA parity tests' one-process loop on a PEFT ``model``: AdamW (no weight decay) on what trains,
    transformers' cosine schedule without warmup, :func:`reference_steps`.

    Returns:
        The per-step records, the trained adapter (PEFT's state-dict names) and the model in eval mode.
    """
    from peft import get_peft_model_state_dict
    from transformers import get_cosine_schedule_with_warmup

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trainable, "weight_decay": 0.0}], lr=lr, foreach=True)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=steps)
    out = reference_steps(
        model,
        opt,
        sched,
        trainable,
        data,
        pad_id,
        world=world,
        batch_size=batch_size,
        accum=accum,
        seed=seed,
        steps=steps,
    )
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return out, adapter, model.eval()
