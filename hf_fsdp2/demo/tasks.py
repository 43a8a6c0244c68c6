"""A generated chat task with exact answers, used by the demo to show that fine-tuning worked.

The task: write an ISO date (``2024-03-05``) in words (``5 March 2024``). SmolLM2-135M-Instruct
echoes the date or starts a sentence (0/100 exact matches on held-out records), while a short full
fine-tune on CPU learns the format and the month names (100/100 after 20 steps of batch 8 at lr 1e-4).
Every record is a ``messages`` conversation with a short system turn, so the chat template does not
insert SmolLM2's default system prompt: a whole record is 46-47 SmolLM2 tokens, ~10 of them the answer.

Train and eval records never share a date: each date belongs to one split, chosen by a hash of the
date itself, whatever the seed.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hf_fsdp2.compat import NO_HUB_KERNELS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

SYSTEM_PROMPT = "Write the date in words. Reply with the date only."
SPLITS = ("train", "eval")
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
FIRST_DATE = dt.date(1900, 1, 1)
LAST_DATE = dt.date(2099, 12, 31)
# One date in 10 is held out for evaluation: ~7,300 eval dates and ~65,700 train dates.
_EVAL_PER_256 = 26


class GenerativeLM(Protocol):
    """What ``exact_match`` needs from a model: any ``*ForCausalLM`` (PreTrainedModel + GenerationMixin)."""

    training: bool

    @property
    def device(self) -> torch.device: ...

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


def split_of(date: dt.date) -> str:
    """Return the split a date belongs to, fixed by a hash of the date so splits never overlap.

    Args:
        date: A date in ``[FIRST_DATE, LAST_DATE]``.

    Returns:
        ``"eval"`` for about one date in ten, ``"train"`` otherwise.
    """
    # sha256 rather than hash(): Python's str hash is salted per process, the split must not be.
    first_byte = hashlib.sha256(date.isoformat().encode()).digest()[0]
    return "eval" if first_byte < _EVAL_PER_256 else "train"


def date_in_words(date: dt.date) -> str:
    """Return the exact answer for a date: day without leading zero, English month name, year.

    Args:
        date: The date to write.

    Returns:
        For example ``"5 March 2024"`` for ``2024-03-05``.
    """
    return f"{date.day} {MONTHS[date.month - 1]} {date.year}"


@functools.cache
def _dates_of(split: str) -> tuple[dt.date, ...]:
    # Cached: hashing all 73,000 dates costs ~0.2 s, and callers ask for both splits repeatedly.
    days = (LAST_DATE - FIRST_DATE).days + 1
    return tuple(d for d in (FIRST_DATE + dt.timedelta(days=i) for i in range(days)) if split_of(d) == split)


def _record(date: dt.date) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": date.isoformat()},
            {"role": "assistant", "content": date_in_words(date)},
        ]
    }


def make_task_records(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """Generate ``n`` distinct task records of one split.

    Args:
        n: Number of records; at most the number of dates in the split (~65,700 train, ~7,300 eval).
        seed: Seed of the sampling; the same ``(n, seed, split)`` always gives the same records.
        split: ``"train"`` or ``"eval"``. Splits never share a date, whatever the seeds.

    Returns:
        Records ``{"messages": [system, user, assistant]}``; the user turn is the ISO date and the
        assistant turn the exact answer.

    Raises:
        ValueError: If ``split`` is unknown or ``n`` is negative or larger than the split.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}; pass 'train' or 'eval'")
    pool = _dates_of(split)
    if not 0 <= n <= len(pool):
        raise ValueError(
            f"n={n} records requested but the {split!r} split holds {len(pool)} distinct dates "
            f"({FIRST_DATE} to {LAST_DATE}); ask for between 0 and {len(pool)}"
        )
    # A string seed keeps the two splits' streams independent; random.Random hashes it with
    # sha512, so it is stable across processes and Python versions.
    rng = random.Random(f"hf_fsdp2.tasks:{split}:{seed}")
    return [_record(date) for date in rng.sample(pool, n)]


