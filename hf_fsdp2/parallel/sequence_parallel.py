"""Tensor parallel's module styles with sequence parallel between them (torchtitan's layout for a Llama block, written
for transformers' decoder layers), applied by :func:`hf_fsdp2.parallel.tensor.apply_tensor_parallel`.

Between the modules the residual stream is this rank's ``1/tp`` of the positions (a plain local tensor, so the
model's own code, the residual adds and the norms' elementwise work run unchanged on a part):

- the first decoder layer's input is cut to this rank's part (:class:`SplitSequence`: no communication; the
  backward all-gathers the gradient to the whole embedding output);
- every norm of a decoder layer and the final norm computes on its part (:class:`SequenceNorm`, torch's
  ``SequenceParallel``): its weight replicated, its gradient partial over tp (the sum of the parts), which FSDP2
  reduces with the parameter's other gradients;
- an attention or MLP block takes the whole sequence (:class:`GatherSequence`, torch's ``PrepareModuleInput``): one
  all-gather, kept as a replicated DTensor for the column-parallel projections, so their three (q/k/v) or two
  (gate/up) input gradients add up as one partial DTensor and leave the block in one reduce-scatter;
- the block's row-parallel output projection reduce-scatters its partial output to this rank's positions
  (:class:`RowwiseToSequence`, torch's ``RowwiseParallel(output_layouts=Shard(1))``);
- the embedding is split over the vocabulary (torch's ``RowwiseParallel``: an all-reduce of its output), and so is
  the output head (:class:`VocabHead`): it all-gathers its input, and the chunked loss computes on its vocabulary
  rows (loss parallel, :mod:`hf_fsdp2.train.chunked_ce`); the plain loss gathers the logits.

A decoder layer thus does 2 all-gathers and 2 reduce-scatters forward, the same backward. An eval-mode forward
(evaluation, generation, the loss plan's probe: any length, a one-token decode step) runs the same modules with the
stream whole on every rank (:class:`SequenceLayout`): an all-reduce per block instead, the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement


class SequenceLayout:
    """Whether this forward's residual stream is split over the tp ranks (training forwards), decided at the first
    decoder layer (the same on every rank of a tp group: they hold the same batch and mode), and its length."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.tp = mesh, mesh.size()
        self.split, self.length = True, 0

    def placement(self) -> Placement:
        """The residual stream's placement between modules in this forward."""
        return Shard(1) if self.split else Replicate()

    def wrap(self, x: torch.Tensor) -> DTensor:
        """``x``, this rank's residual stream, as the DTensor it is a part of (or a replica of)."""
        return DTensor.from_local(x, self.mesh, [self.placement()], run_check=False)


def _replicated(x: DTensor) -> DTensor:
    """``x`` replicated over its mesh: all-gathered (or all-reduced) when it is not already (no redistribution at all
    then, which compiled graphs would trace as an op of their own)."""
    return x if all(p.is_replicate() for p in x.placements) else x.redistribute(placements=[Replicate()])


def _hidden(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Callable[[Any], tuple[tuple, dict]]]:
    """The hidden states a module is called with (first positional, or ``hidden_states=``), and a function that puts a
    replacement in their place."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda new: ((new, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda new: (args, {**kwargs, "hidden_states": new})
    raise TypeError(
        "tensor parallel: a split module was called without its hidden states as the first argument or as "
        f"hidden_states= (got {len(args)} positional arguments and keywords {sorted(kwargs)})"
    )


def _replicate_params(done: dict[int, nn.Parameter], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition function: each direct parameter replicated over ``mesh`` (no communication:
    every rank loaded the same weights). ``done`` maps a parameter already converted to its DTensor, so a tied
    weight stays one parameter."""
    for key, param in list(module._parameters.items()):
        if param is None or isinstance(param, DTensor):
            continue
        new = done.get(id(param))
        if new is None:
            local = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
            new = nn.Parameter(local, requires_grad=param.requires_grad)
            done[id(param)] = new
        module.register_parameter(key, new)


