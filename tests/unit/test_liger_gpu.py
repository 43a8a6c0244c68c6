"""Liger kernels against the plain path (needs a CUDA GPU and liger-kernel; skipped elsewhere).

Under ``scripts/gpu_check.sh`` (``HF_FSDP2_GPU_CHECK=1``) a missing GPU or liger-kernel fails the test instead
of skipping it: the GPU check promises that the Liger path ran (liger-kernel comes from the offline bundle).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

MISSING = [
    *([] if torch.cuda.is_available() else ["a CUDA device (Liger's kernels are Triton GPU kernels)"]),
    *(
        []
        if importlib.util.find_spec("liger_kernel")
        else ["liger-kernel (pip install liger-kernel, or the offline bundle)"]
    ),
]
REQUIRED = os.environ.get("HF_FSDP2_GPU_CHECK") == "1"  # set by scripts/gpu_check.sh


@pytest.fixture(autouse=True)
def _needs_cuda_and_liger() -> None:
    if MISSING and REQUIRED:
        pytest.fail(f"the GPU check runs the Liger test, and this machine lacks {' and '.join(MISSING)}")
    if MISSING:
        pytest.skip(f"needs {' and '.join(MISSING)}")


def test_liger_kernels_give_the_plain_loss_and_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2.parallel.kernels import apply_liger_kernels
    from hf_fsdp2.train.loss import LossPlan, causal_lm_loss_sum

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for liger in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).cuda()
        model.config.use_cache = False
        if liger:
            apply_liger_kernels(model)
        loss = causal_lm_loss_sum(model, {"input_ids": ids}, ids, LossPlan(32)) / ids[:, 1:].numel()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (liger_loss, liger_grads) = results
    torch.testing.assert_close(liger_loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(liger_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
