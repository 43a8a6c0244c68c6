"""Writing the consolidated HF folder: every rank writes its own shards, no rank gathers the model.

1. each rank takes its own shards of the parameters (``get_model_state_dict``, no all-gather), casts
   them to the export dtype and names them as the checkpoint format does (:mod:`.naming`);
2. ``torch.distributed.checkpoint.save`` with ``HuggingFaceStorageWriter(save_distributed=True)``:
   each rank writes its shards as safetensors part files, tagged with their offsets; fused expert
   tensors are split per expert on the rank that holds them and written as part files of the same form;
3. each rank assembles some of the final ``model-*.safetensors`` files from the part files on disk
   (file ``i`` by rank ``i % world``), copying one shard's bytes at a time;
4. verification (:mod:`.verify`) before anything is published.

Files are written to ``<out>/.export-incomplete`` and moved into place only once all of them are
complete and verified, the index (or the single weights file) last, so a crash or a failed
verification never leaves a folder that looks loadable but is not. A shared file system is assumed
across nodes, as for checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.generation import GenerationConfig

from hf_fsdp2 import collectives
from hf_fsdp2.dtypes import dtype_name
from hf_fsdp2.export.errors import ExportError, ExportInterrupted, ExportResult, ExportVerificationError
from hf_fsdp2.export.files import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Chunk,
    assemble_file,
    index_parts,
    nbytes,
    plan_files,
    write_part_file,
)
from hf_fsdp2.export.finite import check_finite
from hf_fsdp2.export.folder import write_record
from hf_fsdp2.export.plan import (
    ExportPlan,
    export_config,
    make_plan,
)
from hf_fsdp2.export.source import ExportSource, copy_side_files
from hf_fsdp2.model import auto_class_name
from hf_fsdp2.score_head import write_modeling_file

logger = logging.getLogger("hf_fsdp2")

STAGE_NAME = ".export-incomplete"
PARTS_NAME = ".parts"
MODEL_CARD_NAME = "README.md"
PART_BYTES = 256 * 2**20  # per rank and DCP save: bounds the writer's host memory (see _write_weights)


def run_on_all(phase: str, fn):  # type: ignore[no-untyped-def]
    """:func:`hf_fsdp2.collectives.run_on_all` raising :class:`ExportError` (collective)."""
    return collectives.run_on_all(phase, fn, ExportError)


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """DCP warns on every single-process save/load; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _write_weights(plan: ExportPlan, stage: Path) -> None:
    """Every rank: write its shards as part files, then assemble files i with i % world == rank.

    The shards go out in groups of about ``PART_BYTES`` per rank, one ``dcp.save`` each: DCP's
    safetensors writer builds each part file in memory, and a group is cast to the export dtype only
    when it is written, so the extra host memory of a rank stays near 2 x PART_BYTES whatever the
    model size (a single larger tensor shard is its own group). Fused expert tensors are converted and
    written one at a time, each rank its own experts.
    """
    parts = stage / PARTS_NAME
    sizes = {k: nbytes(plan.shapes[k], plan.dtypes[k]) for k in plan.sources}
    for index, keys in enumerate(plan_files(sizes, PART_BYTES * collectives.world()), start=1):

        def cast(keys: list[str] = keys) -> dict[str, torch.Tensor]:
            group = {k: plan.cast(k) for k in keys}
            check_finite(group, what="the model")  # a NaN verifies bit-exact against a NaN: refuse it here
            return group

        group = run_on_all(f"casting part {index}", cast)
        writer = HuggingFaceStorageWriter(
            path=str(parts), fqn_to_index_mapping=dict.fromkeys(keys, index), save_distributed=True
        )

        def save(group: dict[str, torch.Tensor] = group, writer: HuggingFaceStorageWriter = writer) -> None:
            with single_process_dcp():  # collective: every rank writes its own shards of the group
                dcp.save(group, storage_writer=writer, no_dist=not dist.is_initialized())

        run_on_all(f"writing part {index} of each rank's shards", save)
        del group
    for number, name in enumerate(plan.expert_sources):

        def write_experts(name: str = name, number: int = number) -> None:
            experts = plan.local_experts(name)
            check_finite(experts, what="the model")
            if experts:
                parts.mkdir(parents=True, exist_ok=True)
                path = parts / f"experts-{number:05d}-rank{collectives.rank():05d}.safetensors"
                write_part_file(path, {k: (v, [0] * v.dim()) for k, v in experts.items()})

        run_on_all(f"writing the experts of {name}", write_experts)

    def assemble() -> None:
        chunks = index_parts(parts)
        # A carried tensor is one whole chunk of a source file: its bytes are copied as they are (no torch, no
        # gather, the source's dtype).
        for key, tensor in plan.carried_tensors.items():
            chunks[key] = [
                Chunk(
                    path=tensor.path,
                    start=tensor.start,
                    offsets=[0] * len(tensor.shape),
                    shape=list(tensor.shape),
                    dtype=tensor.dtype,
                )
            ]
        for i, (name, keys) in enumerate(zip(plan.names, plan.files, strict=True)):
            if i % collectives.world() == collectives.rank():
                assemble_file(stage / name, keys, plan.shapes, plan.dtypes, chunks)

    run_on_all("assembling the safetensors files", assemble)