def _shard_params(
    done: dict[int, nn.Parameter], placements: dict[str, Placement], module: nn.Module, mesh: DeviceMesh
) -> None:
    """Each parameter of ``module`` named in ``placements`` split by it (every rank slicing its own copy), the others
    replicated; a parameter already converted (tied) is reused."""
    for key, param in list(module._parameters.items()):
        if param is None:
            continue
        new = done.get(id(param))
        if new is None and isinstance(param, DTensor):
            continue
        if new is None:
            where = placements.get(key, Replicate())
            local = distribute_tensor(param.data, mesh, [where], src_data_rank=None)
            new = nn.Parameter(local, requires_grad=param.requires_grad)
            done[id(param)] = new
        module.register_parameter(key, new)


class SplitSequence(ParallelStyle):
    """On the first decoder layer: its input (the whole embedding output on every rank) cut to this rank's positions
    in training (the layout of this forward, set here). A training forward's length must be a multiple of tp (the
    step pads its batches: :func:`hf_fsdp2.parallel.all_to_all.pad_to_multiple`); evaluation and generation (eval
    mode: any length, a one-token decode step, a model that keeps only the last position's logits) keep the stream
    whole."""

    def __init__(self, layout: SequenceLayout) -> None:
        self.layout = layout

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        x, put = _hidden(args, kwargs)
        layout = self.layout
        layout.length = int(x.shape[1])
        layout.split = module.training
        if layout.split and layout.length % layout.tp:
            raise ValueError(
                f"tensor parallel: a training forward of {layout.length} positions, not a multiple of tp_size="
                f"{layout.tp}: sequence parallel splits the positions evenly over the tp ranks; pad the batch to a "
                "multiple of tp_size (hf_fsdp2.parallel.all_to_all.pad_to_multiple, as the training step does)"
            )
        if isinstance(x, DTensor) or not layout.split:
            return put(x)
        whole = DTensor.from_local(x, layout.mesh, [Replicate()], run_check=False)
        return put(whole.redistribute(placements=[Shard(1)]).to_local())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return module


class SequenceNorm(ParallelStyle):
    """A norm over the hidden size computing on this rank's positions (torch's ``SequenceParallel``); its parameters
    replicated over tp, their gradients partial sums over the parts."""

    def __init__(self, layout: SequenceLayout, done: dict[int, nn.Parameter]) -> None:
        self.layout, self.done = layout, done

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        return (x if isinstance(x, DTensor) else self.layout.wrap(x), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            functools.partial(_replicate_params, self.done),
            self._input,  # type: ignore[arg-type]
            _to_local,  # type: ignore[arg-type]
        )


class GatherSequence(ParallelStyle):
    """An attention or MLP block: its hidden states all-gathered to the whole sequence, handed on as a replicated
    DTensor (torch's ``PrepareModuleInput``) so that every column-parallel projection's input gradient is one
    partial sum, reduce-scattered once."""

    def __init__(self, layout: SequenceLayout) -> None:
        self.layout = layout

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        x, put = _hidden(args, kwargs)
        return put(_replicated(x if isinstance(x, DTensor) else self.layout.wrap(x)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return module


class Float8GatherSequence(GatherSequence):
    """:class:`GatherSequence` for a block whose column-parallel projections are all tensorwise float8 linears
    (torchao's ``PrepareFloat8ModuleInput``): the input cast to float8 (one scale for the whole sequence: an
    all-reduce of its max) before the all-gather, which then moves float8 bytes; the projections take it as cast."""

    def __init__(self, layout: SequenceLayout, linear_mm_config: Any) -> None:
        super().__init__(layout)
        self.linear_mm_config = linear_mm_config

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        from torchao.float8.config import e4m3_dtype
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, put = _hidden(args, kwargs)
        x = x if isinstance(x, DTensor) else self.layout.wrap(x)
        x = hp_tensor_to_float8_dynamic(
            x, e4m3_dtype, self.linear_mm_config, gemm_input_role=GemmInputRole.INPUT
        )
        return put(_replicated(x))


class RowwiseToSequence(ParallelStyle):
    """A block's output projection split over its input columns (this rank's heads or intermediate columns); its
    partial output reduce-scattered to this rank's positions (torch's ``RowwiseParallel(output_layouts=Shard(1))``),
    all-reduced when the forward's stream is whole."""

    def __init__(self, layout: SequenceLayout, done: dict[int, nn.Parameter]) -> None:
        self.layout, self.done = layout, done

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(-1)], run_check=False)
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.redistribute(placements=[self.layout.placement()]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"tensor parallel: a row-parallel module must be nn.Linear, not {type(module).__name__}"
            )
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _shard_params(self.done, {"weight": Shard(1)}, m, mesh),
            self._input,  # type: ignore[arg-type]
            self._output,  # type: ignore[arg-type]
        )


