"""The output head's input replacement (chunked CE and DPO's completion positions) under whole-model compile.

Every call has a new number of target rows / completion tokens and a new length, as real data does. The hook is
registered once and holds nothing of the call, so after the warm-up calls (the first compile, then dynamo's
automatic-dynamic recompile on the second length) nothing compiles again; with a new hook closure per call (as
DPO's path once had) every call recompiled until dynamo's limit. The compiled values equal eager
ones (float64 model). Dynamo's guards and recompiles do not depend on the backend: chunked CE runs AOT autograd
(aot_eager: the compiled backward through the hook), DPO's path dynamo alone (backend eager), where aot_eager's
shape-generic first compile of the whole model took ~20 s of a core per path.
"""

from __future__ import annotations

import pytest
import torch
from support.numerics import assert_same_maths
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.config.plans import CompilePlan
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.parallel.compiling import CompileWatch, compile_model
from hf_fsdp2.train.logps import completion_logps
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, shifted_target_rows

CALLS, WARMUP = 6, 2


class _Backend(CompilePlan):
    backend = "aot_eager"

    def kwargs(self) -> dict:
        return {**super().kwargs(), "backend": self.backend}


def _model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    model.config.use_cache = False
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Padded rows of a new length each call, completions of a new length each call (labels on the last part)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(CALLS):
        length = 12 + 3 * i
        ids = torch.randint(0, 128, (2, length), generator=gen)
        labels = ids.clone()
        labels[0, : length - 2 - i] = IGNORE_INDEX  # completion of 2 + i tokens
        labels[1, : length // 2] = IGNORE_INDEX
        out.append((ids, labels))
    return out


@pytest.mark.parametrize(("path", "backend"), [("chunked_ce", "aot_eager"), ("dpo_completions", "eager")])
def test_head_hook_does_not_recompile_after_warmup_and_equals_eager(path: str, backend: str) -> None:
    eager = _model()
    compiled = _model()
    torch._dynamo.reset()
    _Backend.backend = backend
    compile_model(compiled, _Backend(enabled=True, scope="model"))
    plan = LossPlan(chunk_tokens=4)  # a new chunk count whenever the target count changes
    watch = CompileWatch(enabled=True).start()
    recompiles = []  # the watch's count so far, after each call
    for i, (ids, labels) in enumerate(_batches()):
        inputs = {"input_ids": ids}
        if path == "chunked_ce":
            rows = shifted_target_rows(labels)
            got = causal_lm_loss(compiled, inputs, labels, plan, rows).ce_sum
            want = causal_lm_loss(eager, inputs, labels, plan, rows).ce_sum
        else:
            got = completion_logps(compiled, inputs, labels, plan)[0]
            want = completion_logps(eager, inputs, labels, plan)[0]
        got.sum().backward()
        recompiles.append(int(watch.take()["recompiles"]))
        assert_same_maths(got, want, terms=64, rounding=torch.float32, name=f"{path} call {i}")
    after_warmup = recompiles[-1] - recompiles[WARMUP - 1]
    assert after_warmup == 0, (
        f"{path}: {after_warmup} recompiles after the warm-up (so far, per call: {recompiles})"
    )
    assert watch.take().get("recompile_limit_hits", 0) == 0
