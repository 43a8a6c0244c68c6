"""Supervised fine-tuning: ``data`` (chat / prompt-completion / text examples with loss masks, image records on a
vision-language composite, packed or padding-free when asked) and the objective, token-level cross entropy over the step's target tokens
(:func:`~hf_fsdp2.run.method.token_objective`, shared with continued pre-training)."""

from __future__ import annotations

from hf_fsdp2.data.mixture import preview_sft
from hf_fsdp2.methods.sft.data import build_sft_data
from hf_fsdp2.run.method import Capabilities, Method, token_objective

METHOD = Method(
    name="sft",
    title="supervised fine-tuning",
    build_data=build_sft_data,
    objective=token_objective,
    preview_data=preview_sft,
    # cp: test_context_parallel (all-to-all), tests/gpu/test_ring_cp_check (ring); tp: test_tensor_parallel; fp8:
    # test_float8; images: test_vlm_2rank; ep: test_expert_parallel (the step), test_expert_parallel_recipe.
    capabilities=Capabilities(
        context_parallel=True,
        ring_attention=True,
        tensor_parallel=True,
        float8=True,
        expert_parallel=True,
        images=True,
    ),
)
