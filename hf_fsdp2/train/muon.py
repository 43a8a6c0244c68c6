"""Muon for the decoder layers' 2-D matrices, AdamW for the rest, in one optimizer that works on FSDP2 shards.

Muon's update is the orthogonalised (Newton-Schulz) momentum of a whole matrix, but under FSDP2 each rank holds
only a row block of it (a ``Shard(0)`` DTensor). Everything elementwise (momentum, Nesterov, weight decay, the
update itself) runs on the local shards; only the orthogonalisation needs the whole matrix. Each matrix gets an
owner rank (largest first, to the least-loaded rank), and the matrices go in rounds of one per rank: one
``all_to_all`` sends every rank's row block of each matrix to its owner (bf16: what torch's Newton-Schulz casts to
first, so nothing is lost), each owner orthogonalises its one whole matrix with ``torch.optim.Muon``'s own
Newton-Schulz, and a second ``all_to_all`` sends the row blocks back. Rounds go in buckets (:func:`muon_buckets`,
up to :data:`MUON_BUCKET_BYTES` of whole matrices per rank): two asynchronous all-to-alls per bucket, the next
bucket's gather in flight while this one is orthogonalised. No rank holds more than two buckets of whole matrices,
every rank runs the same collectives in the same order (a rank without a matrix in a round sends and receives empty
blocks), and the bytes on the wire equal one bf16 reduce-scatter plus one all-gather of the Muon matrices
(``last_comm_bytes``).

The math is torch's (``torch.optim._muon``: Newton-Schulz and the learning-rate adjustment, including Moonlight's
``match_rms_adamw``); ``tests/unit/test_muon.py`` holds this optimizer to ``torch.optim.Muon`` bit for bit in
one process, and ``tests/distributed/test_muon_fsdp2.py`` to ``torch.optim.Muon`` + ``torch.optim.AdamW`` on 2 ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_fsdp2.train.muon_exchange import (
    MUON_BUCKET_BYTES,
    Exchange,
    Flight,
    _row_blocks,
    muon_buckets,
    owner_rounds,
)

logger = logging.getLogger("hf_fsdp2")

MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn values
# PEFT's LoRA factors (lora_A, lora_B, lora_embedding_A/B) and DoRA's magnitude: adapter tensors, never Muon's.
LORA_NAME = ".lora_"


def _torch_muon_pieces() -> tuple[
    Callable[..., torch.Tensor], Callable[..., float], tuple[float, float, float], float
]:
    """torch's Newton-Schulz, learning-rate adjustment, coefficients and epsilon (``torch.optim._muon``'s private
    names: the optimizer class has no per-matrix entry point).

    Raises:
        RuntimeError: this torch has no such functions; names the version and the fix.
    """
    try:
        from torch.optim._muon import (
            DEFAULT_A,
            DEFAULT_B,
            DEFAULT_C,
            EPS,
            _adjust_lr,
            _zeropower_via_newtonschulz,
        )
    except ImportError as err:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.optim._muon._zeropower_via_newtonschulz / _adjust_lr, which "
            "optim=muon runs on FSDP2 shards; use optim=adamw or the torch docs/compatibility.md lists (2.13)"
        ) from err
    return _zeropower_via_newtonschulz, _adjust_lr, (DEFAULT_A, DEFAULT_B, DEFAULT_C), EPS


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """Muon's knobs (the ``muon_*`` keys): torch.optim.Muon's arguments."""

    lr: float
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr: str = "match_rms_adamw"
    weight_decay: float = 0.0


@dataclass(frozen=True)
class ParamSplit:
    """Which trainable parameters Muon takes and which AdamW takes (names, in model order)."""

    muon: list[tuple[str, torch.nn.Parameter]]
    adamw_decay: list[tuple[str, torch.nn.Parameter]]
    adamw_no_decay: list[tuple[str, torch.nn.Parameter]]

    @property
    def lora(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The LoRA factors among AdamW's tensors (in the decay group, as under ``optim=adamw``)."""
        return [(n, p) for n, p in self.adamw_decay if LORA_NAME in n]

    def describe(self) -> str:
        """One log line: the two groups and their counts, the LoRA factors among AdamW's named."""
        count = lambda ps: sum(p.numel() for _, p in ps)  # noqa: E731
        adamw = self.adamw_decay + self.adamw_no_decay
        lora = self.lora
        adapters = (
            f"; LoRA's A/B factors on AdamW: {len(lora)} tensors ({count(lora) / 1e6:.2f}M), low-rank r x d "
            "halves of an update, not hidden weight matrices (Muon's)"
            if lora
            else ""
        )
        return (
            f"optimizer Muon + AdamW: Muon on {len(self.muon)} decoder-layer matrices "
            f"({count(self.muon) / 1e6:.2f}M parameters), AdamW on {len(adamw)} tensors ({count(adamw) / 1e6:.2f}M: "
            f"embeddings, head, norms, biases, other non-2-D tensors{adapters})"
        )

    def warning(self) -> str | None:
        """The warning for a run whose Muon group is empty (LoRA alone trains): every tensor steps with AdamW."""
        if self.muon or not self.lora:
            return None
        return (
            "optim=muon with use_peft=true: every trainable tensor is a LoRA factor or outside the decoder-layer "
            "matrices, so AdamW steps all of them (learning_rate; muon_lr and the muon_* keys do nothing) and this "
            "run trains as optim=adamw would; Muon is for the hidden weight matrices of full fine-tuning (or "
            "lora_modules_to_save inside the decoder layers)"
        )


