"""torch.compile for FSDP2 models: per-layer (regional) or whole-model, with compile time and recompiles.

Both scopes compile *in place* (the module stays the same object), never by swapping in the
``torch.compile(module)`` wrapper: that wrapper would bypass ``nn.Module.__call__``, and hooks FSDP2 installs on the module
(all-gather before forward, reshard after, prefetch in backward) would never fire: every layer's
weights would then be gathered once for the whole step and the overlap lost.
``tests/distributed/test_compile.py`` records the all-gathers and prefetches of each step and checks
they are the same in eager, regional and whole-model runs.

- ``regional`` (default with a GPU): each decoder layer's forward (with its activation-checkpointing
  wrapper, so the checkpoint and a selective policy are compiled with it) is compiled before
  ``fully_shard``. All layers share one
  graph: compile time does not grow with depth.
- ``model``: the whole model is compiled after ``fully_shard``; dynamo breaks the graph at FSDP2's
  hooks, so it compiles several graphs; compile time grows with depth.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hf_fsdp2.config.plans import CompilePlan
from hf_fsdp2.parallel.activations import decoder_layers

logger = logging.getLogger("hf_fsdp2")

# dynamo writes one record to this logger per recompilation (with the failed guards) once the
# "recompiles" artifact is on.
_RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"


def _configure_dynamo() -> None:
    # As torchtitan and accelerate do for per-block compile: the forward's Python side effects are not
    # replayed when activation checkpointing recomputes a compiled block.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_regions(model: torch.nn.Module, layer_cls_names: tuple[str, ...], plan: CompilePlan) -> list[str]:
    """Compile each decoder layer in place (outermost wrapper included), before ``fully_shard``.

    Returns:
        Names of the compiled modules.

    Raises:
        ValueError: no decoder layer found.
    """
    layers = decoder_layers(model, layer_cls_names)
    if not layers:
        raise ValueError(
            f"regional compile found no decoder layer of classes {list(layer_cls_names)} in "
            f"{type(model).__name__}; set fsdp_layer_cls_to_wrap"
        )
    _configure_dynamo()
    names = []
    for name, _ in layers:
        module = model.get_submodule(name)
        # The forward only: FSDP2's hooks (installed later, run by nn.Module.__call__) stay outside the
        # graph, and the checkpoint (hf_fsdp2.parallel.activations wraps the forward) inside it, traced as one
        # region, selective policy included. With FSDP2's hooks inside a checkpointed region (a
        # checkpoint_wrapper module around an FSDP unit) dynamo compiles nothing at all (measured).
        module.forward = torch.compile(module.forward, **plan.kwargs())
        names.append(name)
    return names


def compile_model(model: torch.nn.Module, plan: CompilePlan) -> None:
    """Compile the whole (already sharded) model in place."""
    _configure_dynamo()
    model.compile(**plan.kwargs())


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.count = 0
        self.last_reason = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last_reason = record.getMessage().strip()


@dataclass
class CompileWatch:
    """Compile time and recompiles of this process, read between steps.

    ``start`` turns on dynamo's recompile log (each recompile's failed guards are then also printed,
    which is how to find the cause). ``take`` returns what happened since the previous call.
    """

    enabled: bool = False
    _seconds: float = 0.0
    _frames: int = 0
    _handler: _Counter = field(default_factory=_Counter)
    _seen_recompiles: int = 0

    def start(self) -> CompileWatch:
        if not self.enabled:
            return self
        torch._logging.set_logs(recompiles=True)
        logging.getLogger(_RECOMPILES_LOGGER).addHandler(self._handler)
        self._seconds, self._frames = _compile_seconds(), _compiled_frames()
        return self

    def take(self) -> dict[str, float]:
        """``compile_s`` (seconds compiling since the last call), ``compiled_graphs`` and ``recompiles``
        (totals so far); empty when compile is off."""
        if not self.enabled:
            return {}
        seconds, frames = _compile_seconds(), _compiled_frames()
        out = {
            "compile_s": max(seconds - self._seconds, 0.0),
            "compiled_graphs": float(frames),
            "recompiles": float(self._handler.count),
        }
        self._seconds = seconds
        if self._handler.count > self._seen_recompiles:
            logger.warning(
                "torch.compile recompiled %d time(s) so far; last: %s",
                self._handler.count,
                self._handler.last_reason[:300],
            )
            self._seen_recompiles = self._handler.count
        return out


def _compile_seconds() -> float:
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))