def prompt_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Task records as GRPO prompts: ``{"prompt": [system, user], "answer": the exact answer}``."""
    return [{"prompt": r["messages"][:-1], "answer": r["messages"][-1]["content"]} for r in records]


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write records as JSON lines, creating parent folders.

    Args:
        records: JSON-serialisable dicts, one per line.
        path: Output file.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file written by ``write_jsonl`` (blank lines are skipped).

    Args:
        path: Input file.

    Returns:
        The records in file order.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If a line is not valid JSON (the message names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no such JSON-lines file: {path}; create one with `hf-fsdp2 demo-data OUT_DIR`"
        )
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{line_no} is not valid JSON ({e.msg}); fix or regenerate the file"
                ) from e
    return records


def _split_prompt_answer(record: dict[str, Any], index: int) -> tuple[list[dict[str, str]], str]:
    messages = record.get("messages")
    if not isinstance(messages, list) or len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise ValueError(
            f"record {index} must have 'messages' ending with an assistant turn (the expected answer), "
            f"got {str(record)[:200]}; records from make_task_records have this form"
        )
    return messages[:-1], str(messages[-1]["content"]).strip()


def exact_match(
    model: GenerativeLM,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int = 24,
    batch_size: int = 25,
) -> float:
    """Fraction of records whose greedy answer equals the expected answer exactly (after strip).

    The prompt is every turn but the last, rendered with the chat template and
    ``add_generation_prompt=True``; the last (assistant) turn is the expected answer.

    Args:
        model: A causal LM on its device, e.g. the one being trained.
        tokenizer: Its tokenizer, with a chat template and a pad token.
        records: Records in ``messages`` form whose last turn is the assistant's answer.
        max_new_tokens: Generation budget per answer; answers longer than this count as wrong.
        batch_size: Prompts generated together.

    Returns:
        Exact-match accuracy in ``[0, 1]``; 0.0 for no records.

    Raises:
        ValueError: If a record has no final assistant turn, the tokenizer has no pad token, or
            ``batch_size`` < 1.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no pad token, needed for batched generation; "
            "set tokenizer.pad_token = tokenizer.eos_token first"
        )
    if not records:
        return 0.0
    pairs = [_split_prompt_answer(record, i) for i, record in enumerate(records)]
    texts = [
        tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        for prompt, _ in pairs
    ]

    was_training = model.training
    padding_side = tokenizer.padding_side
    # Decoder-only generation appends after the last position: prompts must be padded on the left
    # so every row's answer starts right after its own prompt.
    tokenizer.padding_side = "left"
    model.eval()
    correct = 0
    try:
        for start in range(0, len(texts), batch_size):
            # The chat template already writes the special tokens; adding BOS again would shift prompts.
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(model.device)
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            for answer, (_, expected) in zip(answers, pairs[start : start + batch_size], strict=True):
                correct += answer.strip() == expected
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return correct / len(records)


