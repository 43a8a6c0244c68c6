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

Shapes change every step with real data (sequence lengths, padding-free token counts). With
``torch_compile_dynamic`` unset, a new length never recompiles (dynamo's automatic dynamic would recompile each
graph once on the second length): under ``regional`` each layer's sequence dims are marked dynamic before its
first compile; under ``model`` every frame compiles shape-generic from the first step (``dynamic=True``), because
most frames start after one of FSDP2's graph breaks, on tensors eager code hands them, which nothing can mark
(:func:`compile_model` says which breaks and why two recompiles remain).
The chunked loss runs eagerly (``hf_fsdp2.train.chunked_ce``: its loop count is the step's target rows), and
evaluation and generation run eagerly (:func:`eager`): no-grad, eval-mode and one-token-longer shapes would
each be new graphs, filling dynamo's per-function recompile limit (8) that training needs.
:class:`CompileWatch` logs every recompile and warns loudly when the limit is hit (dynamo then runs that
function eagerly for the rest of the run).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_fsdp2.config.plans import CompilePlan
from hf_fsdp2.parallel.activations import decoder_layers

logger = logging.getLogger("hf_fsdp2")

# dynamo writes one record to this logger per recompilation (with the failed guards) once the
# "recompiles" artifact is on.
_RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
# dynamo warns here when a function reaches config.recompile_limit and falls back to eager for good.
_LIMIT_LOGGER = "torch._dynamo.convert_frame"

# The dims of a decoder layer's inputs that follow the sequence length, by HF argument name (hidden_states is
# also the first positional argument). The batch dim is left static: it changes at most on a last short batch.
_LAYER_SEQ_DIMS: dict[str, tuple[int, ...]] = {
    "hidden_states": (1,),
    "position_ids": (1,),
    "position_embeddings": (1,),  # (cos, sin), each [batch, seq, head_dim]
    "attention_mask": (-2, -1),  # [batch, 1, query, key] when a dense mask is built
    "cache_position": (0,),
}


def _mark_dims(value: Any, dims: tuple[int, ...]) -> None:
    if isinstance(value, torch.Tensor):
        for dim in dims:
            if -value.dim() <= dim < value.dim():
                # maybe_: a dim the graph needs static (or of size 0/1) is specialised, not an error.
                torch._dynamo.maybe_mark_dynamic(value, dim % value.dim())
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_dims(item, dims)


def mark_sequence_dims(args: tuple, kwargs: dict[str, Any], dims: dict[str, tuple[int, ...]]) -> None:
    """Mark the sequence dims of a call's tensor arguments dynamic (before the compiled call, never inside).

    Args:
        args: positional arguments; the first one is marked as ``hidden_states``.
        kwargs: keyword arguments, marked by name from ``dims``.
        dims: argument name -> its sequence dims.
    """
    if args:
        _mark_dims(args[0], dims.get("hidden_states", ()))
    for name, value in kwargs.items():
        if name in dims:
            _mark_dims(value, dims[name])


def _with_dynamic_seq(fn: Callable[..., Any], dims: dict[str, tuple[int, ...]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        mark_sequence_dims(args, kwargs, dims)
        return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules eagerly inside (evaluation, generation): no graph is compiled or recompiled.

    Their shapes (no-grad, eval mode, one token longer per generated token) are not training's; compiling
    them would spend compile time on passes that run a few times per run and use up the per-function
    recompile limit that training's graphs share.
    """
    with torch.compiler.set_stance("force_eager"):
        yield


# The process-wide dynamo setting hf_fsdp2 changes (docs/compatibility.md); set, never restored: every compile of
# the run wants it.
DYNAMO_SETTING = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _configure_dynamo() -> None:
    # As torchtitan and accelerate do for per-block compile: the forward's Python side effects are not
    # replayed when activation checkpointing recomputes a compiled block. Guarded: a torch without the setting
    # (renamed or removed) is told, not given a new attribute it would ignore.
    config = torch._dynamo.config
    if not isinstance(getattr(config, DYNAMO_SETTING, None), bool):
        logger.warning(
            "torch %s has no torch._dynamo.config.%s: not set; a compiled block under activation checkpointing "
            "may replay its forward's side effects in the backward (docs/compatibility.md lists the torch tested)",
            torch.__version__,
            DYNAMO_SETTING,
        )
        return
    setattr(config, DYNAMO_SETTING, True)


# AOT autograd builds each traced value's FX node lazily from its inputs' nodes; with DTensor (tensor-parallel) layers
# and dynamic sequence dims, the symbolic shape arithmetic of the redistributions chains those builds deeper than
# Python's default recursion limit (1000): "RecursionError: maximum recursion depth exceeded" in proxy_tensor's
# _compute_proxy, with the aot_eager backend as with inductor, so on GPUs too (measured, torch 2.13: a Qwen3 layer
# under tp 2 fails at 1000 and compiles at 3000, to the eager losses). The depth is per compiled layer, not per model.
DTENSOR_COMPILE_RECURSION_LIMIT = 10_000


def _deepen_recursion_for_dtensors(model: torch.nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()) and (
        sys.getrecursionlimit() < DTENSOR_COMPILE_RECURSION_LIMIT
    ):
        logger.info(
            "regional compile of tensor-parallel layers: Python's recursion limit %d -> %d (AOT autograd's tracing "
            "of DTensor shapes under dynamic sequence dims recurses deeper than the default)",
            sys.getrecursionlimit(),
            DTENSOR_COMPILE_RECURSION_LIMIT,
        )
        sys.setrecursionlimit(DTENSOR_COMPILE_RECURSION_LIMIT)


# torch 2.11's inductor cannot compile the backward of a float64 Llama (its RMSNorm and rotary compute in float32
# inside a float64 graph: "expected scalar type Double but found Float" at the first backward, with or without
# activation checkpointing); float32 and bfloat16 models compile there. Checked on 2.11 and 2.13 (works); 2.12
# not checked, so refused below 2.13 (docs/compatibility.md).
FLOAT64_COMPILE_MIN_TORCH = (2, 13)


def check_compilable(
    model: torch.nn.Module, plan: CompilePlan, torch_version: str = torch.__version__
) -> None:
    """Refuse, before any compile, what this torch's compiler is known to fail on later (mid-step).

    Raises:
        ValueError: float64 parameters under an inductor compile on a torch older than 2.13, naming the fix.
    """
    from hf_fsdp2.compat import release

    if not plan.enabled or plan.kwargs().get("backend") != "inductor":
        return
    if release(torch_version)[:2] >= FLOAT64_COMPILE_MIN_TORCH:
        return
    if any(p.dtype == torch.float64 for p in model.parameters()):
        raise ValueError(
            f"torch_compile with float64 weights fails in torch {torch_version}'s inductor at the first backward "
            f"(a float64 Llama mixes float32 norms); use float32 or bfloat16 weights, set torch_compile: false, "
            f"or use torch >= {'.'.join(map(str, FLOAT64_COMPILE_MIN_TORCH))}"
        )


def compile_regions(model: torch.nn.Module, layer_cls_names: tuple[str, ...], plan: CompilePlan) -> list[str]:
    """Compile each decoder layer in place (outermost wrapper included), before ``fully_shard``.

    Returns:
        Names of the compiled modules.

    Raises:
        ValueError: no decoder layer found, or as :func:`check_compilable`.
    """
    check_compilable(model, plan)
    layers = decoder_layers(model, layer_cls_names)
    if not layers:
        raise ValueError(
            f"regional compile found no decoder layer of classes {list(layer_cls_names)} in "
            f"{type(model).__name__}; set fsdp_layer_cls_to_wrap"
        )
    _configure_dynamo()
    _deepen_recursion_for_dtensors(model)
    names = []
    for name, _ in layers:
        module = model.get_submodule(name)
        # The forward only: FSDP2's hooks (installed later, run by nn.Module.__call__) stay outside the
        # graph, and the checkpoint (hf_fsdp2.parallel.activations wraps the forward) inside it, traced as one
        # region, selective policy included. With FSDP2's hooks inside a checkpointed region (a
        # checkpoint_wrapper module around an FSDP unit) dynamo compiles nothing at all (measured).
        compiled = torch.compile(module.forward, **plan.kwargs())
        # dynamic unset: sequence dims dynamic from the first compile; True/False: the user's choice, as is.
        module.forward = _with_dynamic_seq(compiled, _LAYER_SEQ_DIMS) if plan.dynamic is None else compiled
        names.append(name)
    return names


def compiled_call_slot() -> bool:
    """Whether ``nn.Module.__call__`` (its ``_wrapped_call_impl``) still runs ``self._compiled_call_impl`` when set:
    the private slot :func:`compile_model` writes, as ``nn.Module.compile`` does (torch 2.11-2.13)."""
    call = getattr(torch.nn.Module, "_wrapped_call_impl", None)
    return "_compiled_call_impl" in getattr(getattr(call, "__code__", None), "co_names", ())


def compile_model(model: torch.nn.Module, plan: CompilePlan) -> str:
    """Compile the whole (already sharded) model in place; with ``plan.dynamic`` unset, shape-generic
    (``dynamic=True``) from the first compile.

    Why not the model inputs' sequence dims marked, as ``regional`` marks each layer's: dynamo breaks the graph at
    every FSDP2 unit's hooks (``torch._dynamo.disable``'d in torch's ``_fsdp_common.py``: the root, the embedding,
    each decoder layer, the tail), at transformers' ``capture_outputs`` (``next()`` on a dict key iterator, not
    traceable) and then skips the decoder stack's loop (a graph break inside a loop falls back to eager), so
    the rotary embedding, each layer, the final norm, the output class and the rest of the causal LM's forward
    are frames of their own, started on tensors that eager code hands them. Marks on the inputs reach the first
    frame only; each other frame compiled static and recompiled once on the second length (6 in the second step on
    a 2-layer Llama, 8 in the first two steps with the 2 below). Shape-generic frames compile once.

    The 2 recompiles that remain (both in the first step, none after): ``transformers.utils.deprecation``'s
    ``deprecate_kwarg`` wraps the forwards of the causal LM, the model, the decoder layer and the attention, and
    ``create_causal_mask``, in one ``wrapped_func`` code object, and dynamo keeps one cache per code object. Three
    of them start frames: the causal LM's forward, the model's (a graph break inside it ends the causal LM's frame
    at the call) and
    ``create_causal_mask`` (called from the model's forward once that falls back to eager); the second and third
    fail the earlier entries' guards on ``type(args[0])`` and ``len(args)``, which dynamo logs as recompiles. They
    go only by not starting frames at those functions, which would take editing the model's code (DESIGN.md rule
    5) or tracing FSDP2's hooks.

    Returns:
        The log line.

    Raises:
        ValueError: as :func:`check_compilable`.
    """
    check_compilable(model, plan)
    _configure_dynamo()
    # What nn.Module.compile does (so FSDP2's and the loss's hooks still run through __call__).
    if not compiled_call_slot():  # Guard: the private slot nn.Module.compile sets and __call__ runs
        raise RuntimeError(
            f"torch {torch.__version__}'s nn.Module.__call__ no longer runs _compiled_call_impl (what "
            "nn.Module.compile sets): the whole-model compile cannot install itself; set torch_compile_scope: regional, "
            "or use the torch docs/compatibility.md lists"
        )
    kwargs = plan.kwargs()
    if plan.dynamic is None:
        kwargs["dynamic"] = True
    model._compiled_call_impl = torch.compile(model._call_impl, **kwargs)
    shapes = (
        "shape-generic frames (dynamic=True: the frames between FSDP2's graph breaks cannot be marked)"
        if plan.dynamic is None
        else f"torch_compile_dynamic={plan.dynamic}"
    )
    return f"whole-model compile (in place, after fully_shard): {shapes}"


class _Counter(logging.Handler):
    def __init__(self, contains: str = "") -> None:
        super().__init__(level=logging.DEBUG)
        self.contains = contains
        self.count = 0
        self.last_reason = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if self.contains in message:
            self.count += 1
            self.last_reason = message


@dataclass(kw_only=True)
class CompileWatch:
    """Compile time and recompiles of this process, read between steps.

    ``start`` turns on dynamo's recompile log (each recompile's failed guards are then also printed,
    which is how to find the cause). ``take`` returns what happened since the previous call.
    """

    enabled: bool = False
    _seconds: float = 0.0
    _frames: int = 0
    _handler: _Counter = field(default_factory=_Counter)
    _limits: _Counter = field(default_factory=lambda: _Counter("recompile_limit"))
    _seen_recompiles: int = 0
    _seen_limits: int = 0

    def start(self) -> CompileWatch:
        if not self.enabled:
            return self
        torch._logging.set_logs(recompiles=True)
        logging.getLogger(_RECOMPILES_LOGGER).addHandler(self._handler)
        logging.getLogger(_LIMIT_LOGGER).addHandler(self._limits)
        self._seconds, self._frames = _compile_seconds(), _compiled_frames()
        return self

    def take(self) -> dict[str, float]:
        """``compile_s`` (seconds compiling since the last call), ``compiled_graphs``, ``recompiles`` and
        ``recompile_limit_hits`` (totals so far); empty when compile is off. Logs a warning for new recompiles,
        and an error-level one when a function hit dynamo's recompile limit (it then runs eagerly)."""
        if not self.enabled:
            return {}
        seconds, frames = _compile_seconds(), _compiled_frames()
        out = {
            "compile_s": max(seconds - self._seconds, 0.0),
            "compiled_graphs": float(frames),
            "recompiles": float(self._handler.count),
            "recompile_limit_hits": float(self._limits.count),
        }
        self._seconds = seconds
        if self._handler.count > self._seen_recompiles:
            logger.warning(
                "torch.compile recompiled %d time(s) so far; last: %s",
                self._handler.count,
                self._handler.last_reason[:300],
            )
            self._seen_recompiles = self._handler.count
        if self._limits.count > self._seen_limits:
            logger.error(
                "torch.compile hit dynamo's recompile limit (%d time(s)): that code now runs EAGERLY for the rest "
                "of the run, without compile's speed-up. Find the changing guard in the recompile log above; %s",
                self._limits.count,
                self._limits.last_reason.splitlines()[0][:300],
            )
            self._seen_limits = self._limits.count
        return out


def _compile_seconds() -> float:
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))
