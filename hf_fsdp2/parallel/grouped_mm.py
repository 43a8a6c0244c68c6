"""Which kernel a mixture of experts runs its routed experts with, and why, decided from the run's settings.

transformers 5 dispatches a fused experts module (a ``@use_experts_implementation`` class) to
``config._experts_implementation``: ``grouped_mm`` by default (every (token, choice) row of the layer through one
grouped matmul, ``torch.nn.functional.grouped_mm``), ``batched_mm``, or ``eager`` (the class's own loop: one matmul
per expert that has tokens). Its ``grouped_mm`` falls back, without a word, to a loop of one matmul per expert
(``transformers::grouped_mm_fallback``) where the kernel cannot run (transformers 5.25, ``_can_use_grouped_mm``):

- under ``torch.compile`` with weights in another dtype than bf16 (inductor lowers grouped_mm for bf16 only);
- on a CUDA GPU older than sm_80 (Ampere);
- with a torch that has neither ``torch.nn.functional.grouped_mm`` nor ``torch._grouped_mm``, or on CPU with torch
  2.8 or older (no CPU kernel).

A loop of ``E`` small matmuls (one host sync for the split sizes, then ``E`` launches per projection and layer) is
what makes an MoE slow by surprise on a GPU, so the run names the kernel at start-up and warns, with the reason and the
fix, when it is the loop (:func:`experts_kernel`). Expert parallel's own implementation runs the rank's experts
outside ``torch.compile`` (eagerly), through the implementation the model had before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPED_MM = "grouped_mm"
LOOP = "per-expert loop"


@dataclass(frozen=True)
class ExpertsKernel:
    """The experts implementation transformers was asked for, the kernel it runs, and why it is the per-expert loop
    (None when it is not, or when the loop was asked for by name)."""

    implementation: str
    kernel: str
    reason: str | None = None

    def describe(self, classes: str, layers: int) -> str:
        head = f"MoE experts ({classes}, {layers} layers): experts_implementation={self.implementation!r}"
        if self.reason is None:
            return f"{head}, kernel {self.kernel}"
        return f"{head} runs the {LOOP} (one matmul per expert with tokens), not grouped_mm: {self.reason}"


def _has_grouped_mm() -> bool:
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def experts_kernel(
    implementation: str | None,
    *,
    compiled: bool,
    compute_dtype: torch.dtype,
    device_type: str,
    capability: tuple[int, int] | None = None,
    expert_parallel: bool = False,
) -> ExpertsKernel:
    """The kernel the routed experts run with.

    Args:
        implementation: the model config's ``_experts_implementation`` (None: transformers' default, grouped_mm).
        compiled: the decoder layers (or the model) run under ``torch.compile``.
        compute_dtype: the dtype the experts' weights have in the forward (the mixed-precision policy's, else the
            loaded dtype).
        device_type: ``cuda`` or ``cpu``.
        capability: the CUDA device's compute capability.
        expert_parallel: ``ep_size > 1``: the rank's experts run eagerly inside the compiled layer.

    Returns:
        The :class:`ExpertsKernel`.
    """
    name = implementation or GROUPED_MM
    if name == "eager":
        return ExpertsKernel(
            name,
            LOOP,
            "the model config asks for experts_implementation='eager' (or its class cannot set another); load it "
            "with grouped_mm (transformers' default for the @use_experts_implementation classes)",
        )
    if name != GROUPED_MM:
        return ExpertsKernel(name, name)
    if not _has_grouped_mm():
        return ExpertsKernel(
            name,
            LOOP,
            f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm; install a "
            "torch with it (2.9 or newer)",
        )
    if device_type == "cpu" and torch.torch_version.TorchVersion(torch.__version__) < "2.9":
        return ExpertsKernel(
            name, LOOP, f"torch {torch.__version__} has no CPU grouped_mm kernel (2.9 or newer has)"
        )
    if device_type == "cuda" and capability is not None and capability < (8, 0):
        return ExpertsKernel(
            name,
            LOOP,
            f"this GPU (sm_{capability[0]}{capability[1]}) has no grouped_mm kernel (sm_80 or newer: A100, H100, ...)",
        )
    if compiled and compute_dtype != torch.bfloat16 and not expert_parallel:
        dtype = str(compute_dtype).removeprefix("torch.")
        return ExpertsKernel(
            name,
            LOOP,
            f"under torch.compile transformers runs grouped_mm only with bf16 weights, and these compute in {dtype}; "
            "set mixed_precision: bf16 (or torch_compile: false, which runs grouped_mm in "
            f"{dtype} eagerly)",
        )
    return ExpertsKernel(name, GROUPED_MM)


def fused_experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers' experts interface dispatches (its decorator sets ``has_gate`` and
    ``is_transposed`` on each), with fused 3-D tensors."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "has_gate")
        and hasattr(m, "is_transposed")
        and any(p.dim() == 3 for p in m.parameters(False))
    ]


def model_experts_kernel(
    model: torch.nn.Module,
    *,
    compiled: bool,
    compute_dtype: torch.dtype | None,
    device: torch.device,
    expert_parallel: bool = False,
) -> tuple[ExpertsKernel, str] | None:
    """The kernel of ``model``'s routed experts and the start-up line naming it (None for a model without fused
    experts). Call it before expert parallel replaces the implementation (it reads the one the model has)."""
    modules = fused_experts_modules(model)
    if not modules:
        return None
    config = getattr(modules[0], "config", None) or getattr(model, "config", None)
    weights = next(p for p in modules[0].parameters(False) if p.dim() == 3)
    capability = (
        torch.cuda.get_device_capability(device)
        if device.type == "cuda" and torch.cuda.is_available()
        else None
    )
    kernel = experts_kernel(
        getattr(config, "_experts_implementation", None),
        compiled=compiled,
        compute_dtype=compute_dtype or weights.dtype,
        device_type=device.type,
        capability=capability,
        expert_parallel=expert_parallel,
    )
    classes = ", ".join(sorted({type(m).__name__ for m in modules}))
    return kernel, kernel.describe(classes, len(modules))
