"""AdamW vs Muon (``optim: muon``) on CPU: the loss after N steps, the step time and the optimizer's share of it.

    python bench/optim_bench.py                              # 2 gloo ranks, the body-heavy shape, 20 steps each
    python bench/optim_bench.py --procs 1 --steps 4 --hidden 128 --layers 2   # a quick look

The model is ``bench/trainer_bench.py --hidden 512 --layers 12``'s shape (Llama, intermediate 11/4 x hidden, 64-wide
heads, tied embeddings; a vocabulary of ``--vocab`` tokens), random-init with one seed, sharded by FSDP2 per
decoder layer and at the root (torch's ``fully_shard``, as the recipe's Accelerate path does), fp32. The data is
a learnable synthetic language (``--data-vocab`` of the tokens, each followed by one of 16 fixed random
successors: the loss can fall from ln(vocab) towards ln 16 = 2.77), the same batches for both optimizers. Each optimizer is the library's: ``build_adamw`` over
``param_groups``, or ``build_muon_adamw`` (Muon on the 84 decoder matrices, orthogonalised by owner ranks, AdamW
on the rest), the same peak lr (``match_rms_adamw``: Moonlight's point is that AdamW's lr carries over), constant.

Per optimizer: ``loss_first`` / ``loss_last`` (mean of the first / last 3 steps), ``step_s`` (median seconds of a
whole step after 2 warm-up steps), ``optim_s`` (median seconds of ``optimizer.step()``, ranks synchronised before
and after), ``optim_share`` (optim_s / step_s), ``comm_mib`` (Muon: MiB this rank sent in its all-to-alls per step),
``all_to_alls`` (Muon: per step, 2 per bucket of owner rounds; ``rounds``: the all-to-alls before buckets, 2 per round).
Each optimizer runs in its own ``torchrun`` (fresh processes); the JSON goes to ``--json`` and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def batches(vocab: int, used: int, n: int, rows: int, length: int, seed: int) -> list:
    """``n`` batches of ``rows`` x ``length`` tokens from one fixed random bigram table over ``used`` of the
    ``vocab`` tokens (16 equally likely next tokens each: the loss can fall from ln(vocab) past ln(used) towards
    ln(16) = 2.77), the same for every run."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab, generator=gen)[:used]
    nxt = tokens[torch.randint(0, used, (vocab, 16), generator=gen)]
    out = []
    for _ in range(n):
        ids = torch.empty(rows, length, dtype=torch.long)
        ids[:, 0] = tokens[torch.randint(0, used, (rows,), generator=gen)]
        for t in range(1, length):
            ids[:, t] = nxt[ids[:, t - 1], torch.randint(0, 16, (rows,), generator=gen)]
        out.append(ids)
    return out


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp2.train.muon import MuonSettings, build_muon_adamw
    from hf_fsdp2.train.muon_exchange import owner_rounds
    from hf_fsdp2.train.optim import build_adamw, param_groups

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    h = args.hidden
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=h,
        intermediate_size=h * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(h // 64, 1),
        num_key_value_heads=max(h // 128, 1),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # FSDP2 registers new (DTensor) parameters: the optimizer is built on them, after
    if args.optim == "muon":
        muon = MuonSettings(lr=args.lr, adjust_lr="match_rms_adamw", weight_decay=0.0)
        opt, split = build_muon_adamw(
            model, ["LlamaDecoderLayer"], muon, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, device_type="cpu"
        )
        if rank == 0:
            print(split.describe(), file=sys.stderr)
        rounds = 2 * len(owner_rounds([(int(p.shape[0]), int(p.shape[1])) for _, p in split.muon], world))
    else:
        rounds = 0
        opt = build_adamw(
            param_groups(model, 0.0), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, device_type="cpu"
        )
    data = batches(args.vocab, args.data_vocab, args.steps, args.rows * world, args.length, seed=1)
    losses, step_s, optim_s, comm, calls = [], [], [], [], []
    for ids in data:
        mine = ids[rank * args.rows : (rank + 1) * args.rows]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        dist.barrier()
        t1 = time.perf_counter()
        opt.step()
        dist.barrier()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        step_s.append(t2 - t0)
        optim_s.append(t2 - t1)
        comm.append(getattr(opt, "last_comm_bytes", 0))
        calls.append(getattr(opt, "last_collectives", 0))
    if rank == 0:
        skip = min(2, len(data) - 1)
        step, optim = statistics.median(step_s[skip:]), statistics.median(optim_s[skip:])
        print(
            "RESULT "
            + json.dumps(
                {
                    "optim": args.optim,
                    "procs": world,
                    "loss_first": statistics.mean(losses[:3]),
                    "loss_last": statistics.mean(losses[-3:]),
                    "losses": [round(v, 4) for v in losses],
                    "step_s": round(step, 3),
                    "optim_s": round(optim, 4),
                    "optim_share": round(optim / step, 4),
                    "comm_mib": round(comm[-1] / 2**20, 2),
                    "all_to_alls": calls[-1],
                    "rounds": rounds,  # the all-to-alls before buckets: 2 per owner round
                    "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optims", default="adamw,muon")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--data-vocab", type=int, default=256, help="tokens the synthetic language uses")
    ap.add_argument("--json", default=None)
    ap.add_argument("--optim", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.optim:
        child(args)
        return
    results: list[dict[str, Any]] = []
    for optim in args.optims.split(","):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.procs),
            "--master_port",
            str(29500 + os.getpid() % 1000),
            __file__,
            "--optim",
            optim,
            *[
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k in ("steps", "rows", "length", "lr", "hidden", "layers", "vocab", "data_vocab")
            ],
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.procs)))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"{optim} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[0][7:]))
        print(json.dumps(results[-1]), flush=True)
    print(
        f"{'optim':6} {'loss first3':>11} {'loss last3':>10} {'step s':>7} {'optim s':>8} {'share':>6} {'comm MiB':>8} "
        f"{'all-to-alls':>11} {'rounds':>6}"
    )
    for r in results:
        print(
            f"{r['optim']:6} {r['loss_first']:11.4f} {r['loss_last']:10.4f} {r['step_s']:7.3f} {r['optim_s']:8.4f} "
            f"{r['optim_share']:6.1%} {r['comm_mib']:8.2f} {r['all_to_alls']:11d} {r['rounds']:6d}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