class Float8RowwiseToSequence(RowwiseToSequence):
    """:class:`RowwiseToSequence` for a tensorwise float8 linear (torchao's ``Float8RowwiseParallel``): its input cast
    to float8 (one scale over the tp ranks' columns: an all-reduce of the max), its output gradient cast to float8
    before the backward's all-gather."""

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        (x, *rest) = super()._input(module, inputs, mesh)
        config: Any = module.config
        x = hp_tensor_to_float8_dynamic(
            x,
            config.cast_config_input.target_dtype,
            module.linear_mm_config,
            gemm_input_role=GemmInputRole.INPUT,
        )
        return (x, *rest)

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic

        config: Any = module.config
        output = output.redistribute(placements=[self.layout.placement()])
        output = NoopFwToFloat8BwDynamic.apply(
            output, module.linear_mm_config, config.cast_config_grad_output.target_dtype
        )
        return output.to_local()


def tensorwise_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao float8 linear with one scale per tensor (what the float8 TP styles take)."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity

    config: Any = getattr(module, "config", None)
    return bool(
        config is not None and config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
    )


class VocabHead(ParallelStyle):
    """The output head split over the vocabulary (its weight's rows; the embedding's when tied): its input
    all-gathered to the whole sequence as a replicated DTensor, its logits gathered over the vocabulary (the chunked
    loss never asks for them: it computes from the input and this rank's rows, loss parallel)."""

    def __init__(self, layout: SequenceLayout, done: dict[int, nn.Parameter]) -> None:
        self.layout, self.done = layout, done

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, layout = inputs[0], self.layout
        if isinstance(x, DTensor):
            return (_replicated(x), *inputs[1:])
        if layout.split and x.shape[1] * layout.tp != layout.length:
            raise ValueError(
                f"tensor parallel: the output head got {x.shape[1]} positions of this rank's part of a "
                f"{layout.length}-position sequence: a training forward sliced the final hidden states "
                "(logits_to_keep), which sequence parallel cannot; run such forwards in eval mode (the stream whole)"
            )
        return (_replicated(layout.wrap(x)), *inputs[1:])

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return _replicated(output).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            lambda name, m, mesh: _shard_params(self.done, {"weight": Shard(0)}, m, mesh),
            self._input,  # type: ignore[arg-type]
            self._output,  # type: ignore[arg-type]
        )


def _to_dtensor(placement: str, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """Forward pre-hook: the first input as a DTensor on ``mesh`` (``"heads"``: sharded over its heads dim, the
    second to last; else replicated)."""
    if not inputs or not isinstance(inputs[0], torch.Tensor) or isinstance(inputs[0], DTensor):
        return inputs
    x = inputs[0]
    where = Shard(x.ndim - 2) if placement == "heads" else Replicate()
    return (DTensor.from_local(x, mesh, [where], run_check=False), *inputs[1:])


def _to_local(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    """Forward hook: a DTensor output back to this rank's local tensor (what the next HF module expects)."""
    return output.to_local() if isinstance(output, DTensor) else output


class Replicated(ParallelStyle):
    """Parameters replicated over tp; the module computes on DTensors between its input and output (torchtitan's
    ``NoParallel``). ``heads``: the input is this rank's heads (a per-head norm after a column-parallel projection),
    so the weight's gradient is partial over tp (summed by FSDP2's redistribution to Replicate)."""

    def __init__(self, done: dict[int, nn.Parameter], *, heads: bool = False) -> None:
        self.done, self.heads = done, heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            functools.partial(_replicate_params, self.done),
            functools.partial(_to_dtensor, "heads" if self.heads else "replicate"),  # type: ignore[arg-type]
            _to_local,  # type: ignore[arg-type]
        )
