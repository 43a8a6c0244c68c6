"""Muon on FSDP2 shards of awkward shapes vs torch.optim.Muon + AdamW in one process, on however many ranks.

The matrices' rows do not divide the world (uneven row blocks, and blocks of zero rows when a matrix has fewer rows
than ranks), and there are fewer matrices than ranks in the last round (a rank that owns nothing sends and receives
empty blocks). Every rank trains the same batches, so the sharded run's gradients are the reference's. Writes the
largest relative parameter difference after each step to --out (rank 0), with each step's all-to-alls (counted with
CommDebugMode) of the bucketed exchange and of the same optimizer with one round per bucket, whose parameters it
compares bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from hf_fsdp2.observe.comms import CollectiveCounter
from hf_fsdp2.train.muon import MuonSettings, build_muon_adamw
from hf_fsdp2.train.muon_exchange import MUON_BUCKET_BYTES, muon_buckets, owner_rounds


class Block(nn.Module):
    def __init__(self, d: int, wide: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, wide), nn.Linear(wide, d, bias=False)
        self.thin = nn.Linear(d, 2, bias=False)  # 2 rows: ranks beyond the second hold an empty block
        self.back = nn.Linear(2, d, bias=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(torch.tanh(self.up(h))) + self.back(torch.tanh(self.thin(h)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(37, 11), nn.Linear(11, 37)
        self.layers = nn.ModuleList([Block(11, 13), Block(11, 7)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Toy()
    ref, start = copy.deepcopy(model), copy.deepcopy(model)
    settings = MuonSettings(lr=0.02, momentum=0.9, adjust_lr="original", weight_decay=0.05)
    named = list(ref.named_parameters())
    adamw = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if "layers" not in n and p.ndim >= 2], "weight_decay": 0.05},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    muon = torch.optim.Muon(
        [p for n, p in named if "layers" in n and p.ndim == 2],
        lr=0.02,
        weight_decay=0.05,
        momentum=0.9,
        adjust_lr_fn="original",
    )
    per_round = copy.deepcopy(model)  # the same, each round its own bucket: 2 all-to-alls per round
    for m in (model, per_round):
        for layer in m.layers:
            fully_shard(layer)
        fully_shard(m)
    opt, split = build_muon_adamw(
        model, ["Block"], settings, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, device_type="cpu"
    )
    opt_round, _ = build_muon_adamw(
        per_round, ["Block"], settings, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, device_type="cpu"
    )
    opt_round.bucket_bytes = 1
    assert len(split.muon) == 8
    shapes = [(int(p.shape[0]), int(p.shape[1])) for _, p in split.muon]
    rounds = owner_rounds(shapes, dist.get_world_size())
    gen, diffs, sent, moves, counts, same = torch.Generator().manual_seed(1), [], [], [], [], []
    for _ in range(args.steps):
        ids = torch.randint(0, 37, (3, 9), generator=gen)
        pairs = ((model, opt.step), (per_round, opt_round.step), (ref, lambda: (adamw.step(), muon.step())))
        for m, step in pairs:
            loss = nn.functional.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            with CollectiveCounter() as counter:
                step()
            if m is not ref:
                counts.append(counter.counts().get("all_to_all", 0))
            m.zero_grad(set_to_none=True)
        sent.append(opt.last_comm_bytes)
        with torch.no_grad():
            worst = max(
                float((p.full_tensor() - q).abs().max() / q.abs().max().clamp(min=1e-6))
                for p, q in zip(model.parameters(), ref.parameters(), strict=True)
            )
            same.append(
                all(
                    torch.equal(p.to_local(), q.to_local())
                    for p, q in zip(model.parameters(), per_round.parameters(), strict=True)
                )
            )
            moved = max(
                float((q - q0).abs().max())  # absolute: LayerNorm's biases start at zero
                for q, q0 in zip(ref.parameters(), start.parameters(), strict=True)
            )
        diffs.append(worst)
        moves.append(moved)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "diffs": diffs,
                    "moved": moves,
                    "sent": sent,
                    "world": dist.get_world_size(),
                    "rounds": len(rounds),
                    "buckets": len(muon_buckets(rounds, shapes, dist.get_world_size(), MUON_BUCKET_BYTES)),
                    "all_to_alls": counts,  # per step: the bucketed optimizer's, then the per-round one's
                    "bit_identical": same,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
