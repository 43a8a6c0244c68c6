"""Benchmarks with lm-evaluation-harness (``hf-fsdp2 eval-harness``, a recipe's ``eval_harness_tasks``).

``models``: what is evaluated (an export, a LoRA adapter over its base, a checkpoint exported on the fly);
``tasks``: the local task files (lm-eval's YAML over jsonl, nothing from the hub); ``run``: lm-eval itself and the
backend (vLLM where it imports, else transformers); ``report``: the JSON, the (before/after) table and the model
card section; ``evaluate``: all of it as one function. lm-eval is optional: ``pip install 'hf_fsdp2[eval]'``.
"""
