"""A tiny composite checkpoint on however many gloo ranks this is launched with (tests/distributed/test_composite_2rank.py).

``--mode names``: rank 0 loads the folder, the others build the model on meta (rank-0 loading); every rank's export
names (its checkpoint layout, ties dropped) gathered into ``--out``.

``--mode gathers``: the model loaded, its tower and projector frozen and parallelized through the library
(``--units run``: the run's units, the tower and the projector one unit each; ``--units no_split``: the composite's
``_no_split_modules`` union, the layout before them), two text steps with AdamW; per step, the bytes FSDP2
all-gathers and reduce-scatters and the units it all-gathers, into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _names(folder: str) -> list[str]:
    from hf_fsdp2.export.naming import checkpoint_layout, tied_targets
    from hf_fsdp2.model import load_model

    model = load_model(folder, empty_weights=dist.get_rank() != 0)
    drop = tied_targets(model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in drop}
    return list(checkpoint_layout(model, shapes).shapes(shapes))


class _Traffic:
    """FSDP2's all-gathers and reduce-scatters, counted where its collectives module calls torch.distributed."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

        self.gathered = self.reduced = 0
        self.units: list[str] = []
        gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

        def all_gather_single(*args: Any, **kwargs: Any) -> Any:
            out = kwargs.get("output", args[0] if args else None)
            self.gathered += out.numel() * out.element_size()
            return gather(*args, **kwargs)

        def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
            inp = kwargs.get("input", args[1] if len(args) > 1 else None)
            self.reduced += inp.numel() * inp.element_size()
            return scatter(*args, **kwargs)

        class _Dist:  # the module's view of torch.distributed, two functions counted
            def __getattr__(self, name: str) -> Any:
                return getattr(dist, name)

        counted = _Dist()
        counted.all_gather_single = all_gather_single  # type: ignore[attr-defined]
        counted.reduce_scatter_single = reduce_scatter_single  # type: ignore[attr-defined]
        _fsdp_collectives.dist = counted  # type: ignore[assignment]
        unshard = _fsdp_param_group.FSDPParamGroup.unshard
        traffic = self

        def counted_unshard(group: Any, async_op: bool = False) -> Any:
            before = traffic.gathered
            out = unshard(group, async_op)
            if traffic.gathered > before:
                traffic.units.append(group._module_fqn or "root")
            return out

        _fsdp_param_group.FSDPParamGroup.unshard = counted_unshard  # type: ignore[method-assign]

    def reset(self) -> dict[str, Any]:
        out = {"all_gather_bytes": self.gathered, "reduce_scatter_bytes": self.reduced, "units": self.units}
        self.gathered = self.reduced = 0
        self.units = []
        return out


def _gathers(folder: str, units: str) -> dict[str, Any]:
    from hf_fsdp2.composite import composite_spec, freeze_parts
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.model import decoder_layer_classes, fsdp_unit_classes, load_model
    from hf_fsdp2.parallel.accelerator import build_accelerator, sharded_units
    from hf_fsdp2.parallel.parallelize import ParallelPlan, parallelize
    from hf_fsdp2.train.optim import build_adamw, param_groups

    accelerator = build_accelerator(ShardingPlan(), mixed_precision="no", compile_plan=CompilePlan())
    traffic = _Traffic()
    model = load_model(folder)
    spec = composite_spec(model.config)
    assert spec is not None
    freeze_parts(model, spec, freeze_vision_tower=True, freeze_multi_modal_projector=True)
    layer_cls = decoder_layer_classes(model)
    if units == "run":
        plan = ParallelPlan(layer_cls=layer_cls, units=fsdp_unit_classes(model, layer_cls))
    else:  # the layout before the units: every class of the composite's _no_split_modules present
        present = {type(m).__name__ for m in model.modules()}
        plan = ParallelPlan(layer_cls=tuple(n for n in model._no_split_modules if n in present))
    model = parallelize(model, accelerator, plan)
    optimizer = build_adamw(
        param_groups(model, 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="cpu"
    )
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    steps = []
    traffic.reset()
    for step in range(2):
        ids = torch.randint(
            3, 1000, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank())
        )
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": float(loss), **traffic.reset()})
    states = [p for p in optimizer.state]
    return {
        "steps": steps,
        "frozen_numel": frozen,
        "optimizer_states_frozen": sum(1 for p in states if not p.requires_grad),
        "grads_frozen": sum(1 for p in model.parameters() if not p.requires_grad and p.grad is not None),
        "sharded_units": {k: list(v) for k, v in sharded_units(model).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("names", "gathers"), required=True)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--units", choices=("run", "no_split"), default="run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.mode == "names":
        dist.init_process_group("gloo")
        result: Any = _names(args.folder)
    else:
        result = _gathers(args.folder, args.units)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)  # every rank takes part
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As recipes/sft.py does: skip interpreter finalization, where gloo's worker threads can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