def _write_metadata(
    plan: ExportPlan,
    stage: Path,
    *,
    config: PretrainedConfig,
    architecture: str,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    model_card: str | None,
    source: ExportSource | None,
) -> None:
    """Rank 0: index, config (dtype and inference defaults), generation config, tokenizer, the source checkpoint's
    processor and chat-template files, card."""
    shutil.rmtree(stage / PARTS_NAME, ignore_errors=True)
    if len(plan.files) > 1:
        weight_map = {k: name for name, keys in zip(plan.names, plan.files, strict=True) for k in keys}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    saved = export_config(config, plan.weights_dtype, architecture)
    saved.save_pretrained(stage)
    write_modeling_file(saved, stage)  # a score head transformers lacks: its class, named in config.auto_map
    # A reward model cannot generate: none, as transformers; a causal LM and a composite do.
    if auto_class_name(saved) != "AutoModelForSequenceClassification":
        gen = generation_config or GenerationConfig.from_model_config(config)
        gen.save_pretrained(stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    if source is not None:
        copied = copy_side_files(source, stage)
        if copied:
            logger.info("export: copied %s from %s", ", ".join(copied), source.name_or_path)
    if model_card is not None:
        (stage / MODEL_CARD_NAME).write_text(model_card)


def publish(stage: Path, out: Path, first: str, *, stale: str | None = "model*.safetensors") -> None:
    """Rank 0: move the staged files into ``out``; ``first`` (the file a loader opens first) goes last.

    Files matching ``stale`` that the new export does not have are removed first, with ``first`` and the
    index, so the folder never points at a mix of old and new files.
    """
    names = {p.name for p in stage.iterdir()}
    for old in (out / INDEX_NAME, out / WEIGHTS_NAME, out / first):
        if old.is_file():
            old.unlink()
    for old in out.glob(stale) if stale else ():
        if old.name not in names:
            old.unlink()
    for item in sorted(stage.iterdir(), key=lambda p: p.name == first):
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)
    stage.rmdir()


def _write_failure(error: str, out: Path, stage: Path, export_bytes: int) -> ExportError:
    """Every rank: the failure of a write phase in one line (DCP's message holds every rank's traceback); a full
    disk named as such, with what the staging folder held, and the folder removed so that its space can hold the
    checkpoint that keeps the trained weights (collective)."""
    from hf_fsdp2.checkpoint.checkpointer import gist
    from hf_fsdp2.checkpoint.space import folder_bytes, free_bytes, says_out_of_space, size_text

    staged = folder_bytes(stage)
    # The parts (every rank's shards) and the files assembled from them are on disk together: about twice the export.
    full = says_out_of_space(error) or free_bytes(out) < 2 * export_bytes
    run_on_all(  # every rank has measured the folder before rank 0 removes it
        "removing the staging folder",
        lambda: shutil.rmtree(stage, ignore_errors=True) if full and collectives.rank() == 0 else None,
    )
    if not full:
        return ExportError(f"{gist(error)}; the partial export is left in {stage}")
    return ExportError(
        f"disk full during the export (ENOSPC, no space left on device): {gist(error)}. The disk of {out} has "
        f"{size_text(free_bytes(out))} free now; the staging folder {stage} held {size_text(staged)} when it filled "
        f"and was removed; the export needs about {size_text(2 * export_bytes)} while it is written ({size_text(export_bytes)} "
        f"of safetensors files, plus each rank's parts until they are assembled). Free space on that disk (or export "
        "to another one), then export again"
    )