def split_params(model: torch.nn.Module, layer_cls: Iterable[str]) -> ParamSplit:
    """Muon for the trainable 2-D hidden weight matrices inside the decoder layers, AdamW for the rest:
    embeddings, the head (and a score head), norms, biases, 3-D expert tensors (torch.optim.Muon takes 2-D
    matrices only), anything outside the layers, and LoRA's A/B factors. Matrices outside the layers and the
    LoRA factors decay under AdamW (as under ``optim=adamw``).

    LoRA's factors stay on AdamW: Keller Jordan's Muon ("an optimizer for the hidden weights"; everything else
    AdamW) and Moonlight define Muon for a network's weight matrices, neither for adapter factors, and hf_fsdp2 does
    not extend it to them. A layer's weight under LoRA is the frozen ``W`` plus ``B A``, and ``A``
    (r x in) and ``B`` (out x r) are low-rank halves of that update, not hidden weight matrices. Orthogonalising
    each factor's update sets its r singular values to one whatever the gradient's spectrum, does not orthogonalise
    the update of ``B A`` (what the layer sees), and torch's learning-rate adjustments are derived from a full
    matrix's shape (``original`` gives a 4096 x 16 ``B`` 16 times the rate of its 16 x 4096 ``A``). The learning
    rates LoRA is known to train at are AdamW's.

    Args:
        model: the unsharded model (LoRA applied, if any).
        layer_cls: the decoder-layer class names (what FSDP2 wraps).

    Returns:
        The split, each list in ``named_parameters`` order (the same on every rank).
    """
    names = set(layer_cls)
    in_layers: set[int] = set()
    for module in model.modules():
        # The class or a base: fully_shard swaps a module's class for an FSDP subclass (FSDPLlamaDecoderLayer).
        if any(cls.__name__ in names for cls in type(module).__mro__):
            in_layers.update(id(p) for p in module.parameters())
    muon: list[tuple[str, torch.nn.Parameter]] = []
    decay: list[tuple[str, torch.nn.Parameter]] = []
    no_decay: list[tuple[str, torch.nn.Parameter]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim == 2 and id(param) in in_layers and LORA_NAME not in name:
            muon.append((name, param))
        else:
            (decay if param.ndim >= 2 else no_decay).append((name, param))
    return ParamSplit(muon, decay, no_decay)


def _shard_group(tensor: torch.Tensor) -> tuple[dist.ProcessGroup | None, int, int]:
    """The process group over which ``tensor``'s rows are split, the world of that group and this rank's index.

    Raises:
        ValueError: a layout other than FSDP2's (rows split over one mesh dimension, replicated over the others).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None, 1, 0
    shard_dims = [d for d, p in enumerate(tensor.placements) if isinstance(p, Shard)]
    others_ok = all(isinstance(p, Replicate) for d, p in enumerate(tensor.placements) if d not in shard_dims)
    if len(shard_dims) != 1 or tensor.placements[shard_dims[0]] != Shard(0) or not others_ok:
        raise ValueError(
            f"optim=muon orthogonalises matrices whose rows FSDP2 splits over one mesh dimension; a parameter has "
            f"placements {tuple(tensor.placements)} (tensor parallel?): use optim=adamw with tp_size > 1"
        )
    mesh, dim = tensor.device_mesh, shard_dims[0]
    return mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer: AdamW groups (``algorithm: adamw``, stepped by a ``torch.optim.AdamW`` that shares their
    dicts and this optimizer's state) first, then one Muon group (``algorithm: muon``, torch.optim.Muon's keys and
    state: ``momentum_buffer``). One object, so the scheduler, clipping, the non-finite guard and DCP checkpoints
    see one optimizer; its state dict holds both algorithms' state, sharded as the parameters are.

    Args:
        muon_params: the matrices Muon steps (see :func:`split_params`).
        adamw_groups: AdamW's groups (``params``, ``weight_decay``).
        muon: Muon's settings.
        lr, betas, eps, fused: AdamW's.
        bucket_bytes: the whole matrices a rank gathers per bucket of rounds (0: :data:`MUON_BUCKET_BYTES`).
    """

    def __init__(
        self,
        muon_params: list[torch.nn.Parameter],
        adamw_groups: list[dict],
        muon: MuonSettings,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        fused: bool,
        bucket_bytes: int = 0,
    ) -> None:
        bucket_bytes = bucket_bytes or MUON_BUCKET_BYTES
        self._ns, self._adjust_lr, coefficients, eps_ns = _torch_muon_pieces()
        if muon.adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(f"muon_adjust_lr={muon.adjust_lr!r} is not one of {list(MUON_ADJUST_LR)}")
        bad = [tuple(p.shape) for p in muon_params if p.ndim != 2]
        if bad:
            raise ValueError(f"Muon takes 2-D matrices only; got shapes {bad[:3]}: give those to AdamW")
        groups = [dict(g, algorithm="adamw") for g in adamw_groups if g["params"]]
        self._adamw = (
            torch.optim.AdamW(
                groups, lr=lr, betas=betas, eps=eps, fused=fused, foreach=None if fused else True
            )
            if groups
            else None
        )
        muon_group = {
            "params": muon_params,
            "algorithm": "muon",
            "lr": muon.lr,
            "weight_decay": muon.weight_decay,
            "momentum": muon.momentum,
            "nesterov": muon.nesterov,
            "ns_coefficients": coefficients,
            "eps": eps_ns,
            "ns_steps": muon.ns_steps,
            "adjust_lr_fn": muon.adjust_lr,
        }
        all_groups = (self._adamw.param_groups if self._adamw else []) + ([muon_group] if muon_params else [])
        super().__init__(all_groups, {"lr": lr})
        self._link()
        self.bucket_bytes = bucket_bytes
        self.last_comm_bytes = 0  # bytes this rank sent in the last step's all-to-alls (the cost, measured)
        self.last_collectives = 0  # all-to-alls of the last step: 2 per bucket of rounds (muon_buckets)

    def _link(self) -> None:
        """Point the inner AdamW at this optimizer's AdamW group dicts and state (again after a load, which
        replaces both)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the inner AdamW re-linked to the loaded groups and state."""
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """AdamW's step on its groups, then Muon's on the matrices (every rank: the all-to-alls)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        # Parameters without a gradient are the same on every rank (FSDP2 gives every rank a gradient shard, empty
        # or not, for each parameter that took part), so the plan below is the same on every rank.
        params = [p for p in group["params"] if p.grad is not None]
        momentum, lr = group["momentum"], float(group["lr"])
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            # torch.optim.Muon's momentum and Nesterov lines (_single_tensor_muon), elementwise: shard by shard.
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        ortho = self._orthogonalise(params, updates, group)
        for p, o in zip(params, ortho, strict=True):
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o, alpha=-self._adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    def _orthogonalise(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict
    ) -> list[torch.Tensor]:
        """Each update's row block orthogonalised as part of its whole matrix (see the module docstring)."""
        ns = lambda m: self._ns(m, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
        if not params:
            return []
        pg, world, me = _shard_group(params[0])
        if world == 1:
            self.last_comm_bytes = self.last_collectives = 0
            return [ns(u) for u in updates]
        shapes = [(int(p.shape[0]), int(p.shape[1])) for p in params]
        blocks = [_row_blocks(r, world) for r, _ in shapes]
        for p, u, b in zip(params, updates, blocks, strict=True):
            if _shard_group(p)[0] is not pg or u.shape[0] != b[me]:
                raise RuntimeError(
                    f"a Muon matrix of shape {tuple(p.shape)} has a row block of {u.shape[0]} rows on rank {me} (rows "
                    f"by torch.chunk: {b}) or another process group: the FSDP2 layout is not the one optim=muon "
                    "assumes; use optim=adamw and report this"
                )
        rounds = owner_rounds(shapes, world)
        buckets = muon_buckets(rounds, shapes, world, self.bucket_bytes)
        ctx = Exchange(updates=updates, shapes=shapes, blocks=blocks, me=me, world=world, group=pg)
        out: list[torch.Tensor | None] = [None] * len(params)
        # A pipeline over buckets of rounds (every rank the same buckets, the same collectives in the same order):
        # the next bucket's gather is in flight while this one's matrices are orthogonalised, and each bucket's
        # scatter while the next is; at most two buckets' whole matrices are held at once.
        gather = ctx.gather([rounds[k] for k in buckets[0]])
        scatter: Flight | None = None
        for n in range(len(buckets)):
            gather.work.wait()
            current = gather
            if n + 1 < len(buckets):
                gather = ctx.gather([rounds[k] for k in buckets[n + 1]])
            done = ctx.scatter(current, [ns(whole) for whole in ctx.wholes(current)])
            if scatter is not None:
                scatter.work.wait()
                ctx.unpack(scatter, out)
            scatter = done
        assert scatter is not None
        scatter.work.wait()
        ctx.unpack(scatter, out)
        self.last_comm_bytes = ctx.sent
        self.last_collectives = 2 * len(buckets)
        return [o for o in out if o is not None]


def build_muon_adamw(
    model: torch.nn.Module,
    layer_cls: Iterable[str],
    muon: MuonSettings,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    device_type: str,
) -> tuple[MuonAdamW, ParamSplit]:
    """The run's Muon + AdamW optimizer on the sharded model (built after ``parallelize``, as every optimizer is).

    Args:
        model: the model (LoRA applied, if any).
        layer_cls: decoder-layer class names.
        muon: Muon's settings (its weight decay is the run's ``weight_decay``, as Moonlight).
        lr, betas, eps: AdamW's (its groups as :func:`hf_fsdp2.train.optim.param_groups`: decay on matrices).
        device_type: ``cuda`` or ``cpu`` runs torch's fused AdamW.

    Returns:
        The optimizer and the split (for the log line).
    """
    split = split_params(model, layer_cls)
    groups = [
        {"params": [p for _, p in split.adamw_decay], "weight_decay": muon.weight_decay},
        {"params": [p for _, p in split.adamw_no_decay], "weight_decay": 0.0},
    ]
    optimizer = MuonAdamW(
        [p for _, p in split.muon],
        groups,
        muon,
        lr=lr,
        betas=betas,
        eps=eps,
        fused=device_type in ("cuda", "cpu"),
    )
    return optimizer, split
