"""The memory a run needs on each rank, from the model config alone (``hf-fsdp2 plan``, docs/memory-plan.md).

No weight is read: the model is built with ``AutoModelForCausalLM.from_config`` on the meta device (LoRA
applied there too), and every figure comes either from arithmetic over its parameter shapes or from one
forward + backward of that meta model at the run's micro-batch shape. One concern per module, each standing on
the ones above it here:

- ``settings``: :class:`PlanSettings` (the recipe keys memory depends on), :class:`PlanError`, the headroom.
- ``meta_model``: the run's model on the meta device (LoRA by the run's builder, :mod:`hf_fsdp2.lora.build`).
- ``state``: parameters, gradients, AdamW state: FSDP2 splits each parameter along dim 0 as ``torch.chunk``
  does and stores every rank's piece in a buffer padded to the first chunk; sharded gradients are views of one
  padded reduce-scatter output per unit; AdamW's ``exp_avg`` / ``exp_avg_sq`` are the size of the rank's own
  (unpadded) piece, plus one fp32 ``step`` scalar per parameter. Exact per rank. And the FSDP buffers:
  unsharded parameters alive at once in the compute dtype (the tail unit and the root stay gathered from
  forward to backward; a decoder layer and the one prefetched after it) and the reduce-scatter buffers of
  the largest unit with gradients.
- ``saved``: :class:`SavedTensorMeter`, what autograd saves for backward (``saved_tensors_hooks``, unique
  storages, parameters excluded); the same meter measures a real run (tests/distributed/test_memory_plan.py).
- ``compute``: the meta forward + backward with the run's activation checkpointing
  (:func:`hf_fsdp2.parallel.activations.apply_activation_checkpointing`) and loss path: activations, loss, and
  the transient (the largest working set above them, from the live storages).
- ``table``: :func:`plan_memory` and the table; ``recommend``: the cheapest settings that fit a GPU;
  ``start``: the start-of-run plan and warning, and the model config a plan reads.

The command's parser is :mod:`hf_fsdp2.commands.plan`. This package re-exports the names below.
"""

from hf_fsdp2.plan.compute import ComputeBytes, compute_bytes
from hf_fsdp2.plan.meta_model import build_meta_model, check_plannable
from hf_fsdp2.plan.recommend import Candidate, format_recommendation, recommend
from hf_fsdp2.plan.saved import SavedBytes, SavedTensorMeter
from hf_fsdp2.plan.settings import DEFAULT_HEADROOM, PlanError, PlannedMethod, PlanSettings
from hf_fsdp2.plan.start import log_run_plan, memory_warning, read_model_config
from hf_fsdp2.plan.state import Unit, fsdp_buffer_bytes, fsdp_units, shard_rows, state_bytes
from hf_fsdp2.plan.table import MemoryPlan, format_plan, human_bytes, plan_memory

__all__ = [
    "Candidate",
    "ComputeBytes",
    "DEFAULT_HEADROOM",
    "MemoryPlan",
    "PlanError",
    "PlanSettings",
    "PlannedMethod",
    "SavedBytes",
    "SavedTensorMeter",
    "Unit",
    "build_meta_model",
    "check_plannable",
    "compute_bytes",
    "format_plan",
    "format_recommendation",
    "fsdp_buffer_bytes",
    "fsdp_units",
    "human_bytes",
    "log_run_plan",
    "memory_warning",
    "plan_memory",
    "read_model_config",
    "recommend",
    "shard_rows",
    "state_bytes",
]
