"""The probe of a vLLM engine's weights: after each weight update the engine's log-probs of a fixed completion
(:data:`PROBE_TEXT`) must equal the trainer's within :func:`probe_bound`, or the engine runs other weights than the
trainer sent (:meth:`~.client.VllmGenerator.check_probe`)."""

from __future__ import annotations

import math

import torch

# Unit roundoff of the dtypes the trainer computes in or the server runs: the probe's bound scales with the coarser.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}

PROBE_TEXT = ("The quick brown fox jumps over", " the lazy dog, and the dog sleeps on in the sun.")


def probe_bound(trainer_logps: torch.Tensor, server_dtype: str, compute_dtype: str, layers: int = 1) -> float:
    """How far the server's log-prob of a token may be from the trainer's when both run the same weights:
    ``32 u sqrt(layers + 1) (1 + max |logp|)``, u the unit roundoff of the coarser of the two dtypes.

    Both sides compute the same function with different kernels (fused q/k/v and gate/up, other reduction orders):
    each decoder layer (and the head) adds rounding errors of relative size ~u that accumulate like a random walk
    (sqrt of the depth), and a log-prob's error scales with its magnitude. Measured on CPU in float32: a 2-layer
    model differs by at most 9.5e-7 (bound 3.8e-5), SmolLM2-135M (30 layers) by 6.3e-6 (bound ~4e-5); one AdamW
    update at lr 1e-3 moves the probe's log-probs by more than 100 bounds (tests/recipes/test_grpo_vllm_server.py).
    In bfloat16 the bound is ~1,000x wider (u = 2^-8): the probe then catches a server on other weights after many
    updates, not after one small one.
    """
    u = max(UNIT_ROUNDOFF.get(server_dtype, 2.0**-8), UNIT_ROUNDOFF.get(compute_dtype, 2.0**-8))
    return 32.0 * u * math.sqrt(layers + 1) * (1.0 + float(trainer_logps.abs().max()))
