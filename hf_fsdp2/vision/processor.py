"""The model's processor (what builds image inputs from records) and the dummy image every rank runs its vision tower on
when its micro-batch has none (:mod:`hf_fsdp2.vision.tower`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hf_fsdp2.config import ConfigError


def load_processor(name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The checkpoint's processor (``AutoProcessor``): its image processor, tokenizer and chat template.

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
        raise ConfigError(
            f"the processor of {name_or_path} does not load: {err}. Install what it names (the Qwen and SmolVLM "
            "processors need torchvision for their video part: pip install torchvision, the build matching torch)"
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
