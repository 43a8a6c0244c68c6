"""Local lm-evaluation-harness tasks: the demo's date task in lm-eval's own task YAML format over jsonl data.

Nothing here reaches the hub: :func:`write_local_tasks` writes two task files and their data into a folder that
lm-eval's ``TaskManager(include_path=...)`` reads, exactly as it reads the tasks it ships:

- ``hf_fsdp2_dates`` (``generate_until``): the ISO date in, the date in words out; greedy, exact match.
- ``hf_fsdp2_dates_mc`` (``multiple_choice``): the same prompt and four answers (the right one and the three
  mistakes of :func:`hf_fsdp2.demo.tasks.wrong_answers`); ``acc`` is the share of items whose right answer has the
  highest summed log-likelihood.

The task's instruction is the YAML's ``description``: with ``apply_chat_template`` lm-eval makes it the system
turn, so the prompt is the one the demo trains on (:data:`hf_fsdp2.demo.tasks.SYSTEM_PROMPT`, then the date).
The items are held-out dates (the demo's ``eval`` split), never seen in training.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path
from typing import Any

from hf_fsdp2.demo.tasks import SYSTEM_PROMPT, date_in_words, make_task_records, wrong_answers

DATES_TASK = "hf_fsdp2_dates"
DATES_MC_TASK = "hf_fsdp2_dates_mc"
LOCAL_TASKS = (DATES_TASK, DATES_MC_TASK)
# Answers are ~7 SmolLM2 tokens ("14 November 2031") and the turn's end; more would only cost time.
MAX_GEN_TOKS = 12


def date_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` held-out date items: the date's parts, its answer, four shuffled choices and the right one's index.

    The date is stored as ``year``/``month``/``day`` strings and joined by the task's template: a whole ISO date in
    a jsonl column would be read back by the ``json`` dataset loader (pyarrow) as a timestamp,
    ``2064-03-04 00:00:00``.

    Args:
        n: number of items (at most the ~7,300 dates of the demo's eval split).
        seed: which dates (the same ``(n, seed)`` always gives the same items).

    Returns:
        One dict per item: ``year``, ``month``, ``day``, ``answer``, ``choices``, ``label``.
    """
    items = []
    for i, record in enumerate(make_task_records(n, seed, "eval")):
        date = dt.date.fromisoformat(record["messages"][1]["content"])
        answer = date_in_words(date)
        choices = [answer, *wrong_answers(date)]
        random.Random(f"hf_fsdp2.harness:{seed}:{i}").shuffle(choices)
        items.append(
            {
                "year": f"{date.year:04d}",
                "month": f"{date.month:02d}",
                "day": f"{date.day:02d}",
                "answer": answer,
                "choices": choices,
                "label": choices.index(answer),
            }
        )
    return items


def item_prompt(item: dict[str, Any]) -> str:
    """The user turn of an item, as the task's ``doc_to_text`` renders it (the ISO date)."""
    return f"{item['year']}-{item['month']}-{item['day']}"


def _task_yaml(name: str, data: Path, kind: str) -> str:
    # json.dumps quotes every string as YAML accepts it (YAML is a superset of JSON).
    head = [
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
        f"output_type: {kind}",
        f"description: {json.dumps(SYSTEM_PROMPT)}",
        'doc_to_text: "{{year}}-{{month}}-{{day}}"',
    ]
    if kind == "generate_until":
        body = [
            'doc_to_target: "{{answer}}"',
            "generation_kwargs:",
            '  until: ["\\n"]',
            "  do_sample: false",
            f"  max_gen_toks: {MAX_GEN_TOKS}",
            "metric_list:",
            "  - metric: exact_match",
            "    aggregation: mean",
            "    higher_is_better: true",
            # vLLM detokenizes a completion in its prompt's context, so a SentencePiece tokenizer's first token keeps
            # its space (" June 3, 2024"); transformers decodes the completion alone and drops it: both score alike.
            '    regexes_to_ignore: ["^\\\\s+"]',
        ]
    else:
        body = [
            'doc_to_choice: "{{choices}}"',
            "doc_to_target: label",
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
        ]
    return "\n".join([*head, *body, "metadata:", "  version: 1.0", ""])


def write_local_tasks(folder: str | Path, *, n: int = 8, seed: int = 0) -> Path:
    """Write the local tasks (:data:`LOCAL_TASKS`) and their jsonl data into ``folder``.

    Args:
        folder: where to write (created); give it to lm-eval as ``include_path``.
        n: items per task.
        seed: which dates.

    Returns:
        The folder.
    """
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "hf_fsdp2_dates.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in date_items(n, seed)))
    (out / f"{DATES_TASK}.yaml").write_text(_task_yaml(DATES_TASK, data, "generate_until"))
    (out / f"{DATES_MC_TASK}.yaml").write_text(_task_yaml(DATES_MC_TASK, data, "multiple_choice"))
    return out
