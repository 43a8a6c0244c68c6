"""The memory plan (``hf-fsdp2 plan``) against a real run on one GPU: predicted vs measured per item and peak.

    python bench/memory_plan_gpu.py --out bench/out/memory_plan_gpu.json     # on a GPU: ~2-4 min on an H200
    python bench/memory_plan_gpu.py --smoke --out /tmp/memory_plan_smoke.json  # any machine: tiny shape, CPU

The model: a Llama-3.2-1B-shaped config built in code (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP
8192, vocab 128256, tied embeddings; nothing downloaded), random init on the device in fp32, sharded as a run
shards it (``build_accelerator`` + ``parallelize``: one FSDP2 unit per decoder layer, bf16 compute, fp32
reduction) at world size 1, AdamW, the run's loss (``plan_loss``: chunked cross entropy by default) on full
rows of ``--seq`` random tokens, every token a target. For each activation-checkpointing mode (none, full,
every_k, selective, offload on a GPU) a fresh model is built and:

1. one step by hand, as tests/distributed/workers/memory_plan_worker.py measures it: the forward under
   :class:`~hf_fsdp2.plan.SavedTensorMeter` (bytes autograd keeps for backward: activations,
   and the loss's from the output head on), on a GPU also ``memory_allocated`` after the forward minus before
   it; backward; the unique storages of the local parameter shards and gradients; AdamW's step; its state;
2. ``--steps`` steps of the library's ``train_step`` (what a run calls), after
   ``torch.cuda.reset_peak_memory_stats``: ``max_memory_allocated`` is the measured peak.

The prediction is :func:`~hf_fsdp2.plan.plan_memory` of the same config and settings on the
meta device. Printed per mode: every item predicted and measured and their ratio; ``--out`` writes the JSON.
The parameter, gradient and optimizer bytes and the meter's activation and loss bytes are what
tests/distributed/test_memory_plan.py holds exact on CPU; on a GPU the kernels differ (flash or
memory-efficient attention, cuBLAS) and the peak adds the caching allocator's view: these are the figures
this script exists to measure. ``--smoke`` runs the same code on CPU with a tiny shape (no allocator
figures there: the peak is not measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ runs from a checkout
    sys.path.insert(0, str(REPO))

from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan  # noqa: E402
from hf_fsdp2.plan import PlanSettings, SavedTensorMeter, human_bytes, plan_memory  # noqa: E402

MIB = 2**20
ITEMS = ("params", "grads", "optimizer", "fsdp_buffers", "activations", "loss_logits", "transient", "peak")
# (hidden, layers, heads, kv heads, intermediate, vocab)
SHAPES = {"llama3.2-1b": (2048, 16, 32, 8, 8192, 128256), "tiny": (64, 2, 4, 2, 128, 1000)}


def llama_config(shape: str, seq: int) -> Any:
    from transformers import LlamaConfig

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=max(seq, 2048),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def release(acc: Any, device: torch.device) -> None:
    """Free what a mode built before the next one starts, so that its peak counts its own model only.

    ``del`` in :func:`measure_mode` is not enough: the accelerator keeps every model and optimizer it
    prepared (``_models``, ``_optimizers``), so each later mode's peak would include the earlier modes'
    parameters, gradients and AdamW state. The allocator's cache is emptied and its peak reset too.
    """
    acc._models.clear()
    acc._optimizers.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_mode(
    acc: Any, config: Any, mode: str, args: argparse.Namespace
) -> tuple[dict[str, Any], weakref.ref[torch.nn.Module]]:
    """Build, shard and train the model under ``mode``.

    Returns:
        The measured items (see the module docstring), and a weak reference to the mode's model: dead once
        :func:`release` has run after this returns, which the next mode records (``previous_model_alive``).
    """
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.model import decoder_layer_classes
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.loss import backward_scale, causal_lm_loss, count_target_tokens, plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    device = acc.device
    on_cuda = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    layer_cls = decoder_layer_classes(model)
    sharding = ShardingPlan(activation_checkpointing=ACPlan(mode, every_k=2, pin_memory=on_cuda))
    model = parallelize(model, acc, ParallelPlan(layer_cls=layer_cls, ac=sharding.ac))
    opt: torch.optim.Optimizer = build_adamw(
        param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, device_type=device.type
    )
    model.train()
    loss_plan = plan_loss(model, args.ce_chunk_tokens)
    gen = torch.Generator().manual_seed(1)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(3, config.vocab_size, (args.batch, args.seq), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    # 1. One step by hand: what the forward keeps, then the sharded state after backward and the step.
    b = {k: v.to(device) for k, v in batch().items()}
    inputs = {k: v for k, v in b.items() if k != "labels"}
    if on_cuda:
        torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device) if on_cuda else 0
    with SavedTensorMeter(model, layer_cls) as meter:
        out = causal_lm_loss(model, inputs, b["labels"], loss_plan)
    saved = meter.result()
    forward_allocated = torch.cuda.memory_allocated(device) - before if on_cuda else None
    (out.ce_sum * backward_scale(count_target_tokens(b["labels"]), 1)).backward()
    del out
    grads = storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    measured: dict[str, Any] = {
        "params": storage_bytes(list(model.parameters())),
        "grads": grads,
        "optimizer": storage_bytes(state),
        "activations": saved.activations,
        "loss_logits": saved.loss,
        "forward_allocated": forward_allocated,
        "chunk_tokens": loss_plan.chunk_tokens,
    }
    # 2. The run's own step: the allocator's peak over --steps steps.
    settings = StepSettings(loss_plan, max_grad_norm=1.0)
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step(model, opt, None, [batch()], settings, device)
    if on_cuda:
        torch.cuda.synchronize(device)
        measured["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        measured["peak"] = None  # no allocator statistics on CPU
    measured["step_s"] = (time.perf_counter() - start) / max(args.steps, 1)
    # The caller frees it (release) once this frame, whose locals (loss plan, meter) refer to it, is gone.
    return measured, weakref.ref(model)


def compare(predicted: dict[str, int], measured: dict[str, Any]) -> dict[str, float | None]:
    return {
        k: (measured[k] / predicted[k] if measured.get(k) is not None and predicted[k] else None)
        for k in ITEMS
    }


def format_mode(mode: str, predicted: dict[str, int], measured: dict[str, Any]) -> str:
    lines = [f"activation_checkpointing={mode}", f"  {'item':<14} {'predicted':>12} {'measured':>12}  ratio"]
    ratio = compare(predicted, measured)
    for k in ITEMS:
        got = measured.get(k)
        r = ratio[k]
        lines.append(
            f"  {k:<14} {human_bytes(predicted[k]):>12} {human_bytes(got) if got is not None else '-':>12}  "
            + (f"{r:.3f}" if r is not None else "-")
        )
    if measured.get("forward_allocated") is not None:
        lines.append(
            f"  forward_allocated (allocator, after forward - before): {human_bytes(measured['forward_allocated'])}"
            f" vs predicted activations + loss {human_bytes(predicted['activations'] + predicted['loss_logits'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, 1 step: proves the script runs")
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="default: llama3.2-1b (tiny: --smoke)"
    )
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default 2; 2 with --smoke)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 2048; 64 with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help="train steps measured per mode (default 3)")
    ap.add_argument("--ce-chunk-tokens", type=int, default=1024, help="the loss path (0 = plain logits)")
    ap.add_argument(
        "--modes", default=None, help="comma-separated (default: none,full,every_k,selective,offload)"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    cpu = args.smoke or not torch.cuda.is_available()
    args.shape = args.shape or ("tiny" if args.smoke else "llama3.2-1b")
    args.batch = args.batch or 2
    args.seq = args.seq or (64 if args.smoke else 2048)
    args.steps = args.steps or (1 if args.smoke else 3)
    # offload keeps layer inputs in pinned host memory: a GPU mode (parallelize applies it on CPU as asked).
    modes = (args.modes or "none,full,every_k,selective,offload").split(",")

    from hf_fsdp2.parallel.accelerator import build_accelerator

    acc = build_accelerator(ShardingPlan(), mixed_precision="bf16", compile_plan=CompilePlan(), force_cpu=cpu)
    device = acc.device
    config = llama_config(args.shape, args.seq)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": dict(
            zip(
                ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"),
                SHAPES[args.shape],
                strict=True,
            )
        ),
        "settings": {
            "world_size": 1,
            "micro_batch": args.batch,
            "seq": args.seq,
            "mixed_precision": "bf16",
            "ce_chunk_tokens": args.ce_chunk_tokens,
            "steps": args.steps,
        },
        "modes": {},
    }
    print(
        f"memory plan vs measured on {report['device']}: {args.shape}, micro-batch {args.batch} x {args.seq}"
    )
    previous: weakref.ref[torch.nn.Module] | None = None
    for mode in modes:
        settings = PlanSettings(
            world_size=1,
            micro_batch=args.batch,
            seq_len=args.seq,
            ac=ACPlan(mode, 2, pin_memory=not cpu),
            mixed_precision="bf16",
            load_dtype="float32",
            ce_chunk_tokens=args.ce_chunk_tokens,
            device_type=device.type,
            attn_implementation="sdpa",
        )
        plan = plan_memory(config, settings)
        predicted = {k: v for k, v in plan.rank_total(0).items() if k in ITEMS}
        # The previous mode's model must be gone (freed by release()) before this mode measures its peak.
        previous_alive = previous is not None and previous() is not None
        if previous_alive:
            print(
                f"WARNING: the previous mode's model is still alive when {mode} starts: its peak includes it"
            )
        measured, previous = measure_mode(acc, config, mode, args)
        release(acc, device)
        measured["previous_model_alive"] = previous_alive
        report["modes"][mode] = {
            "predicted": predicted,
            "measured": measured,
            "ratio": compare(predicted, measured),
        }
        print(format_mode(mode, predicted, measured), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
