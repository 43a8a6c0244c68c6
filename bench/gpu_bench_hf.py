"""gpu_bench.py's hf_fsdp2 runners: one ``compile:ac:loss`` configuration measured in this process, with
the library's own pieces (``parallelize``, ``train_step``) on the rows of `gpu_bench_work`.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from gpu_bench_work import BETAS, EPS, LR, batch_counts, build, max_mem_gib, packed_batch, summarize, sync


def run_config(acc: Any, args: argparse.Namespace, item: str) -> dict[str, Any]:
    from hf_fsdp2.config.float8 import Float8Plan
    from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan
    from hf_fsdp2.observe.flops import flops_model, non_embedding_params
    from hf_fsdp2.parallel.compiling import CompileWatch
    from hf_fsdp2.parallel.float8 import convert_float8, finish_float8, fp8_hardware_problem
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    scope, ac, loss_path, precision = (item.split(":") + ["bf16"])[:4]
    device = acc.device
    # CPU: emulated on the tiny shape, whose linears are all below torchao's size thresholds (converted anyway, for
    # the numerics); a GPU measures speed with the run's own size filter
    on_gpu = device.type == "cuda"
    fp8 = Float8Plan(emulate=not on_gpu, size_filter=on_gpu) if precision == "fp8" else None
    if fp8 is not None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        problem = fp8_hardware_problem("cuda", capability, torch.cuda.get_device_name(device))
        if problem:
            return {"skipped": f"mixed_precision=fp8: {problem}"}
    torch._dynamo.reset()
    model = build(args, device)
    converted: list[str] = []
    if fp8 is not None:  # before the optimizer and fully_shard, as the recipe does (run/build.py)
        converted = convert_float8(model, ("LlamaDecoderLayer",), fp8).converted
    flops = flops_model(model.config, non_embedding_params(model))
    sharding = ShardingPlan(activation_checkpointing=ACPlan(ac, pin_memory=device.type == "cuda"))
    compile_plan = CompilePlan(enabled=scope != "eager", scope="regional" if scope == "eager" else scope)
    model = parallelize(
        model, acc, ParallelPlan(layer_cls=("LlamaDecoderLayer",), ac=sharding.ac, compile=compile_plan)
    )
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=BETAS, eps=EPS, device_type=device.type)
    if fp8 is not None:
        finish_float8(model, opt, fp8, device)
    settings = StepSettings(plan_loss(model, 1024 if loss_path == "chunked" else 0), max_grad_norm=1.0)
    batches = [packed_batch(args.seq, model.config.vocab_size, i) for i in range(args.warmup + args.steps)]
    counts = [batch_counts(b, flops) for b in batches[args.warmup :]]
    watch = CompileWatch(enabled=scope != "eager").start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int) -> Any:  # the library's own step: the one every recipe runs
        return train_step(model, opt, None, [batches[i]], settings, device)

    # FP8: before each warm-up step, the same forward without float8 casts at the same weights, and the loss bound of
    # hf_fsdp2/parallel/float8_bound.py from it (the GPU check holds each warm-up step's FP8 loss to it)
    reference = build(args, device).to(COMPUTE_DTYPE[device.type]) if fp8 is not None else None
    probes: list[dict[str, float]] = []
    start = time.perf_counter()
    outs = []
    for i in range(args.warmup):  # compile happens here: not timed
        probe = same_weights_reference(model, reference, converted, batches[i], device) if reference else None
        outs.append(step(i))
        if probe is not None:
            probes.append({"step": i, "fp8_loss": outs[-1].loss(), **probe})
    sync(device)
    warmup_s = time.perf_counter() - start
    if reference is not None:  # the timed steps' memory peak without the reference model
        del reference
        release_cache(device)
    compiled = watch.take()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        outs.append(step(i))
    sync(device)
    seconds = time.perf_counter() - start
    out = outs[-1]
    return {
        # every step's loss, read after the clock stopped (a read waits for the device)
        "losses": [o.loss() for o in outs],
        **({"fp8_probes": probes} if fp8 is not None else {}),
        "layers": model.config.num_hidden_layers,
        "precision": precision,
        **summarize(counts, seconds),
        "max_mem_allocated_gib": max_mem_gib(device),
        "final_loss": out.loss(),
        "compile_s": compiled.get("compile_s", 0.0),
        # recompiles during the timed steps (their time is in step_s): should be 0
        "recompiles_timed": watch.take().get("recompiles", 0.0) - compiled.get("recompiles", 0.0),
        "recompiles_total": compiled.get("recompiles", 0.0),
        "warmup_s": warmup_s,
    }


# The dtype the reference computes in: the FSDP2 policy's (bf16 on a GPU; fp32 on CPU, where the bench runs "no").
COMPUTE_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}


def same_weights_reference(
    model: torch.nn.Module,
    reference: torch.nn.Module,
    converted: list[str],
    batch: dict[str, torch.Tensor],
    device: torch.device,
) -> dict[str, float]:
    """The FP8 model's current weights loaded into ``reference`` (no float8 linears, eager, the compute dtype), its
    loss on ``batch`` (the recipe's: summed CE over the target tokens) and the run-time FP8 loss bound from its
    forward and backward (``Float8BoundProbe``)."""
    from hf_fsdp2.parallel.float8 import without_float8_wrapper
    from hf_fsdp2.parallel.float8_bound import Float8BoundProbe
    from hf_fsdp2.train.loss import causal_lm_loss, count_target_tokens, plan_loss

    dtype = next(reference.parameters()).dtype
    state = {}
    for key, value in model.state_dict().items():
        plain = without_float8_wrapper(value)
        plain = plain.full_tensor() if hasattr(plain, "full_tensor") else plain
        # regional compile and activation checkpointing wrap modules: the plain model's names have neither
        name = key.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        state[name] = plain.detach().to(dtype)
    reference.load_state_dict(state)
    reference.zero_grad(set_to_none=True)
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    probe = Float8BoundProbe(
        reference, converted, layer_cls_names=("LlamaDecoderLayer",), compute_dtype=dtype
    )
    with probe:
        out = causal_lm_loss(
            reference, inputs, batch["labels"].to(device), plan_loss(reference, 0, probe=False)
        )
        loss = out.ce_sum.float() / count_target_tokens(batch["labels"])
        loss.backward()
    bound = probe.result()
    reference.zero_grad(set_to_none=True)
    return {"ref_loss": float(loss), "bound": bound.bound, "worst_case": bound.worst}


def release_cache(device: torch.device) -> None:
    """Free what was released (the reference model) and start the memory peak again."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def release(acc: Any) -> None:
    """Free a configuration's model and optimizer (accelerate keeps references to what it prepared)."""
    acc._models.clear()
    acc._optimizers.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
