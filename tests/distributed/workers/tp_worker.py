"""Worker for tests/distributed/test_tensor_parallel.py, on 4 gloo ranks (one mesh: dp_shard_cp 2 x tp 2), three
families: Llama (GQA, untied head, plain logits), Qwen3 (per-head q/k norms, tied head, the chunked loss: loss
parallel) and Gemma3 (per-head norms, four norms per layer, sliding window, soft-capped logits, scaled embedding).

- tensor parallel alone on each 2-rank tp group (fp32, each group its own data rank's batch): the loss and every
  gradient equal the whole model's, and the collectives of a training forward and its backward, and of an eval
  forward of an odd length (the stream whole), counted with torch's CommDebugMode (hf_fsdp2.observe.comms);
- tensor parallel 2 x FSDP2 over 2 data ranks in fp64: the whole model's loss and gradients, with two data ranks
  holding different batches of unequal target counts; the gradient norm from the library's clip over 2-D DTensors;
  Llama again under HSDP x TP (2 replica groups x 1 shard x tp 2: 3-D DTensors);
- Llama with the run's bf16 policy and each activation-checkpointing mode (none, full, selective) under tensor
  parallel 2 x FSDP2 over 2 data ranks: loss, gradients and each backward's collectives, against the whole bf16 model.

Rank 0 writes ``<out>/result.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hf_fsdp2.config.plans import ACPlan
from hf_fsdp2.observe.comms import CollectiveCounter
from hf_fsdp2.parallel import tensor as tensor_parallel
from hf_fsdp2.parallel.accelerator import mixed_precision_policy
from hf_fsdp2.parallel.activations import apply_activation_checkpointing
from hf_fsdp2.parallel.tensor import apply_tensor_parallel, tp_plan_for
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss, count_target_tokens
from hf_fsdp2.train.step import clip_grad_norm

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# (name, config class, extra keys, chunk tokens of the loss: 0 = plain logits)
CASES = [
    ("llama_gqa_untied_plain", "LlamaConfig", {"tie_word_embeddings": False}, 0),
    ("qwen3_qk_norm_tied_chunked", "Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}, 8),
    # Per-head q/k norms of the (1 + weight) kind, sliding-window layers and soft-capped logits (the model's own).
    (
        "gemma3_qk_norm_sliding_softcap_plain",
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": 5, "final_logit_softcapping": 30.0},
        0,
    ),
]
DP, TP, ROWS, SEQ = 2, 2, 3, 12


def _batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A data rank's batch: random tokens, labels with a rank-dependent number of ignored positions."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, SMALL["vocab_size"], (ROWS, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, : 3 + 2 * dp_rank] = -100  # prompts of different lengths: unequal target counts per data rank
    return ids, labels


def _model(cls: str, extra: dict, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    config = getattr(transformers, cls)(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).train()


def _grad_rel(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor]) -> float:
    """The largest gradient difference from the reference, relative to each reference gradient's largest entry."""
    out = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        scale = ref_grads[name].abs().max().item() or 1.0
        out = max(out, (grad - ref_grads[name]).abs().max().item() / scale)
    return out


def tp_alone(cls: str, extra: dict, chunk: int, mesh) -> dict:  # type: ignore[no-untyped-def]
    """Tensor parallel on this rank's tp group (no FSDP2), fp32, on its data rank's batch: loss, gradients and the
    collectives of one training forward and backward; then an eval forward of an odd length (the stream whole)."""
    plan = LossPlan(chunk_tokens=chunk)
    ids, labels = _batch(mesh["dp_shard_cp"].get_local_rank())
    ref = _model(cls, extra, torch.float32)
    want = causal_lm_loss(ref, {"input_ids": ids}, labels, plan).ce_sum
    want.backward()
    model = _model(cls, extra, torch.float32)
    apply_tensor_parallel(model, mesh["tp"], tp_plan_for(model))
    with CollectiveCounter() as forward:
        got = causal_lm_loss(model, {"input_ids": ids}, labels, plan).ce_sum
    with CollectiveCounter() as backward:
        got.backward()
    odd_ids, odd_labels = ids[:, :-1], labels[:, :-1]  # 11 positions: not a multiple of tp
    model.eval(), ref.eval()
    with torch.no_grad(), CollectiveCounter() as whole:
        odd = causal_lm_loss(model, {"input_ids": odd_ids}, odd_labels, plan).ce_sum
        odd_want = causal_lm_loss(ref, {"input_ids": odd_ids}, odd_labels, plan).ce_sum
    return {
        "loss": [got.item(), want.item()],
        "odd_loss": [odd.item(), odd_want.item()],
        "grad_rel": _grad_rel(model, {n: p.grad for n, p in ref.named_parameters()}),
        "targets": [int((lab[:, 1:] != -100).sum()) for lab in (labels, odd_labels)],
        "forward": forward.counts(),
        "backward": backward.counts(),
        "eval_forward": whole.counts(),
    }


