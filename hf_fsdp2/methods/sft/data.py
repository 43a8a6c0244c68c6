"""The SFT recipe's data: sources -> tokenized examples (rank 0 first, cached) -> packed rows or padding-free
batches when asked -> the sharded sampler and the stream of micro-batches, and the step count."""

from __future__ import annotations

import logging
from typing import Any

from hf_fsdp2.collectives import rank0_first
from hf_fsdp2.composite import composite_spec
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.mixture import build_sft_datasets_from_config
from hf_fsdp2.data.packing import PackedCollator, layout_summary, pack_examples
from hf_fsdp2.data.tokenize import TokenizeStats
from hf_fsdp2.data.vision_collate import VisionPackedRows, vision_collator
from hf_fsdp2.run.data import TrainData, check_one_step, examples_per_step, logged_layout, sampled_stream
from hf_fsdp2.run.session import Session
from hf_fsdp2.vision.families import image_training
from hf_fsdp2.vision.processor import load_processor

logger = logging.getLogger("hf_fsdp2")


def check_has_targets(stats: list[TokenizeStats], train_counts: list[int], max_length: int) -> None:
    """Refuse training data in which no example has a target token: the run would train to its end at loss 0.

    Args:
        stats: each training source's tokenize stats (in the order of ``train_counts``; eval sources after).
        train_counts: examples each training source contributes to the mixture.
        max_length: the run's max_length, for the message.

    Raises:
        ConfigError: every used example has no target token, naming the sources, the counts and the likely cause.
    """
    used = [s for s, n in zip(stats, train_counts, strict=False) if n > 0]
    if not used or any(s.num_kept > s.num_without_targets for s in used):
        return
    kept = sum(s.num_kept for s in used)
    truncated = sum(s.num_truncated for s in used)
    cause = (
        f"{truncated} of the {kept} examples were cut at max_length={max_length}: their prompts fill it and the "
        "completions are cut off; raise max_length, or shorten the prompts"
        if truncated
        else "the loss mask covers every token (assistant_only_loss / completion_only_loss / chat_loss, or "
        "records without an assistant turn or completion); check the records and those settings"
    )
    raise ConfigError(
        f"no training example has a target token, so the run would train at loss 0 "
        f"({', '.join(s.source for s in used)}: {kept} examples, all without targets): {cause}. "
        "`hf-fsdp2 show-data` shows which tokens train"
    )


def check_trained_parts(
    model_config: Any, *, images: bool, freeze_vision_tower: bool, freeze_projector: bool
) -> None:
    """Refuse training a composite's vision tower or projector on data without images (they run on image tokens only:
    no gradient would reach them). The same answer on every rank (the same data).

    Raises:
        ConfigError: naming the key, why and the fix.
    """
    spec = composite_spec(model_config)
    if spec is None or images:
        return
    for key, frozen, part in (
        ("freeze_vision_tower", freeze_vision_tower, "vision tower"),
        ("freeze_multi_modal_projector", freeze_projector, "multi-modal projector"),
    ):
        if not frozen:
            raise ConfigError(
                f"{key}=false on {spec.architecture} with data that has no image: the {part} runs on image tokens "
                f"only, so it would get no gradient and nothing would train it; give records with images "
                f"(docs/vlm.md: an 'images' column beside 'messages'), or leave {key}: true (the default: frozen, one "
                "FSDP2 unit that is never gathered on text rows, exported byte-identical)"
            )


def build_sft_data(session: Session, tokenizer: Any) -> TrainData:
    """Tokenize the run's sources and build the stream of micro-batches (every rank; rank 0 tokenizes first).

    Raises:
        ConfigError / ValueError / FileNotFoundError: bad data, raised on every rank as one error.
    """
    cfg = session.cfg
    d, t, m = cfg.data, cfg.train, cfg.model
    processors: list[Any] = []

    def processor() -> Any:  # loaded once, for a source with images only (a text run never needs it)
        if not processors:
            image_training(session.model_config)  # a model that takes no images: refused before the load
            processors.append(
                load_processor(
                    m.model_name_or_path or "",
                    revision=m.model_revision,
                    trust_remote_code=m.trust_remote_code,
                )
            )
        return processors[0]

    # Rank 0 tokenizes and writes the datasets cache; the other ranks then load it instead of tokenizing.
    # A failure (a missing file, a bad record) is raised on every rank as one error.
    data = rank0_first(
        lambda: build_sft_datasets_from_config(d, tokenizer, seed=t.seed, load_processor=processor)
    )
    for line in data.summary_lines(d.max_length):
        logger.info(line)
    check_has_targets(data.stats, data.train_counts, d.max_length)
    images = any(s is not None and "images" in s.column_names for s in (data.train, data.eval))
    check_trained_parts(
        session.model_config,
        images=images,
        freeze_vision_tower=m.freeze_vision_tower,
        freeze_projector=m.freeze_multi_modal_projector,
    )
    if images and d.padding_free is None and image_training(session.model_config).several_documents:
        d.padding_free = False  # auto: padded, where a row of several image documents would not be kept apart
        logger.info(
            "padding_free auto: padded batches for image records on this model (%s)",
            image_training(session.model_config).several_documents,
        )
    d.padding_free = logged_layout(session, "as_configured").padding_free
    # Packed once, deterministically, before sampling: the sampler indexes rows, so resume stays O(1).
    packed = pack_examples(data.train, d.max_length) if d.packing else None
    dataset: Any = data.train if packed is None else packed
    collator: Any
    if images:  # every rank: the same data, the same answer
        collator = vision_collator(
            processor(),
            session.model_config,
            pad_token_id=tokenizer.pad_token_id,
            packing=d.packing,
            padding_free=bool(d.padding_free),
        )
        if packed is not None:
            dataset = VisionPackedRows(data.train, packed.rows)
    elif d.packing or d.padding_free:
        collator = PackedCollator(pad_token_id=tokenizer.pad_token_id, padding_free=d.padding_free)
    else:
        collator = PaddingCollator(pad_token_id=tokenizer.pad_token_id)
    logger.info(
        layout_summary(
            data.train,
            packed,
            batch_size=t.per_device_train_batch_size,
            world_size=session.data_world,
            seed=t.seed,
            padding_free=d.padding_free,
        )
    )
    per_step = examples_per_step(session)
    check_one_step(session, len(dataset), "packed rows" if d.packing else "examples", "dataset")
    stream, steps_per_epoch, total_steps = sampled_stream(session, dataset, collator)
    logger.info(
        "training %d steps (%d per epoch), %d examples per step", total_steps, steps_per_epoch, per_step
    )
    return TrainData(
        stream=stream,
        collator=collator,
        eval_set=data.eval,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        examples_per_step=per_step,
        processor=processor() if images else None,
    )
