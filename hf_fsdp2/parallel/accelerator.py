"""Building the Accelerator for FSDP2 (GPU and CPU/gloo), mixed-precision policy, rank helpers.

Accelerate enables FSDP only for GPU-like distributed types. On a CPU-only machine it silently
falls back to MULTI_CPU (DDP-style) or to unsharded copies. :func:`build_accelerator` makes the very
same Accelerate FSDP2 path (``Accelerator.prepare`` -> activation checkpointing -> regional compile ->
``fully_shard`` per decoder layer) run on gloo, so the toolkit is tested end to end without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from hf_fsdp2 import collectives
from hf_fsdp2.config.plans import CompilePlan, MeshPlan, ShardingPlan
from hf_fsdp2.dtypes import MIXED_PRECISION, dtype_named
from hf_fsdp2.noise import quiet_foreign_noise
from hf_fsdp2.parallel.expert_shard import ExpertMeshes, load_rank0_state, shard_expert_layers
from hf_fsdp2.parallel.tensor import tp_prepared_by_torch

logger = logging.getLogger("hf_fsdp2")

_REDUCE_DTYPES = ("float32", "bfloat16", "float16")


def has_accelerator_device() -> bool:
    """True when a CUDA (or ROCm) device is visible: the default for compile and fused AdamW."""
    return torch.cuda.is_available()


def mixed_precision_policy(mixed_precision: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """The explicit FSDP2 mixed-precision policy.

    Accelerate's own default for ``mixed_precision="bf16"`` reduces gradients in bf16; hf_fsdp2
    reduces in fp32 unless told otherwise, so the policy is always built here, never inherited.

    Args:
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``"no"`` (compute in the parameters' dtype).
        reduce_dtype: dtype of the gradient reduce-scatter: ``"float32"``, ``"bfloat16"``, ``"float16"``.

    Returns:
        A ``MixedPrecisionPolicy`` with param_dtype, reduce_dtype and output_dtype set.

    Raises:
        ValueError: for an unknown mixed_precision or reduce_dtype.
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not one of {sorted(MIXED_PRECISION)}")
    reduce = dtype_named(reduce_dtype, "fsdp_reduce_dtype", _REDUCE_DTYPES)
    if mixed_precision == "no":
        # Everything stays in the parameters' own dtype (fp32 master weights): the policy is a no-op
        # except for an explicit reduce dtype.
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce)
    return MixedPrecisionPolicy(
        param_dtype=MIXED_PRECISION[mixed_precision],
        reduce_dtype=reduce,
        output_dtype=None,
        cast_forward_inputs=True,
    )


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_process_group_env() -> None:
    """Give a plain ``python recipes/sft.py`` run the env of a one-process launch.

    ``fully_shard`` needs a process group even for a world of one; setting the variables torchrun
    would set keeps a single-process run on exactly the same code path as a multi-process one.
    """
    if "RANK" in os.environ:
        return
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
    )


_LAUNCHER_MESH = {
    "dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "tp_size": "PARALLELISM_CONFIG_TP_SIZE",
    "cp_size": "PARALLELISM_CONFIG_CP_SIZE",
}