@contextlib.contextmanager
def float8_over_gloo(calls: list[int]) -> Iterator[None]:
    """The GPU path of FP8 under TP on CPU: activations and gradients cross the tp ranks as float8
    (hf_fsdp2.parallel.tensor.float8_collectives), which gloo, having no float8 type, carries as their bytes (torchao's
    float8 all-gather with the data viewed as uint8; NCCL takes float8 itself). ``calls`` counts those all-gathers."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    op = torch.ops._c10d_functional.all_gather_into_tensor.default

    def as_bytes(aten_op, args, kwargs=None):  # type: ignore[no-untyped-def]
        t = args[0]
        out = aten_op(t._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
        out = torch.ops._c10d_functional.wait_tensor.default(out).view(t._data.dtype)
        calls.append(1)
        return Float8TrainingTensor(out, t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role)

    with (
        mock.patch.dict(FLOAT8_OPS_TABLE, {op: as_bytes}),
        mock.patch.object(tensor_parallel, "float8_collectives", lambda mesh: True),
    ):
        yield


def tp_alone_fp8(mesh) -> dict:  # type: ignore[no-untyped-def]
    """FP8 (tensorwise, emulated) under tensor parallel on this rank's tp group: Llama's linears converted to
    torchao's Float8Linear first, then split with the float8 styles (column-parallel: torchao's Float8ColwiseParallel;
    block inputs gathered and row-parallel output gradients gathered as float8), against the same FP8 model whole."""
    from hf_fsdp2.config.float8 import Float8Plan
    from hf_fsdp2.parallel.float8 import convert_float8

    plan, fp8 = LossPlan(chunk_tokens=8), Float8Plan(emulate=True, all_gather=False, size_filter=False)
    ids, labels = _batch(mesh["dp_shard_cp"].get_local_rank())

    def model() -> torch.nn.Module:
        m = _model("LlamaConfig", {"tie_word_embeddings": False}, torch.float32)
        convert_float8(m, ("LlamaDecoderLayer",), fp8)
        return m

    ref = model()
    want = causal_lm_loss(ref, {"input_ids": ids}, labels, plan).ce_sum
    want.backward()
    calls: list[int] = []
    with float8_over_gloo(calls):
        split = model()
        apply_tensor_parallel(split, mesh["tp"], tp_plan_for(split))
        with CollectiveCounter() as counter:
            got = causal_lm_loss(split, {"input_ids": ids}, labels, plan).ce_sum
            got.backward()
    return {
        "loss": [got.item(), want.item()],
        "grad_rel": _grad_rel(split, {n: p.grad for n, p in ref.named_parameters()}),
        "float8_all_gathers": len(calls),
        "collectives": counter.counts(),
        "targets": int((labels[:, 1:] != -100).sum()),
    }


def run_case(cls: str, extra: dict, chunk: int, mesh, data: tuple[str, ...] = ("dp_shard_cp",)) -> dict:  # type: ignore[no-untyped-def]
    """Tensor parallel over ``mesh["tp"]``, then FSDP2 over the ``data`` dimensions of ``mesh`` (one: flat FSDP2;
    ``("dp_replicate", "dp_shard")``: HSDP), in fp64, against the whole model on both data ranks' batches."""
    plan = LossPlan(chunk_tokens=chunk)
    dp_mesh = mesh[data] if len(data) > 1 else mesh[data[0]]
    dp_rank = mesh[data[0]].get_local_rank()
    batches = [_batch(r) for r in range(DP)]
    total = sum(count_target_tokens(labels) for _, labels in batches)
    # The whole model on both data ranks' batches (every rank computes it alike).
    ref = _model(cls, extra)
    want = sum(causal_lm_loss(ref, {"input_ids": i}, lab, plan).ce_sum for i, lab in batches) / total
    want.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])).item()
    # Tensor parallel over tp, then FSDP2 per decoder layer and the root over the data ranks.
    model = _model(cls, extra)
    line = apply_tensor_parallel(model, mesh["tp"], tp_plan_for(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    ids, labels = batches[dp_rank]
    local = causal_lm_loss(model, {"input_ids": ids}, labels, plan).ce_sum
    (local * DP / total).backward()  # FSDP2 averages over the DP data ranks
    got = torch.tensor([local.item()], dtype=torch.float64)
    dist.all_reduce(got)  # every rank; each tp rank of a data rank counted its batch once
    grad_rel = _grad_rel(model, ref_grads)
    placements = {
        name: str(tuple(param.placements)) if isinstance(param, DTensor) else "plain"
        for name, param in model.named_parameters()
    }
    norm = clip_grad_norm(model, 1e9).item()  # the library's clip over 2-D DTensors
    return {
        "loss": [got.item() / TP / total, want.item()],
        "grad_rel": grad_rel,
        "norm": [norm, ref_norm],
        "line": line,
        "placements": placements,
    }


def bf16_checkpointed(mesh) -> dict:  # type: ignore[no-untyped-def]
    """Llama (untied, the chunked loss: loss parallel) under tensor parallel 2 x FSDP2 over 2 data ranks with the
    run's bf16 policy (bf16 compute, fp32 master weights and reductions) and each activation-checkpointing mode,
    applied as :func:`~hf_fsdp2.parallel.parallelize.parallelize` orders it (tp, then checkpointing, then FSDP2):
    the loss and gradients of each mode, the collectives of each backward, against the whole model computing in bf16
    on the same (rounded) weights and both data ranks' batches."""
    plan = LossPlan(chunk_tokens=8)
    extra = {"tie_word_embeddings": False}
    dp_rank = mesh["dp_shard_cp"].get_local_rank()
    batches = [_batch(r) for r in range(DP)]
    total = sum(count_target_tokens(labels) for _, labels in batches)
    ref = _model("LlamaConfig", extra, torch.bfloat16)
    want = sum(causal_lm_loss(ref, {"input_ids": i}, lab, plan).ce_sum for i, lab in batches) / total
    want.backward()
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    out: dict = {"want": want.item()}
    for mode in ("none", "full", "selective"):
        model = _model("LlamaConfig", extra, torch.float32)
        apply_tensor_parallel(model, mesh["tp"], tp_plan_for(model))
        apply_activation_checkpointing(model, ACPlan(mode=mode), ("LlamaDecoderLayer",))
        policy = mixed_precision_policy("bf16", "float32")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard_cp"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp_shard_cp"], mp_policy=policy)
        ids, labels = batches[dp_rank]
        with CollectiveCounter() as forward:
            local = causal_lm_loss(model, {"input_ids": ids}, labels, plan).ce_sum
        with CollectiveCounter() as backward:
            (local * DP / total).backward()
        got = torch.tensor([local.item()], dtype=torch.float64)
        dist.all_reduce(got)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        out[mode] = {
            "loss": got.item() / TP / total,
            "grad_rel": _grad_rel(model, ref_grads),
            "forward": forward.counts(),
            "backward": backward.counts(),
            "targets": int((labels[:, 1:] != -100).sum()),
            "grads": grads,
        }
    # Checkpointing recomputes the same bf16 operations on the same inputs: each mode's gradients against none's.
    base = out["none"].pop("grads")
    for mode in ("full", "selective"):
        grads = out[mode].pop("grads")
        out[mode]["grad_diff"] = max((grads[n] - base[n]).abs().max().item() for n in base)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    out = Path(parser.parse_args().out)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp_shard_cp", "tp"))
    results: dict = {}
    # HSDP x TP: 2 replica groups of one shard each (the smallest HSDP mesh 4 ranks hold beside tp 2), over the tp
    # groups of the mesh above.
    hsdp = init_device_mesh("cpu", (DP, 1, TP), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    for name, run in (
        ("llama_hsdp_tp", lambda: run_case(*CASES[0][1:], hsdp, ("dp_replicate", "dp_shard"))),
        ("llama_bf16_checkpointed", lambda: bf16_checkpointed(mesh)),
    ):
        try:
            results[name] = run()
        except Exception:  # reported, so the test shows the failure
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr)
    try:
        results["llama_fp8_tensorwise"] = tp_alone_fp8(mesh)
    except Exception:  # reported, so the test shows the failure
        results["llama_fp8_tensorwise"] = {"error": traceback.format_exc()}
        print(results["llama_fp8_tensorwise"]["error"], file=sys.stderr)
    for name, cls, extra, chunk in CASES:
        try:
            results[name] = run_case(cls, extra, chunk, mesh)
            results[name]["tp_alone"] = tp_alone(cls, extra, chunk, mesh)
        except Exception:  # reported, so the test shows every case's failure
            results[name] = {"error": traceback.format_exc()}
            print(results[name]["error"], file=sys.stderr)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
