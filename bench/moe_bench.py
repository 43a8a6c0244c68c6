"""Mixture of experts on CPU: the experts' kernels alone, and expert parallel against flat FSDP2 (bytes and tokens/s).

    python bench/moe_bench.py kernels                 # one experts module: per-expert loop vs grouped_mm
    python bench/moe_bench.py ep --procs 4            # ep 1 / 2 / 4 on 4 gloo ranks: bytes per step, tokens/s

``kernels``: one Qwen3-MoE experts module (``--hidden`` 1024, ``--inter`` 384, ``--experts`` 64, top ``--top-k`` 8:
Qwen3-30B-A3B's proportions at half its width) on ``--tokens`` 4096 tokens (a rank's micro-batch of 2 x 2048),
routed by a random router, forward + backward, fp32 (this CPU has no bf16 units), through each implementation
transformers 5 has: ``eager`` (the class's own loop: one matmul per expert that has tokens), ``grouped_mm``
(``torch.nn.functional.grouped_mm``: every (token, choice) row in one grouped matmul), and ``grouped_mm`` under the
fallback transformers takes when the kernel cannot run (``transformers::grouped_mm_fallback``: a loop of one matmul
per expert over the same sorted rows; under ``torch.compile`` with non-bf16 weights, on pre-Ampere GPUs). The median
of ``--repeats`` after one warm-up; the outputs checked equal.

``ep``: see :func:`ep_main`.

Each prints a Markdown table and, with ``--json``, writes its figures. Measured figures and commands:
docs/fsdp2-guide.md (MoE models).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _experts(hidden: int, inter: int, experts: int, top_k: int, implementation: str) -> Any:
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def _fallback(module: Any) -> Any:
    """``module``'s grouped_mm forward with transformers' fallback loop in place of the kernel (what it runs where
    ``_can_use_grouped_mm`` is false)."""
    import transformers.integrations.moe as moe

    def forward(*args: Any) -> Any:
        saved = moe._can_use_grouped_mm
        moe._can_use_grouped_mm = lambda *a: False  # type: ignore[assignment]
        try:
            return module(*args)
        finally:
            moe._can_use_grouped_mm = saved

    return forward


def kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward + backward of one experts module per implementation; rows and times."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    runs = {
        "eager (per-expert loop)": _experts(args.hidden, args.inter, args.experts, args.top_k, "eager"),
        "grouped_mm": _experts(args.hidden, args.inter, args.experts, args.top_k, "grouped_mm"),
    }
    fallback = _experts(args.hidden, args.inter, args.experts, args.top_k, "grouped_mm")
    calls = {name: m for name, m in runs.items()}
    calls["grouped_mm fallback (loop)"] = _fallback(fallback)
    results, reference = [], None
    for name, call in calls.items():
        times = []
        for i in range(args.repeats + 1):
            x = hidden.clone().requires_grad_(True)
            start = time.perf_counter()
            out = call(x, index, weights)
            out.square().sum().backward()
            if i:
                times.append(time.perf_counter() - start)
        reference = out.detach() if reference is None else reference
        results.append(
            {
                "implementation": name,
                "ms": round(1000 * statistics.median(times), 1),
                "max_diff": float((out.detach() - reference).abs().max()),
            }
        )
    base = next(r["ms"] for r in results if r["implementation"] == "grouped_mm")
    for r in results:
        r["vs_grouped_mm"] = round(r["ms"] / base, 2)
    params = 3 * args.hidden * args.inter * args.experts
    print(
        f"experts forward + backward: {args.experts} experts of {args.hidden} x {args.inter} ({params / 1e6:.1f}M "
        f"parameters), {args.tokens} tokens x top {args.top_k} = {args.tokens * args.top_k} rows, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("| implementation | ms | x grouped_mm | max |diff| |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['implementation']} | {r['ms']} | {r['vs_grouped_mm']} | {r['max_diff']:.1e} |")
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="one experts module: per-expert loop vs grouped_mm")
    k.add_argument("--hidden", type=int, default=1024)
    k.add_argument("--inter", type=int, default=384)
    k.add_argument("--experts", type=int, default=64)
    k.add_argument("--top-k", type=int, default=8)
    k.add_argument("--tokens", type=int, default=4096)
    k.add_argument("--repeats", type=int, default=3)
    k.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = kernels(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
