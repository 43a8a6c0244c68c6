"""Offline export: a sharded training checkpoint -> the same consolidated folder, in one process."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hf_fsdp2.export.errors import ExportError, ExportResult
from hf_fsdp2.export.source import ExportSource, locate, read_tensor, weight_map
from hf_fsdp2.export.writer import check_export_dir, export_model, single_process_dcp


def load_checkpoint_model(
    checkpoint: str | Path, *, wrap: Callable[[Any, dict[str, Any], int], Any] | None = None
) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """Build the run's model from its config and fill it with a checkpoint's weights (one process).

    The architecture, tokenizer and base files come from ``model_name_or_path`` in the checkpoint's
    ``hf_fsdp2_config.yaml``; the weights, in the dtype they were trained in, from its DCP shards.

    Args:
        checkpoint: a ``checkpoint-<step>`` folder.
        wrap: turns the base model into the trained one before loading (a LoRA run's PEFT wrapping, after its
            4-bit quantisation for QLoRA), given the model, the run's config and its world size. The frozen base
            is then read from the model folder (a checkpoint holds what trains); without ``wrap`` every weight
            comes from the checkpoint.

    Returns:
        (model, the run's resolved config, the checkpoint's step).

    Raises:
        ExportError: an incomplete checkpoint, or one whose tensors do not fit the named model.
    """
    import yaml
    from accelerate.utils import set_module_tensor_to_device

    from hf_fsdp2.checkpoint.layout import CONFIG_FILE, STATE_FILE
    from hf_fsdp2.checkpoint.resume import checkpoint_problems
    from hf_fsdp2.model import load_model

    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise ExportError(
            f"{checkpoint}: no such checkpoint folder; give a <output_dir>/checkpoint-<step> folder"
        )
    missing = [n for n in (".metadata", STATE_FILE, CONFIG_FILE) if not (ckpt / n).is_file()]
    if missing:
        raise ExportError(
            f"{ckpt} is incomplete (no {', '.join(missing)}): its save was interrupted or it is not an hf_fsdp2 "
            "checkpoint; export an earlier checkpoint-<step> of the run"
        )
    problems = checkpoint_problems(ckpt)  # sizes, then every file's digest against its manifest.json
    if problems:
        raise ExportError(
            f"{ckpt} is damaged: {'; '.join(problems[:3])}. Its weights cannot be trusted: export an earlier "
            "checkpoint-<step> of the run (or restore the file from a copy)"
        )
    cfg = yaml.safe_load((ckpt / CONFIG_FILE).read_text())
    trainer_state = json.loads((ckpt / STATE_FILE).read_text())
    step = int(trainer_state.get("step", 0))
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    stored = {k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.")}
    # A reward model's checkpoint holds its score head (in full, or as PEFT's modules_to_save copy).
    reward_head = None
    if any(k == "score.weight" or ".score.modules_to_save." in k for k in stored):
        from hf_fsdp2.model import load_tokenizer

        name = cfg.get("tokenizer_name_or_path") or cfg["model_name_or_path"]
        reward_head = int(
            load_tokenizer(
                name, revision=cfg.get("model_revision"), trust_remote_code=bool(cfg.get("trust_remote_code"))
            ).pad_token_id
        )
    model: Any = load_model(
        cfg["model_name_or_path"],
        # A LoRA run's frozen base as the run loaded it (``wrap`` upcasts it for the fp32 export); full
        # fine-tuning: fp32, every value comes from the checkpoint.
        dtype=(cfg.get("torch_dtype") or "auto") if wrap is not None else "float32",
        attn_implementation=cfg.get("attn_implementation") or "auto",
        revision=cfg.get("model_revision"),
        trust_remote_code=bool(cfg.get("trust_remote_code")),
        # Full fine-tuning: parameters on meta, the checkpoint fills them (nothing is read twice). LoRA: the
        # frozen base from the folder, as the run loaded it; the checkpoint holds the adapter.
        empty_weights=wrap is None,
        reward_head=reward_head,
    )
    # A composite's frozen tower and projector are not in the checkpoint (it holds what trains): the parts the run
    # froze are frozen here alike and read from the model folder; the export carries them from its files.
    frozen = freeze_as_run(model, cfg)
    if wrap is not None:
        model = wrap(model, cfg, int(trainer_state.get("world_size") or 1))
    if cfg.get("resize_token_embeddings"):  # the run grew the embedding to its tokenizer: do the same
        emb = model.get_input_embeddings().weight
        emb_name = next(n for n, p in model.named_parameters() if p is emb)
        rows = tuple(getattr(stored.get(emb_name), "size", ()))[:1]
        if rows and rows[0] != emb.shape[0]:
            model.resize_token_embeddings(rows[0])
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(getattr(v, "size", ())) for k, v in stored.items()}
    # What the checkpoint must hold: every tensor, or (LoRA) what trains; an older LoRA checkpoint also holds the base.
    required = (
        set(expected) - set(frozen)
        if wrap is None
        else {n for n, p in model.named_parameters() if p.requires_grad}
    )
    absent = sorted(required - set(got))
    foreign = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if absent or foreign or wrong:
        details = []
        if absent:
            details.append(f"the model has {len(absent)} tensors the checkpoint lacks (e.g. {absent[:3]})")
        if foreign:
            details.append(f"the checkpoint has {len(foreign)} the model lacks (e.g. {foreign[:3]})")
        if wrong:
            details.append(
                f"shapes differ for {len(wrong)} (e.g. {wrong[0]}: model {expected[wrong[0]]}, checkpoint {got[wrong[0]]})"
            )
        raise ExportError(
            f"{ckpt} does not hold weights of {cfg['model_name_or_path']!r} (the model named in its {CONFIG_FILE}): "
            + "; ".join(details)
            + ". Is it a checkpoint of another run, or was that config edited?"
        )
    if frozen and wrap is None:  # on meta so far (nothing read): the source's values
        fill_from_source(model, frozen, ExportSource(cfg["model_name_or_path"], cfg.get("model_revision")))
    for name, param in list(model.named_parameters()):
        if name not in stored or name in frozen:  # the frozen base, read from the folder
            continue
        dtype = getattr(getattr(stored[name], "properties", None), "dtype", None) or torch.float32
        set_module_tensor_to_device(model, name, "cpu", value=torch.empty(param.shape, dtype=dtype))
    model.tie_weights()
    state = {k: v for k, v in model.state_dict().items() if k in stored}
    with single_process_dcp():
        dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    model.eval()
    return model, cfg, step


def freeze_as_run(model: Any, cfg: dict[str, Any]) -> list[str]:
    """Freeze a composite's vision tower and projector as the run did (its ``freeze_vision_tower`` /
    ``freeze_multi_modal_projector``, true when its config predates them); the parameter names frozen (none for a
    text model)."""
    from hf_fsdp2.composite import composite_spec, freeze_parts

    spec = composite_spec(model.config)
    if spec is None:
        return []
    return freeze_parts(
        model,
        spec,
        freeze_vision_tower=bool(cfg.get("freeze_vision_tower", True)),
        freeze_multi_modal_projector=bool(cfg.get("freeze_multi_modal_projector", True)),
    )


def fill_from_source(model: Any, names: list[str], source: ExportSource) -> None:
    """Give the named parameters (on the meta device) the source checkpoint's values, in its dtype: a frozen part
    the checkpoint does not hold.

    Raises:
        ExportError: a tensor the source does not hold under the name the model's conversions give it.
    """
    from accelerate.utils import set_module_tensor_to_device

    from hf_fsdp2.export.naming import checkpoint_layout

    params = dict(model.named_parameters())
    layout = checkpoint_layout(model, {n: tuple(params[n].shape) for n in names})
    files = weight_map(source) or {}
    lacking = sorted(layout.renames[n] for n in names if layout.renames.get(n) not in files)
    if lacking or layout.splits:
        raise ExportError(
            f"{source.name_or_path} does not hold the frozen tensors {(lacking or sorted(layout.splits))[:3]} "
            "under their checkpoint names; export from the model folder the run was trained from"
        )
    found = locate(source, [layout.renames[n] for n in names], files)
    for name in names:
        value = read_tensor(found[layout.renames[name]])
        set_module_tensor_to_device(model, name, "cpu", value=value)


@dataclass(kw_only=True)
class OfflineExport:
    """What an offline export writes: the checkpoint's model and the run's files beside it."""

    model: Any
    cfg: dict[str, Any]
    out: Path
    tokenizer: Any
    generation_config: Any
    card: str
    dtype: str
    max_shard_bytes: int
    source: ExportSource  # the model folder the run started from (what did not train is carried from it)


def prepare_offline_export(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None,
    max_shard_bytes: int | None,
    overwrite: bool,
    metrics: dict[str, Any] | None = None,
    wrap: Callable[[Any, dict[str, Any], int], Any] | None = None,
) -> OfflineExport:
    """Check the folders, rebuild the checkpoint's model, and gather the run's tokenizer, generation
    config and model card (one process). ``metrics``: the run's last logged figures for the card (the
    caller reads them: :func:`hf_fsdp2.observe.logs.last_metrics`), or None.

    Raises:
        ExportError: under a multi-process launcher, a non-empty ``out_dir``, ``out_dir`` inside the
            checkpoint, or an incomplete or foreign checkpoint.
    """
    from transformers import GenerationConfig

    from hf_fsdp2.composite import composite_spec
    from hf_fsdp2.config import parse_size
    from hf_fsdp2.export.card import render_model_card
    from hf_fsdp2.model import auto_class_name, load_tokenizer
    from hf_fsdp2.score_head import carries_score_head

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExportError(
            "hf-fsdp2 export runs as one process (it needs no GPU and no process group); run it without "
            "torchrun / accelerate launch"
        )
    out = Path(out_dir).expanduser()
    check_export_dir(out, overwrite=overwrite)
    ckpt = Path(checkpoint).expanduser()
    if ckpt.resolve() == out.resolve() or ckpt.resolve() in out.resolve().parents:
        raise ExportError(f"OUT_DIR {out} is inside the checkpoint {ckpt}; choose a folder outside it")
    model, cfg, _ = load_checkpoint_model(ckpt, wrap=wrap)
    name = cfg.get("tokenizer_name_or_path") or cfg["model_name_or_path"]
    tokenizer = load_tokenizer(
        name, revision=cfg.get("model_revision"), trust_remote_code=bool(cfg.get("trust_remote_code"))
    )
    try:
        generation_config = GenerationConfig.from_pretrained(
            cfg["model_name_or_path"], revision=cfg.get("model_revision") or "main"
        )
    except OSError:  # the base model has no generation_config.json: derive one, as transformers does
        generation_config = None
    card_cfg = dict(cfg)
    card_cfg["export_dtype"] = dtype or cfg.get("export_dtype", "bfloat16")
    world = json.loads((ckpt / "trainer_state.json").read_text()).get("world_size")
    reward = auto_class_name(model.config) == "AutoModelForSequenceClassification"
    card = render_model_card(
        card_cfg,
        metrics=metrics,
        world_size=world,
        reward=reward,
        recipe="rm" if reward else "sft",
        recipe_title="reward modelling" if reward else "supervised fine-tuning",
        remote_code=carries_score_head(model.config),
        image_text=composite_spec(model.config) is not None,
    )
    return OfflineExport(
        model=model,
        cfg=cfg,
        out=out,
        tokenizer=tokenizer,
        generation_config=generation_config,
        card=card,
        dtype=card_cfg["export_dtype"],
        max_shard_bytes=max_shard_bytes or parse_size(str(cfg.get("max_shard_size", "5GB"))),
        source=ExportSource(cfg["model_name_or_path"], cfg.get("model_revision")),
    )


# How an offline export writes a prepared job: (job, verify, verify_atol) -> the published folder.
OfflineWriter = Callable[[OfflineExport, bool, float | None], ExportResult]


def write_full_model(job: OfflineExport, verify: bool, verify_atol: float | None) -> ExportResult:
    """A full-model run's consolidated folder, written and verified as at the end of training (verification
    computes in the weights' dtype)."""
    return export_model(
        job.model,
        job.out,
        config=job.model.config,
        tokenizer=job.tokenizer,
        generation_config=job.generation_config,
        dtype=job.dtype,
        max_shard_bytes=job.max_shard_bytes,
        model_card=job.card,
        verify=verify,
        verify_atol=verify_atol,
        source=job.source,
    )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    verify: bool = True,
    verify_atol: float | None = None,
    metrics: dict[str, Any] | None = None,
    wrap: Callable[[Any, dict[str, Any], int], Any] | None = None,
    write: OfflineWriter = write_full_model,
) -> ExportResult:
    """``hf-fsdp2 export`` of a run's checkpoint: the consolidated folder, without training hardware.

    One process: the model is rebuilt from the run's config, filled from the checkpoint's shards, and
    written and verified as at the end of training by ``write`` (a LoRA run's ``wrap`` and ``write``:
    ``hf_fsdp2.lora.offline``).

    Args:
        checkpoint: a ``checkpoint-<step>`` folder.
        out_dir: the export folder; must be empty unless ``overwrite``.
        dtype: export dtype; default the run's ``export_dtype``.
        max_shard_bytes: largest file; default the run's ``max_shard_size``.
        overwrite: replace the export files of a non-empty ``out_dir``.
        verify: verify before publishing.
        verify_atol: probe-logit limit (None: by dtype).
        metrics: the run's last logged figures, for the model card (None: the card has none).
        wrap: turns the base model into the trained one before loading (:func:`load_checkpoint_model`).
        write: writes and verifies the prepared job (default: the full model's consolidated folder).

    Returns:
        The published folder's description.

    Raises:
        ExportError: a non-empty ``out_dir``, an incomplete or foreign checkpoint, or a failed write.
        ExportVerificationError: the written folder does not reproduce the checkpoint's model.
    """
    job = prepare_offline_export(
        checkpoint,
        out_dir,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        metrics=metrics,
        wrap=wrap,
    )
    return write(job, verify, verify_atol)
