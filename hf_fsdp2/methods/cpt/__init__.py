"""Continued pre-training: ``data`` (plain-text documents concatenated or best-fit into rows, streamed when asked,
resumable exactly) and SFT's objective, cross entropy on every token."""

from __future__ import annotations

from hf_fsdp2.data.mixture import preview_sft
from hf_fsdp2.methods.cpt.data import build_cpt_data
from hf_fsdp2.run.method import Capabilities, Method, token_objective

METHOD = Method(
    name="cpt",
    title="continued pre-training",
    build_data=build_cpt_data,
    objective=token_objective,
    batch_rows="corpus",
    preview_data=preview_sft,
    # cp: test_context_parallel (all-to-all), tests/gpu/test_ring_cp_check (ring); tp: test_tensor_parallel; fp8:
    # test_float8; ep: SFT's objective and models (test_expert_parallel, test_expert_parallel_recipe), the experts
    # exchange tokens whatever rows they come from.
    capabilities=Capabilities(
        context_parallel=True, ring_attention=True, tensor_parallel=True, float8=True, expert_parallel=True
    ),
)
