"""The model card of an export (README.md): hub metadata, what was trained how, the last metrics, how to load it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hf_fsdp2.config.plans import repo_id_problem

_CARD_KEYS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "warmup_steps",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "mixed_precision",
    "fsdp_reduce_dtype",
    "gradient_checkpointing",
    "assistant_only_loss",
    "completion_only_loss",
    "export_dtype",
)
_SECRET_KEYS = ("hub_token",)


_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow", ".gz", ".zst")


def _looks_like_hub_id(name: str | None) -> bool:
    """A hub id the card's metadata may name (the hub rejects local paths there)."""
    if not name or name.startswith((".", "/", "~")) or name.endswith(_DATA_SUFFIXES):
        return False
    if Path(name).expanduser().exists():
        return False
    return repo_id_problem(name) is None and name.count("/") == 1


def render_model_card(
    run_config: dict[str, Any],
    *,
    metrics: dict[str, Any] | None,
    world_size: int | None = None,
    recipe: str = "sft",
    recipe_title: str | None = None,
    repo_id: str | None = None,
    reward: bool = False,
    remote_code: bool = False,
    learned_nothing: Sequence[str] = (),
    image_text: bool = False,
    restarts: Sequence[Mapping[str, Any]] = (),
) -> str:
    """README.md of an export: hub metadata (front matter), what was trained how, metrics, how to load.

    Args:
        run_config: the resolved config (flat dict, as in hf_fsdp2_config.yaml); hub_token is never shown.
        metrics: the last metrics.jsonl record, or None.
        world_size: ranks the run used, when known.
        recipe: the training method's name (its script is ``recipes/<recipe>.py``; a tag of the card).
        recipe_title: what the method is, in a few words (:attr:`hf_fsdp2.run.method.Method.title`); default
            the name.
        repo_id: hub repo the card is for; the load command uses it (else a local path).
        reward: a reward model (one-label sequence classification): its tags and how to score with it.
        remote_code: its class is the folder's modeling_score_head.py (loaded with ``trust_remote_code=True``).
        learned_nothing: the run's collapses and steps without a learning signal (their log lines), when it went on
            past them (``on_collapse: warn``): a warning at the top of the card.
        image_text: a composite checkpoint (vision tower + projector + language model): its pipeline, which parts
            trained, and how to load it with ``AutoModelForImageTextToText``.
        restarts: the run's restarts (``restarts.json`` entries): a section listing each one's cause.

    Returns:
        The card's text.
    """
    from huggingface_hub import ModelCardData

    base = run_config.get("model_name_or_path")
    data = run_config.get("dataset_name")
    data_kwargs: dict[str, Any] = {}
    if _looks_like_hub_id(base):
        data_kwargs["base_model"] = base
    if _looks_like_hub_id(data):
        data_kwargs["datasets"] = [data]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-classification"
        if reward
        else "image-text-to-text"
        if image_text
        else "text-generation",
        tags=["hf_fsdp2", "fsdp2", *(["reward-model"] if reward else []), recipe, "safetensors"],
        **data_kwargs,
    )
    target = repo_id or "path/to/this/folder"
    lines = [
        "---",
        card_data.to_yaml(),
        "---",
        "",
        f"# {repo_id.split('/')[-1] if repo_id else Path(str(run_config.get('output_dir') or 'model')).name}",
        "",
        f"Fine-tuned from `{base}` on `{data}` with hf_fsdp2 `recipes/{recipe}.py` "
        f"({recipe_title or recipe}, FSDP2{f' on {world_size} ranks' if world_size else ''}).",
        "",
    ]
    if image_text:
        kept = [
            part
            for part, key in (
                ("vision tower", "freeze_vision_tower"),
                ("multi-modal projector", "freeze_multi_modal_projector"),
            )
            if run_config.get(key, True)
        ]
        lines += [
            "Its language model was fine-tuned; "
            + (
                f"the {' and the '.join(kept)} are the base model's, byte for byte (frozen)."
                if kept
                else "the vision tower and the projector were trained too."
            ),
            "",
        ]
    if learned_nothing:  # said before anything else: the model below is not a trained one
        lines += ["## Warning: this run learned nothing", ""]
        lines += [f"- {line}" for line in learned_nothing]
        lines += [
            "",
            "The run went on past it (`on_collapse: warn`): see metrics.jsonl before using this model.",
            "",
        ]
    lines += [
        "## Hyper-parameters",
        "",
        "| key | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | `{run_config[k]}` |" for k in _CARD_KEYS if run_config.get(k) is not None]
    resolved = {k: v for k, v in run_config.items() if k not in _SECRET_KEYS}
    lines += [
        "",
        "<details><summary>Full resolved config (hf_fsdp2_config.yaml)</summary>",
        "",
        "```yaml",
        yaml.safe_dump(resolved, sort_keys=False).rstrip(),
        "```",
        "",
        "</details>",
        "",
    ]
    if restarts:  # the run got to its end through restarts: each resumed from its newest checkpoint
        lines += [
            "## Restarts",
            "",
            f"The run was restarted {len(restarts)} time(s) by torch's elastic agent; each restart resumed from "
            "the newest checkpoint (the same steps, in the same order, as a run without them):",
            "",
            "| restart | ended at step | cause | resumed from step | steps lost |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r.get('restart') or r.get('launch')} | {r.get('step')} | {str(r.get('cause')).replace('|', '/')} | "
            f"{r.get('resumed_from_step') or 'start'} | {r.get('steps_lost')} |"
            for r in restarts
        ]
        lines.append("")
    lines += ["## Final metrics", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [
            f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()
        ]
    else:
        lines.append("No metrics were recorded.")
    if reward:  # the score of a whole conversation, read at its last token
        lines += [
            "",
            "## Load",
            "",
            "```python",
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer",
            "",
            f'model = AutoModelForSequenceClassification.from_pretrained("{target}"'
            f"{', trust_remote_code=True' if remote_code else ''})",
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
            'messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi!"}]',
            "inputs = tokenizer.apply_chat_template(messages, return_tensors='pt', return_dict=True)",
            "print(model(**inputs).logits[0, 0].item())  # the reward",
            "```",
            "",
        ]
        return "\n".join(lines)
    auto = "AutoModelForImageTextToText" if image_text else "AutoModelForCausalLM"
    lines += [
        "",
        "## Load",
        "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        f'model = {auto}.from_pretrained("{target}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        'messages = [{"role": "user", "content": "Hello!"}]',
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors='pt', return_dict=True)",
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))",
        "```",
        "",
    ]
    return "\n".join(lines)