def launcher_mesh() -> dict[str, int]:
    """The mesh sizes ``accelerate launch`` passed (a ``parallelism_config:`` section of its config file or
    ``--parallelism_config_*`` flags), as config keys; empty when it passed none."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() not in ("1", "true"):
        return {}
    return {key: int(os.environ[var]) for key, var in _LAUNCHER_MESH.items() if os.environ.get(var)}


def world_size() -> int:
    """The number of processes of the launch (before the process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """The number of processes of the launch on this node (torchrun's and accelerate launch's
    ``LOCAL_WORLD_SIZE``; 1 without a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def build_accelerator(
    plan: ShardingPlan,
    *,
    mixed_precision: str,
    compile_plan: CompilePlan,
    timeout_s: int = 1800,
    host_timeout_s: int = collectives.HOST_WAIT_TIMEOUT_S,
    force_cpu: bool = False,
    log_with: list[Any] | None = None,
    mesh: MeshPlan | None = None,
    init_method: str | None = None,
) -> Accelerator:
    """Build an Accelerator whose ``prepare`` shards the model with FSDP2, on GPU or on CPU/gloo.

    Args:
        plan: sharding settings (decoder-layer classes, reshard, offload, AC, reduce dtype).
        mixed_precision: ``"bf16"``, ``"fp16"`` or ``"no"``; wins over the accelerate config file.
        compile_plan: regional compile settings.
        timeout_s: collective timeout of the process group, in seconds (``ddp_timeout``).
        host_timeout_s: timeout of the host (gloo) group that flags, objects and the waits behind rank 0's
            long work go over, in seconds (``host_wait_timeout``; see :mod:`hf_fsdp2.collectives`).
        force_cpu: run on CPU even when a GPU is visible (tests).
        log_with: accelerate trackers (``hf_fsdp2.observe.trackers.build_trackers``) that ``init_trackers`` starts.
        mesh: the device mesh; HSDP (``dp_replicate > 1``) goes to Accelerate as a ``ParallelismConfig``, whose
            2-D mesh every ``fully_shard`` then receives. None or flat: the default 1-D mesh over every rank.
        init_method: the default group's rendezvous (None: ``env://``; a restarted attempt's own:
            :func:`hf_fsdp2.elastic.agent.attempt_init_method`).

    Returns:
        The Accelerator. On CPU its process group is gloo and its distributed type is FSDP.

    Raises:
        ValueError: for inconsistent settings (e.g. CPU offload on a CPU-only run).
    """
    on_cpu = force_cpu or not has_accelerator_device()
    _ensure_process_group_env()
    if on_cpu and plan.cpu_offload:
        raise ValueError(
            "fsdp_cpu_offload=true on a CPU-only run: parameters already live in host memory; "
            "set fsdp_cpu_offload=false"
        )
    if on_cpu and compile_plan.enabled and compile_plan.mode == "max-autotune":
        raise ValueError("compile_mode='max-autotune' needs a GPU; use 'default' on CPU")
    if on_cpu and plan.ac.mode == "offload":
        raise ValueError(
            "activation_checkpointing=offload moves saved activations from GPU to host memory; on a CPU-only "
            "run they are in host memory already: use full"
        )
    policy = mixed_precision_policy(mixed_precision, plan.reduce_dtype)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=plan.reshard_after_forward,
        cpu_offload=plan.cpu_offload,
        mixed_precision_policy=policy,
        # The decoder-layer classes are known only once the model is loaded: shard_with_accelerate sets them.
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[],
        # hf_fsdp2 applies activation checkpointing and compile itself (parallelize): more modes than
        # accelerate's, and the same code on every path.
        activation_checkpointing=False,
        cpu_ram_efficient_loading=plan.cpu_ram_efficient_loading,
        state_dict_type="SHARDED_STATE_DICT",
    )
    dynamo = TorchDynamoPlugin(backend="no")
    # fp8: hf_fsdp2.parallel.float8 converts the decoder layers itself (accelerate's torchao path would convert every
    # linear but the first and last, after AC and compile); the Accelerator's dtype is that of everything else.
    mixed_precision = "bf16" if mixed_precision == "fp8" else mixed_precision
    timeout = timedelta(seconds=timeout_s)
    # The mesh is the recipe's (resolved from its keys or the launcher's, checked against the world size):
    # Accelerate must not build another one from the launcher's variables behind it.
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    parallelism = None
    if mesh is not None and (mesh.hybrid or mesh.tp > 1):
        # dp_shard x cp: context-parallel ranks share the parameter shards (torchtitan's dp_shard_cp); the
        # all-to-all backend needs no cp dimension in Accelerate's mesh (its cp means ring attention hooks).
        # tp innermost: the mesh whose "tp" dimension the model is split over (parallel/tensor.py) and whose data
        # dimensions FSDP2 shards over, one root mesh as fully_shard's 2-D path requires.
        parallelism = ParallelismConfig(
            dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.fsdp_shard, tp_size=mesh.tp
        )
    if on_cpu:
        # Accelerate only turns FSDP on for GPU-like types; on CPU it would hand back MULTI_CPU (DDP-style,
        # FSDP plugin ignored). Mark the shared state FSDP before the Accelerator reads it: accelerate's
        # FSDP2 prepare path itself runs unchanged on gloo. Pinned by tests/distributed/test_sharding.py;
        # a private write, guarded (docs/compatibility.md, tests/unit/test_upstream_patches.py).
        state = PartialState(
            cpu=True, timeout=timeout, **({"init_method": init_method} if init_method else {})
        )
        check_shared_state(state)
        state._shared_state["distributed_type"] = DistributedType.FSDP
        # The plugin too: with a parallelism config, Accelerator() validates the mesh against it (is_fsdp2)
        # before returning, and on CPU only the shared state can hold it by then.
        state._shared_state["fsdp_plugin"] = plugin
        accelerator = Accelerator(
            fsdp_plugin=plugin,
            mixed_precision=mixed_precision,
            cpu=True,
            dynamo_plugin=dynamo,
            log_with=log_with,
            parallelism_config=parallelism,
        )
        accelerator.state.fsdp_plugin = plugin
    else:
        if plan.cpu_offload:
            # Accelerate adds a CPU (gloo) backend beside NCCL only when it sees this variable; offloaded
            # parameters, gradient clipping and the export then have a backend for their CPU tensors.
            os.environ["FSDP_OFFLOAD_PARAMS"] = "true"
        accelerator = Accelerator(
            fsdp_plugin=plugin,
            mixed_precision=mixed_precision,
            dynamo_plugin=dynamo,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout, init_method=init_method)],
            log_with=log_with,
            parallelism_config=parallelism,
        )
    if accelerator.distributed_type != DistributedType.FSDP:
        raise RuntimeError(
            f"Accelerate chose distributed_type={accelerator.distributed_type}, not FSDP; "
            "launch with accelerate_configs/fsdp2.yaml (GPU) or fsdp2_cpu.yaml (CPU), or with torchrun"
        )
    # The plugin's policy must be ours even if Accelerator re-derived one from mixed_precision.
    accelerator.state.fsdp_plugin.mixed_precision_policy = policy
    # Every rank, right after the default group exists and before any other collective of the run.
    collectives.init_host_group(host_timeout_s)
    if mesh is not None and (mesh.cp > 1 or mesh.tp > 1):
        group = context_parallel_group(mesh, accelerator.device) if mesh.cp > 1 else None
        collectives.set_layout(cp=mesh.cp, tp=mesh.tp, cp_group=group)
    return accelerator


def context_parallel_group(mesh: MeshPlan, device: torch.device) -> Any:
    """This rank's context-parallel group: the ``cp`` ranks of the mesh dp_replicate x dp_shard x cp x tp (Accelerate's
    order) that hold the same batch and the same tensor-parallel index (collective: every rank creates every
    group)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (mesh.dp_replicate * mesh.dp_shard, mesh.cp, mesh.tp)
    grid = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "cp", "tp"))
    return grid["cp"].get_group()


