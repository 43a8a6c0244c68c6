"""The parameters FSDP2 holds unsharded on this rank, followed group by group: each FSDP2 parameter group's all-gathers
(an ``unshard`` that issues one) and the time between its unshard and its reshard, so that the peak of unsharded
parameter bytes alive at once is measured, not assumed (overall and for the modules under given prefixes). The bytes
of a group are its parameters' whole sizes in the gather dtype (``numel x itemsize``, padding not counted).

It wraps the groups' own ``unshard`` / ``_to_sharded`` / ``_to_sharded_post_forward`` on the instances (torch
2.13's ``FSDPParamGroup``; every all-gather, forward, backward or prefetched, goes through ``unshard``), so a
schedule FSDP2 changes shows up here; the all-gather count is checked against the dispatch-level
:class:`support.comm_count.CommCounter` by the test that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class UnshardPeak:
    """``gathers[name]``: all-gathers of the group of module ``name``; ``peak``: the most unsharded bytes alive at
    once (every group); ``peak_under``: the same, counting only the groups whose module names start with
    ``prefixes``."""

    prefixes: tuple[str, ...] = ()
    gathers: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    peak: int = 0
    peak_under: int = 0

    def reset(self) -> None:
        """Forget the counts and peaks (the live groups stay: they are unsharded now)."""
        self.gathers = dict.fromkeys(self.gathers, 0)
        self.peak = self.peak_under = 0

    def _alive(self, name: str) -> None:
        self.live.add(name)
        self.peak = max(self.peak, sum(self.sizes[n] for n in self.live))
        under = sum(self.sizes[n] for n in self.live if n.startswith(self.prefixes))
        self.peak_under = max(self.peak_under, under)

    def watch(self, model: torch.nn.Module) -> UnshardPeak:
        """Follow every FSDP2 parameter group of ``model`` (after ``fully_shard``)."""
        from torch.distributed.fsdp import FSDPModule

        seen: set[int] = set()
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            for k, group in enumerate(module._get_fsdp_state()._fsdp_param_groups):
                if id(group) in seen:  # one group over several modules (a tied embedding and head)
                    continue
                seen.add(id(group))
                key = name if k == 0 else f"{name}#{k}"
                dtype = group.mp_policy.param_dtype  # the gather dtype (None: the parameters' own)
                self.sizes[key] = sum(
                    p._orig_size.numel() * (dtype or p.sharded_param.dtype).itemsize
                    for p in group.fsdp_params
                )
                self.gathers[key] = 0
                self._wrap(key, group)
        return self

    def _wrap(self, key: str, group: Any) -> None:
        unshard, to_sharded, post_forward = group.unshard, group._to_sharded, group._to_sharded_post_forward

        def wrapped_unshard(*args: Any, **kwargs: Any) -> Any:
            before = group._all_gather_result
            out = unshard(*args, **kwargs)
            if before is None and group._all_gather_result is not None:
                self.gathers[key] += 1
                self._alive(key)
            return out

        def wrapped_sharded(*args: Any, **kwargs: Any) -> Any:
            self.live.discard(key)
            return to_sharded(*args, **kwargs)

        def wrapped_post_forward(*args: Any, **kwargs: Any) -> Any:
            self.live.discard(key)
            return post_forward(*args, **kwargs)

        group.unshard = wrapped_unshard
        group._to_sharded = wrapped_sharded
        group._to_sharded_post_forward = wrapped_post_forward
