"""Image records for the vision-language tests, their per-rank micro-batch schedule, and the reference they are
checked against: TRL's DataCollatorForVisionLanguageModeling (assistant-only loss) + the composite's own class +
torch AdamW in one process, from the same raw records.

The records differ in image count (0 to 2), image size (so Qwen's and Idefics3's processors give them different token
counts) and text length; the schedule gives each rank different records every step, and step 0 starts rank 0 on a
text-only micro-batch while rank 1's has images (the case where a rank would skip the vision tower's collectives).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (240, 220, 40)}
SIZES = ((32, 32), (40, 30), (64, 48), (20, 60), (48, 64))
STEPS = 3
LR = 2e-3


def _image(colour: str, size: tuple[int, int], seed: int) -> Any:
    """A ``size`` image of ``colour`` with a darker square whose place follows ``seed``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, COLOURS[colour])
    x, y = seed * 7 % max(1, size[0] - 8), seed * 5 % max(1, size[1] - 8)
    ImageDraw.Draw(image).rectangle((x, y, x + 7, y + 7), fill=tuple(c // 3 for c in COLOURS[colour]))
    return image


def vlm_records() -> list[dict[str, Any]]:
    """12 records: 8 with one or two images (their parts before or after the text), 4 text-only (an empty image
    list). Every content is a list of parts (one Arrow column cannot mix strings and lists)."""
    names = list(COLOURS)
    records = []
    for i in range(12):
        if i % 3 == 2:
            question = "Say something short." if i % 2 else "Tell me a colour you like, and why it is nice."
            records.append(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "text", "text": question}]},
                        {
                            "role": "assistant",
                            "content": [{"type": "text", "text": names[i % 4] + " is fine"}],
                        },
                    ],
                    "images": [],
                }
            )
            continue
        count = 2 if i % 4 == 0 else 1
        colours = [names[(i + k) % 4] for k in range(count)]
        images = [_image(c, SIZES[(i + k) % len(SIZES)], i + k) for k, c in enumerate(colours)]
        text = {
            "type": "text",
            "text": "What colour" + (" are these?" if count > 1 else " is this?") + " ok" * (i % 4),
        }
        parts = [*([{"type": "image"}] * count), text] if i % 2 else [text, *([{"type": "image"}] * count)]
        user: dict[str, Any] = {"role": "user", "content": parts}
        records.append(
            {
                "messages": [
                    user,
                    {"role": "assistant", "content": [{"type": "text", "text": " and ".join(colours)}]},
                ],
                "images": images,
            }
        )
    return records


# SCHEDULE[step][rank] = the record indices of each of the rank's two micro-batches.
SCHEDULE = [
    [[[2, 5], [0, 1]], [[0, 3], [4]]],  # rank 0 starts text-only, rank 1 with three images
    [[[6, 7], [11]], [[8, 9, 10], [1]]],
    [[[3], [4, 8]], [[5, 6], [9]]],
]


def write_records(records: list[dict[str, Any]], folder: Path) -> Path:
    """The records as ``folder/train.jsonl`` with the images as PNG files beside it (relative paths)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    with (folder / "train.jsonl").open("w") as handle:
        for i, record in enumerate(records):
            paths = []
            for k, image in enumerate(record["images"]):
                paths.append(f"img/{i}_{k}.png")
                image.save(folder / paths[-1])
            handle.write(json.dumps({"messages": record["messages"], "images": paths}) + "\n")
    return folder / "train.jsonl"


def trl_batch(processor: Any, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """TRL's collated batch of ``records`` (its assistant-only loss: the template's generation markers)."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collator = DataCollatorForVisionLanguageModeling(processor=processor, assistant_only_loss=True)
    return dict(
        collator([{"messages": copy.deepcopy(r["messages"]), "images": list(r["images"])} for r in records])
    )


def trl_batches(processor: Any, records: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """``records`` as TRL's batches: one, or one per record where TRL cannot batch them (Idefics3's processor in
    transformers 5.25 cannot batch a text-only record beside image records: it returns ``text_replacement_offsets``,
    which it cannot make a tensor). A padded row's loss does not depend on its batch."""
    mixed = len({bool(r["images"]) for r in records}) > 1
    if mixed and type(processor).__name__ == "Idefics3Processor":
        return [trl_batch(processor, [r]) for r in records]
    return [trl_batch(processor, records)]


def reference_losses(
    model: torch.nn.Module,
    processor: Any,
    records: list[dict[str, Any]],
    schedule: list[list[list[list[int]]]] = SCHEDULE,
    lr: float = LR,
) -> list[float]:
    """Train ``model`` (its frozen parts already frozen) in one process on every rank's micro-batches of
    ``schedule``, TRL's batches, summed cross entropy over the step's target tokens, clip 1.0, torch AdamW; the
    per-step losses."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in schedule:
        batches = [
            b for rank in step for micro in rank for b in trl_batches(processor, [records[i] for i in micro])
        ]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            labels = b.pop("labels")
            logits = model(**b, use_cache=False).logits[:, :-1].float()
            ce = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), reduction="sum"
            )
            (ce / tokens).backward()
            total += float(ce)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total / tokens)
    return losses
