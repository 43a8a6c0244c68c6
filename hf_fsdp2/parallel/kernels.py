"""Optional Liger kernels (``use_liger_kernel``): fused RMSNorm, SwiGLU and rotary embeddings.

Liger's Triton kernels replace the modules' forward in place, before sharding, so FSDP2, activation
checkpointing and compile wrap them like the originals. The loss stays hf_fsdp2's chunked cross
entropy (``ce_chunk_tokens``), which already never builds the full logits. Liger needs a CUDA GPU and
the ``liger-kernel`` package; without either the run stops before loading anything.
"""

from __future__ import annotations

import importlib.util

import torch


class KernelError(ValueError):
    """Liger asked for where it cannot run."""


def check_liger_available(on_gpu: bool) -> None:
    """Refuse ``use_liger_kernel`` without the package or without a GPU, naming the fix.

    Raises:
        KernelError: the package is missing, or the run is CPU-only.
    """
    if importlib.util.find_spec("liger_kernel") is None:
        raise KernelError(
            "use_liger_kernel=true but the liger-kernel package is not installed; `pip install liger-kernel` "
            "(it needs a CUDA GPU and Triton), or set use_liger_kernel=false"
        )
    if not on_gpu:
        raise KernelError(
            "use_liger_kernel=true on a CPU-only run: Liger's kernels are Triton GPU kernels; set "
            "use_liger_kernel=false"
        )


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Patch ``model``'s RMSNorm, SwiGLU MLP and rotary embeddings with Liger's kernels, in place.

    Liger's own loss paths are left off: the loss is computed by ``hf_fsdp2.train.loss`` from the hidden
    states, chunk by chunk.

    Raises:
        KernelError: Liger has no kernels for this model type.
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    # Liger itself only logs and returns for a model type it does not know; that would be a silent no-op.
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise KernelError(
            f"use_liger_kernel=true but Liger has no kernels for model_type={model_type!r}; it supports "
            f"{sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)[:12]}...; set use_liger_kernel=false"
        )
    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
