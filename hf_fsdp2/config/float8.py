"""The settings of ``mixed_precision=fp8`` (applied by :mod:`hf_fsdp2.parallel.float8`): torchao's scaling recipe,
emulation and float8 all-gather, and what FP8 cannot be combined with."""

from __future__ import annotations

from dataclasses import dataclass

from hf_fsdp2.config.plans import check

FP8_TENSORWISE = "tensorwise"  # the one scaling torchao all-gathers in float8
FP8_RECIPES = (FP8_TENSORWISE, "rowwise")


@dataclass(frozen=True)
class Float8Plan:
    """How the decoder layers train under ``mixed_precision=fp8`` (applied by ``hf_fsdp2.parallel.float8``).

    Attributes:
        recipe: torchao's scaling: ``tensorwise`` (one scale per tensor; float8 all-gather possible) or ``rowwise``
            (one scale per row: more accurate, slower, all-gathers in bf16).
        emulate: torchao's emulation (the float8 rounding computed in high precision): runs on CPU, slow; tests.
        all_gather: FSDP2 all-gathers the converted weights as float8 (tensorwise only).
        size_filter: keep the linears below torchao's size thresholds for ``recipe`` in bf16, where float8 is
            slower than bf16 (``hf_fsdp2.parallel.float8.below_float8_size``); off: every linear whose dimensions
            are multiples of 16 converts (tiny test models, whose linears are all below the thresholds).
    """

    recipe: str = "tensorwise"
    emulate: bool = False
    all_gather: bool = True
    size_filter: bool = True

    def __post_init__(self) -> None:
        check(self.recipe in FP8_RECIPES, f"fp8_recipe={self.recipe!r} is not one of {list(FP8_RECIPES)}")
        check(
            not (self.all_gather and self.recipe != FP8_TENSORWISE),
            f"fp8_all_gather=true with fp8_recipe={self.recipe}: torchao all-gathers float8 weights only with one "
            "scale per tensor; set fp8_recipe=tensorwise or fp8_all_gather=false",
        )


def check_float8_combination(
    *,
    load_in_4bit: bool,
    use_peft: bool,
    tp_size: int,
    ram_efficient_loading: bool | None,
    optim: str = "adamw",
    all_gather: bool = False,
    ep_size: int = 1,
) -> None:
    """What ``mixed_precision=fp8`` cannot be combined with, refused before any work.

    Raises:
        ConfigError: QLoRA, LoRA, tensor parallel with the float8 weight all-gather, expert parallel, rank-0-only
            loading (set to true) or Muon with fp8.
    """
    check(
        optim == "adamw",
        f"mixed_precision=fp8 with optim={optim} is not supported: Muon gathers and orthogonalises whole matrices, "
        "and the float8 linears' weights are torchao float8-cast wrappers whose update through Muon hf_fsdp2 has not "
        "verified; use optim=adamw with fp8, or mixed_precision=bf16 with Muon",
    )
    check(
        not load_in_4bit,
        "mixed_precision=fp8 with load_in_4bit=true (QLoRA) is not supported: the NF4 base is dequantised to bf16 "
        "for every matmul, so there is no bf16 weight for torchao to cast to float8 and nothing for FP8 to speed up; "
        "use mixed_precision=bf16 with QLoRA, or LoRA/full fine-tuning with fp8",
    )
    check(
        not use_peft,
        "mixed_precision=fp8 with use_peft=true (LoRA) is not supported: torchao's Float8Linear would replace the "
        "frozen base linears inside PEFT's LoRA wrappers, a combination hf_fsdp2 has not verified to train correctly; "
        "use mixed_precision=bf16 with LoRA, or full fine-tuning with fp8",
    )
    check(
        tp_size == 1 or not all_gather,
        f"mixed_precision=fp8 with tp_size={tp_size} and fp8_all_gather=true (the default with tensorwise scaling) is "
        "not supported: FSDP2's float8 all-gather of weights that tensor parallel has split too (2-D DTensors of "
        "torchao's float8-cast wrappers) is not verified by hf_fsdp2; set fp8_all_gather=false (the weights gather in "
        "bf16; the activations still cross the tp ranks in float8), or tp_size=1",
    )
    check(
        ep_size == 1,
        f"mixed_precision=fp8 with ep_size={ep_size} is not supported: FP8 converts the decoder layers' linears, and "
        "expert parallel runs the routed experts as grouped matmuls over fused 3-D weights, which this version has "
        "no float8 grouped GEMM for; use mixed_precision=bf16 with ep_size, or ep_size=1 with fp8",
    )
    check(
        not ram_efficient_loading,
        "mixed_precision=fp8 with fsdp_cpu_ram_efficient_loading=true is not supported: loading rank 0's weights "
        "into the shards replaces torchao's float8 weight wrappers (accelerate refuses it too); set "
        "fsdp_cpu_ram_efficient_loading=false",
    )