def check_export_dir(out_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse to export into a folder that holds anything, unless asked to overwrite.

    Raises:
        ExportError: the path is a file, or a non-empty folder and ``overwrite`` is off.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder; choose another OUT_DIR")
    if out.is_dir() and any(p.name != STAGE_NAME for p in out.iterdir()) and not overwrite:
        found = sorted(p.name for p in out.iterdir())[:5]
        raise ExportError(
            f"{out} is not empty ({', '.join(found)}, ...); choose an empty or new OUT_DIR, or pass --overwrite "
            "to replace the export files in it"
        )


def export_model(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: GenerationConfig | None,
    dtype: str,
    max_shard_bytes: int,
    model_card: str | None = None,
    verify: bool = True,
    verify_atol: float | None = None,
    compute_dtype: torch.dtype | None = None,
    source: ExportSource | None = None,
) -> ExportResult:
    """Write, verify and publish the consolidated HF folder of a (sharded) model; no rank gathers it.

    Every rank must call it (collective); a failure on any rank raises on every rank.

    Args:
        model: the FSDP2-sharded model (or a plain one in a single process).
        out_dir: the folder; export files already there are replaced, other files are kept.
        config: model config; config.json states the export dtype and ``use_cache: true``.
        tokenizer: saved alongside (chat template included) when given.
        generation_config: saved as generation_config.json (derived from the config when None).
        dtype: ``bfloat16``, ``float32``, ``float16`` or ``training`` (the dtype the weights have).
        max_shard_bytes: largest safetensors file (a single larger tensor gets its own file).
        model_card: README.md text (see ``hf_fsdp2.export.card.render_model_card``), or None for none.
        verify: check the folder before publishing it (see :func:`hf_fsdp2.export.verify.verify_export`).
        verify_atol: probe-logit limit (absolute); None = :func:`hf_fsdp2.export.probe.probe_limit`.
        compute_dtype: dtype the live model computes in (bf16 under mixed precision); None = its weights'.
        source: the checkpoint the model was loaded from (``model_name_or_path``): what did not train (a
            composite's frozen tower and projector) and what the class does not load (``mtp.*``) are copied from its
            files byte for byte, the export must hold every one of its tensors, and its processor and chat-template
            files are copied; None: every tensor from the shards (a model built in code).

    Returns:
        The published folder's description (the same on every rank).

    Raises:
        ExportError: writing failed (the previous export, if any, is left as it was).
        ExportVerificationError: the written folder does not reproduce the model; nothing is published.
        ValueError: an unknown dtype.
    """
    from hf_fsdp2.export.verify import verify_export

    start = time.perf_counter()
    out = Path(out_dir)
    stage = out / STAGE_NAME
    plan = run_on_all("planning the files", lambda: make_plan(model, dtype, max_shard_bytes, source=source))
    carried = (
        plan.carried.summary(plan.weights_dtype if dtype != "training" else None) if plan.carried else ""
    )
    if carried:
        logger.info("%s", carried)

    def prepare() -> None:
        if collectives.rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            if stage.exists():
                shutil.rmtree(stage)
            stage.mkdir()

    run_on_all("preparing the staging folder", prepare)
    architecture = type(model).__name__.removeprefix("FSDP")

    def metadata() -> None:
        if collectives.rank() == 0:
            _write_metadata(
                plan,
                stage,
                config=config,
                architecture=architecture,
                tokenizer=tokenizer,
                generation_config=generation_config,
                model_card=model_card,
                source=source,
            )

    try:
        _write_weights(plan, stage)
        run_on_all("writing config, tokenizer and index", metadata)
    except ExportError as err:  # raised on every rank (run_on_all)
        raise _write_failure(str(err), out, stage, plan.total_bytes) from None
    report = None
    if verify:
        try:
            report = verify_export(model, stage, plan=plan, atol=verify_atol, compute_dtype=compute_dtype)
        except ExportVerificationError as err:
            raise ExportVerificationError(
                f"{err}. Nothing was published: {out} is as it was; the rejected files are kept in {stage}"
            ) from None
        except ExportInterrupted as err:
            raise ExportInterrupted(f"{err}. Nothing was published: {out} is as it was") from None
        logger.info("export %s", report.summary())
    first = INDEX_NAME if len(plan.names) > 1 else WEIGHTS_NAME

    def publish_verified() -> None:
        if collectives.rank() == 0:  # the record of the verification goes out with the files (push checks it)
            write_record(stage, verified=report.summary() if report else None)
            publish(stage, out, first)

    run_on_all("publishing", publish_verified)
    seconds = time.perf_counter() - start
    logger.info(
        "exported %d file(s), %.1f MB in %s, to %s in %.1fs",
        len(plan.names),
        plan.total_bytes / 1e6,
        dtype_name(plan.weights_dtype),
        out,
        seconds,
    )
    return ExportResult(
        out_dir=out,
        files=plan.names,
        total_bytes=plan.total_bytes,
        dtype=dtype_name(plan.weights_dtype),
        seconds=seconds,
        verify=report,
    )
