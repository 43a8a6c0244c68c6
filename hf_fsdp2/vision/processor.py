"""The model's processor (what builds image inputs from records) and the dummy image every rank runs its vision tower on
when its micro-batch has none (:mod:`hf_fsdp2.vision.tower`)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from hf_fsdp2.config import ConfigError

logger = logging.getLogger("hf_fsdp2")


# The processors whose image path needs no torchvision, though AutoProcessor also loads their video processor (a
# torchvision class): without torchvision they are built from their image processor and tokenizer alone.
_VIDEO_OPTIONAL = ("Qwen2_5_VLProcessor", "Qwen3VLProcessor")


class _WithoutVideo:
    """A processor built without its video processor: ``check_argument_for_proper_class`` (ProcessorMixin's check of
    each part's class) accepts ``video_processor=None``; image calls never read it."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]


def load_processor(name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The checkpoint's processor (``AutoProcessor``): its image processor, tokenizer and chat template.

    Without torchvision, a Qwen2.5-VL / Qwen3-VL processor (whose video processor needs it) is built from the folder's
    image processor (its PIL class), tokenizer and chat template, without a video processor (logged: video records are
    refused by name in any case).

    Raises:
        ConfigError: the folder has no processor, or its classes need a package that is not installed, naming the
            checkpoint and the fix.
    """
    from transformers import AutoProcessor, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(
            name_or_path, revision=revision, trust_remote_code=trust_remote_code
        )
    except ImportError as err:
        processor = _image_only_processor(
            name_or_path, revision=revision, trust_remote_code=trust_remote_code
        )
        if processor is None:
            raise ConfigError(
                f"the processor of {name_or_path} does not load: {err}. Install what it names (SmolVLM2's processor "
                "needs torchvision for its video part: pip install torchvision, the build matching torch)"
            ) from err
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"the processor of {name_or_path} does not load ({type(err).__name__}: {err}); image records are built by "
            "the checkpoint's processor: use a checkpoint folder with its processor files (processor_config.json or "
            "preprocessor_config.json, as the hub ships them)"
        ) from err
    if not isinstance(processor, ProcessorMixin):
        raise ConfigError(
            f"{name_or_path} loads a {type(processor).__name__}, not a processor with an image processor: image "
            "records need the checkpoint's processor (processor_config.json / preprocessor_config.json)"
        )
    return processor


def _image_only_processor(name_or_path: str, *, revision: str | None, trust_remote_code: bool) -> Any | None:
    """The folder's Qwen-VL processor without its video processor, when torchvision is what is missing (None for any
    other processor or missing package: the caller refuses)."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer, ImageProcessingMixin, ProcessorMixin
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return None
    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    processor_dict, _ = ProcessorMixin.get_processor_dict(name_or_path, revision=revision)
    image_dict, _ = ImageProcessingMixin.get_image_processor_dict(name_or_path, revision=revision)
    name = processor_dict.get("processor_class") or image_dict.get("processor_class")
    if name not in _VIDEO_OPTIONAL:
        return None
    cls = type(name, (_WithoutVideo, getattr(transformers, name)), {})
    processor = cls(
        image_processor=AutoImageProcessor.from_pretrained(name_or_path, **kwargs),
        tokenizer=AutoTokenizer.from_pretrained(name_or_path, **kwargs),
        video_processor=None,
        chat_template=processor_dict.get("chat_template"),
    )
    logger.info(
        "%s of %s built without its video processor (it needs torchvision, which is not installed): image records "
        "only, videos are not available",
        name,
        name_or_path,
    )
    return processor


def dummy_image(size: int = 32) -> Any:
    """A small RGB image with a fixed gradient (never all one value: Idefics3 drops an all-zero image as padding)."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, size * size * 3, dtype=np.float64).reshape(size, size, 3)
    return Image.fromarray(ramp.astype(np.uint8), mode="RGB")


def dummy_image_inputs(processor: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The image processor's inputs for :func:`dummy_image`, restricted to the keys the model's
    ``get_image_features`` takes (its tower and projector then run as on a real image).

    Raises:
        ConfigError: the model has no ``get_image_features``.
    """
    features = getattr(model, "get_image_features", None)
    if not callable(features):
        raise ConfigError(
            f"{type(model).__name__} has no get_image_features: its vision tower cannot be run on a micro-batch "
            "without images, which keeps every rank's collectives alike"
        )
    processor_out = processor.image_processor(images=[dummy_image()], return_tensors="pt")
    accepted = set(inspect.signature(features).parameters)
    return {k: v for k, v in processor_out.items() if k in accepted and isinstance(v, torch.Tensor)}
