"""The composites this version trains on image records, and what their batches need.

Every composite of :data:`hf_fsdp2.composite.COMPOSITES` fine-tunes on text; the ones here also take images. Each row
says how the processor lays out its image inputs (a batch axis per row for Idefics3 (SmolVLM's first checkpoints), a flat list of images
or patches for the others), whether its positions are Qwen's 3-D mRoPE (built per document for rows of several
documents), and why rows of several documents (packing, padding-free batches) are refused when they are. The others
are refused by name, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_fsdp2.composite import composite_spec
from hf_fsdp2.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class ImageTraining:
    """How a composite trains on images.

    Attributes:
        architecture: the composite's class.
        row_batched: processor outputs laid out ``[rows, images, ...]`` (padded with zero images across rows), where
            the others are one flat list of images (or patches) for the whole batch.
        mrope: Qwen's 3-D rotary positions (temporal, height, width), which rows of several documents get per document
            from the class's own ``get_rope_index``.
        several_documents: why rows of several documents are refused ("" when they are not).
    """

    architecture: str
    row_batched: tuple[str, ...] = ()
    mrope: bool = False
    several_documents: str = ""


_GEMMA3_ROWS = (
    "with images, transformers builds its sliding-window layers' mask from the image blocks (token_type_ids) read at "
    "each document's own positions, not the row's, so the image tokens of a row's second and later documents attend "
    "to the wrong tokens (their logits differ from the padded batch's by ~0.6 on a tiny Gemma 3)"
)

IMAGE_TRAINING: dict[str, ImageTraining] = {
    row.architecture: row
    for row in (
        ImageTraining(architecture="Gemma3ForConditionalGeneration", several_documents=_GEMMA3_ROWS),
        ImageTraining(architecture="Qwen2_5_VLForConditionalGeneration", mrope=True),
        ImageTraining(architecture="Qwen3VLForConditionalGeneration", mrope=True),
        # Qwen3-VL's processor and tower; its gated DeltaNet layers refuse rows of several documents for text too.
        ImageTraining(architecture="Qwen3_5ForConditionalGeneration", mrope=True),
        ImageTraining(
            architecture="Idefics3ForConditionalGeneration",
            row_batched=("pixel_values", "pixel_attention_mask"),
        ),
        ImageTraining(architecture="LlavaForConditionalGeneration"),
    )
}
"""The composites trained on image records (tests/distributed/test_vlm_2rank.py runs each)."""

_UNTESTED = {
    "Llama4ForConditionalGeneration": "Llama4Processor",
    "Mistral3ForConditionalGeneration": "PixtralProcessor",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3VLProcessor",
}
# (SmolVLM2's SmolVLMForConditionalGeneration is not a composite of this version: its processor needs num2words and
# torchvision; SmolVLM's first checkpoints are Idefics3ForConditionalGeneration, trained here.)


def image_training(config: Any) -> ImageTraining:
    """How the composite of ``config`` trains on images (decided from the config, every rank alike).

    Raises:
        ConfigError: a text model, or a composite this version does not train on images, naming it, why and the fix.
    """
    spec = composite_spec(config)
    if spec is None:
        name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise ConfigError(
            f"the data has images but {name} is not a vision-language checkpoint: it has no vision tower to read "
            "them; train a vision-language composite (docs/vlm.md lists them), or drop the image column"
        )
    row = IMAGE_TRAINING.get(spec.architecture)
    if row is None:
        processor = _UNTESTED.get(spec.architecture, "its processor")
        raise ConfigError(
            f"image records on {spec.architecture}: this version trains its language model on text, but not on "
            f"images: {processor} is not tested with this toolkit's image batches on it (Llama 4's and Mistral 3's "
            "processors need torchvision, and no torchvision build loads beside the CPU torch the toolkit is "
            "tested with: docs/vlm.md#families). Train on text records (the tower and "
            f"projector frozen), or use a composite trained on images: {', '.join(sorted(IMAGE_TRAINING))}"
        )
    return row


def check_rows(row: ImageTraining, *, packing: bool, padding_free: bool) -> None:
    """Refuse rows of several documents where the family cannot keep them apart.

    Raises:
        ConfigError: naming the setting, the class, why and the fix.
    """
    if row.several_documents and (packing or padding_free):
        asked = "packing=true" if packing else "padding_free=true"
        raise ConfigError(
            f"{asked} with image records on {row.architecture}: {row.several_documents}; set packing: false and "
            "padding_free: false (padded batches, one document per row)"
        )