def shard_with_accelerate(
    accelerator: Accelerator,
    model: torch.nn.Module,
    layer_cls_names: tuple[str, ...],
    *,
    frozen: bool = False,
    experts: ExpertMeshes | None = None,
    source: dict[str, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """``fully_shard`` each module of the classes ``layer_cls_names`` (the decoder layers; a composite's tower and
    projector), then the root, through Accelerate (its plugin holds the mesh, the
    mixed-precision policy, resharding and offload); the step of :func:`hf_fsdp2.parallel.parallelize.parallelize`
    after checkpointing and regional compile. Every rank takes part (collective when ``cpu_ram_efficient_loading``
    broadcasts rank 0's weights). The optimizer is built afterwards, on the sharded parameters. ``frozen``: a copy
    beside the trained model (a reference), sharded by Accelerate's FSDP2 function without being registered as the
    accelerator's model (it prepares one model under FSDP2).

    ``experts`` (expert parallel): the units that hold experts are sharded first, the experts on their own mesh
    (:func:`~hf_fsdp2.parallel.expert_shard.shard_expert_layers`); Accelerate shards the rest. Under
    ``cpu_ram_efficient_loading`` Accelerate then loads nothing, and every rank's shards are filled from rank 0's
    whole tensors ``source`` (taken before the experts were split; None on the other ranks).

    Returns:
        The sharded model.
    """
    plugin = accelerator.state.fsdp_plugin
    plugin.transformer_cls_names_to_wrap = list(layer_cls_names)
    if experts is None:
        return _prepare(accelerator, model, frozen)
    grid = accelerator.torch_device_mesh
    shard_expert_layers(
        model,
        layer_cls_names,
        experts,
        mesh=grid[tuple(accelerator.parallelism_config.fsdp_dim_names)] if grid is not None else None,
        fsdp_kwargs={
            "reshard_after_forward": plugin.reshard_after_forward,
            "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        },
        upcast=accelerator.mixed_precision != "no",
    )
    # Accelerate looks each class up by name: a class whose every module is sharded now bears FSDP's name.
    present = {type(m).__name__ for m in model.modules()}
    plugin.transformer_cls_names_to_wrap = [n for n in layer_cls_names if n in present]
    rank0_loading = bool(plugin.cpu_ram_efficient_loading)
    plugin.cpu_ram_efficient_loading = False  # its broadcast would carry rank 0's block of the experts only
    try:
        model = _prepare(accelerator, model, frozen)
    finally:
        plugin.cpu_ram_efficient_loading = rank0_loading
    if rank0_loading:
        load_rank0_state(
            model, source, accelerator.device, offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy)
        )
    return model


def _prepare(accelerator: Accelerator, model: torch.nn.Module, frozen: bool) -> torch.nn.Module:
    if frozen:
        return fsdp2_prepare_model(accelerator, model)
    with warnings.catch_warnings(), _torchao_checked_once():
        # Accelerate slices its flattened dp_shard_cp dim for HSDP's 2-D mesh; torch warns about a future change.
        warnings.filterwarnings("ignore", message=".*Slicing a flattened dim.*")
        # A tensor-parallel model is split already (parallel/tensor.py): Accelerate shards it over the data dims only.
        with tp_prepared_by_torch(accelerator):
            return accelerator.prepare(model)


def check_shared_state(state: Any) -> None:
    """The guard of the CPU path's write into accelerate's private state: ``PartialState`` keeps its fields in the
    class-wide ``_shared_state`` dict (the Borg pattern: every instance's ``__dict__`` is it), which the Accelerator
    built next reads ``distributed_type`` and ``fsdp_plugin`` from.

    Raises:
        RuntimeError: this accelerate keeps its state otherwise: the write would change nothing and the CPU run
            would silently not shard; names the versions tested.
    """
    shared = getattr(type(state), "_shared_state", None)
    if not isinstance(shared, dict) or state.__dict__ is not shared:
        raise RuntimeError(
            "accelerate's PartialState no longer keeps its fields in the shared _shared_state dict (accelerate "
            f"{_accelerate_version()}): a CPU (gloo) run cannot mark itself FSDP, and would not be sharded. Run on a "
            "GPU, or install the accelerate docs/compatibility.md lists as tested (pip install 'accelerate==1.16.*')"
        )


def _accelerate_version() -> str:
    import accelerate

    return str(getattr(accelerate, "__version__", "?"))


@contextlib.contextmanager
def _torchao_checked_once() -> Iterator[None]:
    """Accelerate's FSDP2 prepare asks ``is_torchao_available()`` twice per parameter, and each answer reads package
    metadata (~2.4 ms): ~0.7 s of a rank's start-up for a 30-layer model. The answer cannot change during the
    prepare, so it is read once there.

    A process-wide patch of ``accelerate.utils.modeling.is_torchao_available`` for the duration of the block,
    restored after it. Guarded (docs/compatibility.md): patched only where accelerate's parameter matching
    (``modeling._get_parameter_id``) looks the name up in that module at call time; otherwise nothing is patched."""
    from accelerate.utils import modeling

    check = getattr(modeling, "is_torchao_available", None)
    reader = getattr(modeling, "_get_parameter_id", None)
    if check is None or "is_torchao_available" not in getattr(
        getattr(reader, "__code__", None), "co_names", ()
    ):
        logger.debug(
            "accelerate %s: is_torchao_available is not read per parameter; not patched",
            _accelerate_version(),
        )
        yield  # another accelerate: nothing to shorten
        return
    answer = bool(check())
    modeling.is_torchao_available = lambda: answer
    try:
        yield
    finally:
        modeling.is_torchao_available = check


def describe_layout(model: torch.nn.Module) -> str:
    """How the first sharded parameter is laid out: its placements on its mesh (``(Shard(dim=0),)`` on a flat
    mesh; ``(Replicate(), Shard(dim=0))`` on HSDP's replicate x shard mesh), local and global shapes."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            dims = ", ".join(f"{n}={k}" for n, k in zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))
            return (
                f"{name} {tuple(param.placements)} on mesh ({dims or mesh.shape}), local "
                f"{tuple(param.to_local().shape)} of {tuple(param.shape)}"
            )
    return "no sharded parameter"


def sharded_units(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """FSDP units by module class: ``{class name: (units, parameters each unit manages)}``.

    Parameters are counted once, in the innermost unit that manages them (global, unsharded sizes).
    """
    from torch.distributed.fsdp import FSDPModule

    units: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in reversed(modules):  # innermost first
        count = 0
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        name = type(module).__name__.removeprefix("FSDP")
        n, total = units.get(name, (0, 0))
        units[name] = (n + 1, total + count)
    return units


def describe_policy(policy: MixedPrecisionPolicy) -> str:
    """One line for the start-of-run log."""

    def name(dtype: torch.dtype | None) -> str:
        return "param dtype (no cast)" if dtype is None else str(dtype).replace("torch.", "")

    return (
        f"params {name(policy.param_dtype)}, gradient reduction {name(policy.reduce_dtype)}, "
        f"outputs {name(policy.output_dtype)}"
    )


def setup_logging(is_main_process: bool) -> None:
    """INFO logs on rank 0 only; other ranks report warnings and errors."""
    logging.basicConfig(
        level=logging.INFO if is_main_process else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    quiet_foreign_noise()