def evaluate_folder(
    model_dir: str | Path,
    records: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int = 24,
    batch_size: int = 25,
) -> float:
    """Load an HF model folder with plain transformers (fp32, CPU) and score it with ``exact_match``.

    Args:
        model_dir: Folder with config, weights and tokenizer (e.g. a recipe's export).
        records: Records in ``messages`` form whose last turn is the expected answer.
        max_new_tokens: Generation budget per answer.
        batch_size: Prompts generated together.

    Returns:
        Exact-match accuracy in ``[0, 1]``.

    Raises:
        FileNotFoundError: If ``model_dir`` has no ``config.json``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} is not an HF model folder (no config.json); pass the folder a recipe exported "
            "or the one `hf-fsdp2 convert-smollm2` printed"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # fp32: CPUs here have no bf16 units (bf16 is slower) and fp32 makes scores reproducible.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **NO_HUB_KERNELS)
    return exact_match(model, tokenizer, records, max_new_tokens=max_new_tokens, batch_size=batch_size)


def wrong_answers(date: dt.date) -> tuple[str, ...]:
    """Answers to a date that are wrong in the ways a small model gets it wrong: the ISO date echoed, the US
    order, and the wrong month."""
    return (
        date.isoformat(),
        f"{MONTHS[date.month - 1]} {date.day}, {date.year}",
        f"{date.day} {MONTHS[date.month % 12]} {date.year}",
    )


def make_preference_records(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` preference pairs of the date task: the prompt (system and user turns), the exact answer as
    ``chosen``, one of :func:`wrong_answers` (seeded) as ``rejected``; dates drawn as in :func:`make_task_records`.
    """
    rng = random.Random(f"hf_fsdp2.tasks:preference:{split}:{seed}")
    out = []
    for record in make_task_records(n, seed, split):
        prompt, answer = record["messages"][:-1], record["messages"][-1]["content"]
        date = dt.date.fromisoformat(prompt[-1]["content"])
        out.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": rng.choice(wrong_answers(date))}],
            }
        )
    return out


def preference_win_rate(
    model: Any, tokenizer: PreTrainedTokenizerBase, records: Sequence[dict[str, Any]], *, batch_size: int = 16
) -> dict[str, float]:
    """How often ``model`` gives the preferred answer the higher log-probability (summed over its tokens).

    Returns:
        ``win_rate`` (fraction of pairs with ``log p(chosen) > log p(rejected)``), ``mean_margin`` (mean of
        ``log p(chosen) - log p(rejected)``) and ``n``.
    """
    import torch

    from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs
    from hf_fsdp2.train.logps import completion_logps
    from hf_fsdp2.train.loss import LossPlan

    pairs, _ = tokenize_pairs(records, tokenizer, max_length=10**6)
    collate = PreferenceCollator(pad_token_id=int(tokenizer.pad_token_id or 0), max_length=10**6)
    was_training = model.training
    model.eval()
    margins: list[float] = []
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                batch = collate(pairs[start : start + batch_size])
                inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask")}
                logps, _ = completion_logps(model, inputs, batch["labels"], LossPlan())
                b = logps.numel() // 2
                margins += (logps[:b] - logps[b:]).tolist()
    finally:
        model.train(was_training)
    n = len(margins)
    return {
        "win_rate": sum(m > 0 for m in margins) / max(n, 1),
        "mean_margin": sum(margins) / max(n, 1),
        "n": n,
    }


def reward_accuracy(
    model: Any, tokenizer: PreTrainedTokenizerBase, records: Sequence[dict[str, Any]], *, batch_size: int = 16
) -> dict[str, float]:
    """How often a reward model (one-label ``*ForSequenceClassification``) scores the preferred answer higher.

    Each row is the whole prompt + completion, tokenized as the reward recipe does; the reward is read at its last
    non-padding token (``model.config.pad_token_id``).

    Returns:
        ``accuracy`` (fraction of pairs with ``r(chosen) > r(rejected)``), ``mean_margin`` (mean of
        ``r(chosen) - r(rejected)``), ``mean_reward`` and ``n``.
    """
    import torch

    from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs

    pairs, _ = tokenize_pairs(records, tokenizer, max_length=10**6)
    collate = PreferenceCollator(pad_token_id=int(model.config.pad_token_id), max_length=10**6)
    was_training = model.training
    model.eval()
    margins: list[float] = []
    total = 0.0
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                batch = collate(pairs[start : start + batch_size])
                inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask")}
                rewards = model(**inputs).logits.squeeze(-1).float().cpu()
                b = rewards.numel() // 2
                margins += (rewards[:b] - rewards[b:]).tolist()
                total += float(rewards.sum())
    finally:
        model.train(was_training)
    n = len(margins)
    return {
        "accuracy": sum(m > 0 for m in margins) / max(n, 1),
        "mean_margin": sum(margins) / max(n, 1),
        "mean_reward": total / max(2 * n, 1),
        "n": n,
    }
