"""The local harness tasks computed directly with transformers: what lm-eval's numbers are checked against."""

from __future__ import annotations

from typing import Any

import torch

from hf_fsdp2.demo.tasks import SYSTEM_PROMPT
from hf_fsdp2.harness.tasks import MAX_GEN_TOKS, date_items, item_prompt


def chat_prompt(tokenizer: Any, item: dict[str, Any]) -> str:
    """The item's prompt: the task's description as the system turn, the date as the user's, then the assistant's
    header."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item_prompt(item)}]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


@torch.no_grad()
def direct_scores(model: Any, tokenizer: Any, n: int) -> dict[str, Any]:
    """Exact match of greedy answers (cut at a newline or the end-of-turn token, as ``until`` does) and accuracy of
    the choice with the highest summed log-likelihood, over the first ``n`` local items, one item at a time.

    Returns:
        ``{"exact_match": ..., "acc": ..., "answers": [...], "logliks": [[per choice] per item]}``.
    """
    model.eval()
    items = date_items(n)
    answers, logliks, hits, correct = [], [], 0, 0
    for item in items:
        prompt = chat_prompt(tokenizer, item)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        new = out[0, ids.shape[1] :].tolist()
        new = new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new
        answer = tokenizer.decode(new, skip_special_tokens=True).split("\n")[0]
        answers.append(answer)
        hits += answer == item["answer"]
        # lm-eval moves the context's trailing whitespace into the continuation, then splits the whole encoding.
        context = prompt.rstrip()
        row = []
        for choice in item["choices"]:
            whole = tokenizer(context + prompt[len(context) :] + choice).input_ids
            n_ctx = len(tokenizer(context).input_ids)
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            row.append(sum(float(logp[i - 1, whole[i]]) for i in range(n_ctx, len(whole))))
        logliks.append(row)
        correct += max(range(len(row)), key=row.__getitem__) == item["label"]
    return {"exact_match": hits / n, "acc": correct / n, "answers": answers, "logliks": logliks}


def harness_logliks(samples: list[dict[str, Any]]) -> list[list[float]]:
    """Per item (in doc order), lm-eval's log-likelihood of each choice."""
    ordered = sorted(samples, key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in ordered]


def harness_answers(samples: list[dict[str, Any]]) -> list[str]:
    """Per item (in doc order), lm-eval's generated answer after its filters."""
    return [str(s["filtered_resps"][0]) for s in sorted(samples, key=lambda s: s["doc_id"])]
