"""The one table of dtype names used in configs, files and logs."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# mixed_precision values -> the dtype FSDP2 computes in (None: the parameters' own dtype).
# fp8: bf16 for everything torchao's float8 does not convert (hf_fsdp2.parallel.float8).
MIXED_PRECISION: dict[str, torch.dtype | None] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "no": None,
    "fp8": torch.bfloat16,
}


def dtype_named(name: str, key: str = "dtype", allowed: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype called ``name`` ("bfloat16").

    Raises:
        ValueError: an unknown name, naming the config key and the names allowed.
    """
    names = allowed or tuple(DTYPES)
    if name not in names:
        raise ValueError(f"{key}={name!r} is not one of {', '.join(names)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
