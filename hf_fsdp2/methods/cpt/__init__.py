"""Continued pre-training: ``data`` (plain-text documents concatenated or best-fit into rows, streamed when asked,
resumable exactly) and SFT's objective, cross entropy on every token."""

from __future__ import annotations

from hf_fsdp2.methods.cpt.data import build_cpt_data
from hf_fsdp2.methods.sft import sft_objective
from hf_fsdp2.methods.sft.data import preview_sft
from hf_fsdp2.trainer.method import Method

METHOD = Method(
    name="cpt",
    title="continued pre-training",
    build_data=build_cpt_data,
    objective=sft_objective,
    batch_rows="corpus",
    preview_data=preview_sft,
    context_parallel=True,
    tensor_parallel=True,
    float8=True,  # tests/distributed/test_float8.py
)
