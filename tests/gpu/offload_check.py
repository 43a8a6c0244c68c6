"""Activation offload vs the same run without it, on one GPU: host bytes moved, device peak, loss.

    python tests/gpu/offload_check.py --out /tmp/offload.json     # a CUDA GPU (scripts/gpu_check.sh runs it)
    python tests/gpu/offload_check.py --dry-run                   # any machine: parse the flags, build nothing

Two runs of a random-init Llama built from a config (``--hidden``, ``--layers``; seed 0, fp32 master weights,
bf16 compute, FSDP2 at world size 1 as ``parallelize`` shards a run), ``--steps`` steps of the library's
``train_step`` on the same random rows of ``--batch`` x ``--seq`` tokens: ``activation_checkpointing: full``
and ``offload`` (``full`` whose one saved tensor per layer, its input, goes to pinned host memory). Measured per
run: ``torch.cuda.max_memory_allocated`` over the steps, the bytes the offload hooks copied to the host (counted
by wrapping ``torch.autograd.graph.save_on_cpu``, which the library's hooks use for the copy), the losses and
gradient norms per step. The expected host bytes: every layer's input, ``steps x layers x batch x seq x hidden x
2`` (bf16). Writes JSON (``--out``); tests/gpu/test_gpu_checks.py::test_activation_offload asserts on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="check the flags and imports, run nothing")
    args = ap.parse_args(argv)
    if min(args.hidden, args.layers, args.seq, args.batch, args.steps) < 1 or args.hidden % 64:
        ap.error("--hidden (a multiple of 64), --layers, --seq, --batch and --steps must be positive")
    return args


class HostCopies:
    """Counts the bytes ``torch.autograd.graph.save_on_cpu``'s pack hook copies to the host while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = torch.autograd.graph.save_on_cpu

    def __enter__(self) -> HostCopies:
        original, counter = self._original, self

        class Counting(original):  # type: ignore[misc, valid-type]
            def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
                super().__init__(pin_memory=pin_memory, device_type=device_type)
                pack = self.pack_hook

                def counted(tensor: torch.Tensor) -> Any:
                    counter.bytes += tensor.numel() * tensor.element_size()
                    return pack(tensor)

                self.pack_hook = counted

        torch.autograd.graph.save_on_cpu = Counting  # type: ignore[misc]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.autograd.graph.save_on_cpu = self._original  # type: ignore[misc]


def run_mode(acc: Any, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2.config.plans import ACPlan, ShardingPlan
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    device = acc.device
    config = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1),
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    sharding = ShardingPlan(activation_checkpointing=ACPlan(mode, pin_memory=device.type == "cuda"))
    model = parallelize(model, acc, ParallelPlan(layer_cls=("LlamaDecoderLayer",), ac=sharding.ac))
    opt = build_adamw(param_groups(model, 0.0), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, device_type=device.type)
    settings = StepSettings(plan_loss(model, 1024), max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with HostCopies() as copies:
        outs = [train_step(model, opt, None, [b], settings, device) for b in batches]
    torch.cuda.synchronize(device)
    result = {
        "peak_bytes": torch.cuda.max_memory_allocated(device),
        "host_bytes": copies.bytes,
        "losses": [o.loss() for o in outs],
        "grad_norms": [float(o.grad_norm) for o in outs],
    }
    acc._models.clear()
    acc._optimizers.clear()
    del model, opt, outs, settings
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.parallel.accelerator import build_accelerator

    expected = args.steps * args.layers * args.batch * args.seq * args.hidden * 2
    if args.dry_run:
        print(json.dumps({"dry_run": True, "expected_host_bytes": expected, **vars(args)}, default=str))
        return 0
    if not torch.cuda.is_available():
        sys.exit("offload_check.py: needs a CUDA device (activation offload moves GPU tensors to the host)")
    acc = build_accelerator(ShardingPlan(), mixed_precision="bf16", compile_plan=CompilePlan())
    report = {"layers": args.layers, "expected_host_bytes": expected, "modes": {}}
    for mode in ("full", "offload"):
        report["modes"][mode] = run_mode(acc, args, mode)
        print(mode, json.dumps(report["modes"][mode]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
