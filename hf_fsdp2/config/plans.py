"""The settings objects the config sections build, and the parsers of their values.

Each is a small frozen dataclass or a pure function that checks its own values; the modules that apply a
setting (``parallel``, ``lora``, ``observe``, ``data``) import it from here, and nothing here imports them.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value or key a user must fix; the message says what and how."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition``."""
    if not condition:
        raise ConfigError(message)


AC_MODES = ("none", "full", "every_k", "selective", "offload")


@dataclass(frozen=True)
class ACPlan:
    """Which decoder layers are checkpointed, and how.

    Attributes:
        mode: one of :data:`AC_MODES`.
        every_k: for ``every_k``, checkpoint layers whose index is a multiple of k.
        pin_memory: for ``offload``, copy to pinned host memory (needs CUDA; False on CPU-only machines).
    """

    mode: str = "none"
    every_k: int = 2
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if self.mode not in AC_MODES:
            raise ValueError(f"activation_checkpointing={self.mode!r} is not one of {', '.join(AC_MODES)}")
        if self.every_k < 1:
            raise ValueError(f"ac_every_k={self.every_k} must be >= 1 (1 checkpoints every layer, as full)")

    def wraps(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) is checkpointed."""
        if self.mode == "none":
            return False
        if self.mode == "every_k":
            return index % self.every_k == 0
        return True


COMPILE_SCOPES = ("regional", "model")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class CompilePlan:
    """torch.compile settings; ``enabled=False`` means eager."""

    enabled: bool = False
    scope: str = "regional"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False

    def __post_init__(self) -> None:
        if self.scope not in COMPILE_SCOPES:
            raise ValueError(f"torch_compile_scope={self.scope!r} is not one of {', '.join(COMPILE_SCOPES)}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``nn.Module.compile``."""
        out: dict[str, Any] = {"backend": "inductor", "fullgraph": self.fullgraph}
        if self.mode not in (None, "default"):
            out["mode"] = self.mode
        if self.dynamic is not None:
            out["dynamic"] = self.dynamic
        return out


# What cannot run yet, and why (checked on this project's versions: accelerate 1.16, transformers 5.24, torch 2.13).
CP_BACKENDS = ("auto", "all_to_all", "ring")
# auto = all_to_all everywhere (any kernel, any mask, CPU and GPU); ring only when asked for, on CUDA, causal rows
# only (hf_fsdp2.parallel.ring.check_ring_settings refuses the rest at start-up, where the device and data are known).


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """The device mesh of a run, in Accelerate's ``ParallelismConfig`` names: ``dp_replicate`` x ``dp_shard``
    (x ``tp`` x ``cp``) = world size. ``dp_replicate > 1`` is HSDP: parameters sharded over the ``dp_shard``
    ranks of a replica group (one node) and replicated over the groups (across nodes).

    ``ep > 1`` is expert parallel (torchtitan's "dp2ep"): the routed experts of every MoE layer are split over ``ep``
    ranks borrowed from the ``dp_shard x cp`` ranks a parameter is sharded over (``ep`` innermost: ranks ``k x ep`` ..
    ``(k + 1) x ep - 1`` of a replica group share one expert split); the experts' own FSDP2 dimension is what remains,
    ``efsdp = dp_shard x cp / ep``. Every other parameter keeps the FSDP2 layout above. No extra ranks: ``ep`` is not a
    factor of the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    cp_backend: str = "all_to_all"
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks a parameter is sharded over: ``dp_shard x cp`` (context-parallel ranks share the shards, as in
        torchtitan)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks a routed expert is sharded over: ``dp_shard x cp / ep`` (expert parallel borrows ``ep`` of them)."""
        return self.fsdp_shard // self.ep

    def describe(self) -> str:
        if self.hybrid:
            text = (
                f"HSDP: {self.dp_replicate} replica groups x {self.fsdp_shard} shards (parameters sharded within a "
                f"group, gradients all-reduced across groups)"
            )
        else:
            text = f"flat FSDP2 over {self.fsdp_shard} ranks"
        if self.cp > 1:
            text += (
                f"; context parallel {self.cp} ({self.cp_backend}): each sequence split over {self.cp} ranks, "
                f"{self.dp_replicate * self.dp_shard} data-parallel ranks (dp_shard {self.dp_shard} x cp {self.cp} "
                "share the parameter shards)"
            )
        if self.tp > 1:
            text += (
                f"; tensor parallel {self.tp}: each decoder layer's linear weights split over {self.tp} ranks that "
                f"read the same batches, every parameter a 2-D DTensor (data shards x tp)"
            )
        if self.ep > 1:
            text += (
                f"; expert parallel {self.ep}: each MoE layer's routed experts split over {self.ep} ranks (tokens "
                f"exchanged by all-to-all), each split sharded over {self.efsdp} rank(s) (efsdp = dp_shard "
                f"{self.dp_shard} x cp {self.cp} / ep {self.ep}); every other parameter as above"
            )
        return text


def _size(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise ConfigError(f"{name}={value} must be >= 1")
    return value


def resolve_mesh(
    world: int,
    *,
    dp_replicate: int | None,
    dp_shard: int | None,
    tp: int | None,
    cp: int | None,
    cp_backend: str = "auto",
    ep: int | None = None,
) -> MeshPlan:
    """The mesh for ``world`` ranks from the configured sizes (None: 1, and ``dp_shard`` the rest).

    Raises:
        ConfigError: sizes that do not multiply to the world size (with the numbers), an unknown CP backend, an
            ``ep_size`` that does not divide ``dp_shard_size x cp_size``, or expert parallel with tensor parallel.
    """
    r = _size(dp_replicate, "dp_replicate_size") or 1
    t = _size(tp, "tp_size") or 1
    c = _size(cp, "cp_size") or 1
    e = _size(ep, "ep_size") or 1
    s = _size(dp_shard, "dp_shard_size")
    if s is None:
        if world % (r * t * c):
            raise ConfigError(
                f"dp_replicate_size({r}) x tp_size({t}) x cp_size({c}) = {r * t * c} does not divide the world size "
                f"{world}; choose sizes whose product divides the number of processes"
            )
        s = world // (r * t * c)
    if cp_backend not in CP_BACKENDS:
        raise ConfigError(f"cp_backend={cp_backend!r} is not one of {', '.join(CP_BACKENDS)}")
    mesh = MeshPlan(
        dp_replicate=r,
        dp_shard=s,
        tp=t,
        cp=c,
        cp_backend="all_to_all" if cp_backend == "auto" else cp_backend,
        ep=e,
    )
    if r > 1 and s * c == 1:
        raise ConfigError(
            f"dp_replicate_size={r} with dp_shard_size=1 replicates whole parameters on every rank (DDP), which "
            "FSDP2 through Accelerate does not run; shard within each group (dp_shard_size >= 2)"
        )
    if mesh.world != world:
        raise ConfigError(
            f"dp_replicate_size({r}) x dp_shard_size({s}) x tp_size({t}) x cp_size({c}) = {mesh.world}, but the "
            f"run has {world} processes; the sizes must multiply to the world size (leave dp_shard_size unset to "
            "take the rest)"
        )
    if e > 1:
        check_expert_mesh(mesh)
    return mesh


def check_expert_mesh(mesh: MeshPlan) -> None:
    """Refuse an expert-parallel size the mesh cannot hold (model-independent; the model's own checks are
    :func:`hf_fsdp2.parallel.experts.check_expert_parallel`).

    Raises:
        ConfigError: ``ep_size`` not dividing ``dp_shard_size x cp_size``, or with ``tp_size > 1``.
    """
    if mesh.tp > 1:
        raise ConfigError(
            f"ep_size={mesh.ep} with tp_size={mesh.tp} is not supported: tensor parallel leaves MoE layers whole "
            "(transformers' fused-expert plan styles have no torch equivalent) and expert parallel borrows data "
            "ranks, so the two would split one layer two ways; use tp_size=1 with ep_size, or ep_size=1"
        )
    if mesh.fsdp_shard % mesh.ep:
        raise ConfigError(
            f"ep_size={mesh.ep} does not divide dp_shard_size x cp_size = {mesh.dp_shard} x {mesh.cp} = "
            f"{mesh.fsdp_shard}: expert parallel borrows its ranks from the ranks a parameter is sharded over (the "
            f"experts keep dp_shard x cp / ep of them for their own FSDP2 shards); choose an ep_size that divides "
            f"{mesh.fsdp_shard}"
        )


@dataclass(frozen=True)
class HeadSplit:
    """How attention heads are scattered over ``cp`` ranks by the all-to-all context-parallel backend: each rank
    computes ``heads / cp`` query heads and ``kv_heads x kv_repeat / cp`` key/value heads (GQA models whose KV heads
    do not divide by ``cp`` repeat each KV head ``kv_repeat`` times before the all-to-all, as attention would repeat
    it anyway: more all-to-all bytes, the same result)."""

    heads: int
    kv_heads: int
    cp: int
    kv_repeat: int = 1

    def describe(self) -> str:
        per = f"{self.heads // self.cp} query heads and {self.kv_heads * self.kv_repeat // self.cp} key/value heads"
        repeat = (
            f"; each of the {self.kv_heads} key/value heads repeated {self.kv_repeat}x before the all-to-all "
            f"({self.kv_heads} does not divide by cp_size={self.cp})"
            if self.kv_repeat > 1
            else ""
        )
        return f"{per} per rank over the whole sequence{repeat}"


def split_heads(heads: int, kv_heads: int | None, cp: int) -> HeadSplit:
    """The head split of a model with ``heads`` query and ``kv_heads`` key/value heads over ``cp`` ranks.

    Raises:
        ConfigError: ``cp`` does not divide the query heads (each rank computes whole heads).
    """
    kv = kv_heads or heads
    if heads % cp:
        raise ConfigError(
            f"cp_size={cp} does not divide the model's num_attention_heads={heads} (per tensor-parallel rank): the "
            f"all-to-all backend gives each rank whole heads; choose a cp_size that divides {heads}"
        )
    if heads % kv:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    repeat = 1
    if kv % cp:
        # The fewest copies that make the KV heads divide by cp; lcm(kv, cp) divides heads (both do), so each
        # query group still maps onto whole KV heads.
        repeat = math.lcm(kv, cp) // kv
    return HeadSplit(heads, kv, cp, repeat)


def check_mesh(mesh: MeshPlan, *, heads: int | None, kv_heads: int | None, max_length: int) -> None:
    """Refuse a mesh the model or this version cannot run, before any work.

    Tensor parallel splits attention heads (a rank needs whole KV heads: ``tp_size`` must divide both head
    counts) and leaves FSDP2 the other ranks (at least 2: ``tp_size`` < world size). Context parallel (all-to-all) gives each rank whole heads
    of the whole sequence: ``cp_size`` must divide the query heads (:func:`split_heads`); sequences of any length
    are padded to a multiple of ``cp_size`` per micro-batch. ``cp_backend=ring`` splits no heads (its refusals:
    :func:`hf_fsdp2.parallel.ring.check_ring_settings`).

    Raises:
        ConfigError: naming the sizes and the numbers that do not fit.
    """
    if mesh.tp > 1:
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % mesh.tp:
                raise ConfigError(
                    f"tp_size={mesh.tp} does not divide the model's {name}={count}: each tensor-parallel rank "
                    "needs whole heads; choose a tp_size that divides it"
                )
        if mesh.fsdp_shard * mesh.dp_replicate == 1:
            raise ConfigError(
                f"tp_size={mesh.tp} takes every one of the {mesh.world} ranks: FSDP2 (through Accelerate) needs a data "
                "dimension to shard over; choose a tp_size that leaves at least 2 data ranks (tp_size <= world size / 2)"
            )
    if mesh.cp > 1 and heads is not None and mesh.cp_backend != "ring":  # ring splits no heads
        split_heads(heads // mesh.tp, kv_heads // mesh.tp if kv_heads else None, mesh.cp)


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """What :func:`build_accelerator` and :func:`~hf_fsdp2.parallel.parallelize.parallelize` apply; every field is explicit.

    ``activation_checkpointing`` takes an :class:`ACPlan`; ``True``/``False`` mean ``full``/``none``.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: ACPlan | bool = False
    reduce_dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):
            mode = "full" if self.activation_checkpointing else "none"
            object.__setattr__(self, "activation_checkpointing", ACPlan(mode))

    @property
    def ac(self) -> ACPlan:
        assert isinstance(self.activation_checkpointing, ACPlan)  # __post_init__ made it one
        return self.activation_checkpointing


@dataclass(kw_only=True)
class LoraSettings:
    """The LoRA knobs of the recipe (see ``config.PeftArgs``)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"
    # PEFT's target_parameters: parameter names (suffixes) or all-experts (every fused MoE expert weight).
    target_parameters: list[str] | None = None
    modules_to_save: list[str] | None = None
    use_rslora: bool = False
    use_dora: bool = False
    task_type: str = "CAUSAL_LM"  # SEQ_CLS: a reward model (PEFT trains its score head in full)


def parse_step_range(value: str | None, key: str) -> tuple[int, int] | None:
    """``"a-b"`` (or ``"a"``) -> ``(a, b)``; None or empty -> None.

    Raises:
        ValueError: not a range of steps ``1 <= a <= b``.
    """
    if value is None or not value.strip():
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", value)
    if not match:
        raise ValueError(f"{key}={value!r} is not a step range; write 'a-b' (e.g. '5-7') or one step 'a'")
    start = int(match.group(1))
    end = int(match.group(2)) if match.group(2) else start
    if not 1 <= start <= end:
        raise ValueError(f"{key}={value!r}: need 1 <= first step <= last step")
    return start, end


TRACKERS = ("tensorboard", "wandb", "trackio")
_TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def parse_report_to(report_to: str) -> tuple[str, ...]:
    """``none``, ``all`` or a comma list of tensorboard, wandb, trackio -> the names asked for.

    ``all`` stays ``("all",)``: which trackers it means depends on what is installed (see
    :func:`build_trackers`).

    Raises:
        ValueError: an unknown name, or none/all mixed with names.
    """
    names = tuple(dict.fromkeys(n.strip().lower() for n in report_to.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    if names == ("all",):
        return names
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or "none" in names or "all" in names:
        raise ValueError(
            f"report_to={report_to!r}: use none, all, or a comma list of {', '.join(TRACKERS)} "
            f"(unknown: {', '.join(unknown) or 'none/all mixed with names'})"
        )
    return names


def tracker_installed(name: str) -> bool:
    """Whether the package of tracker ``name`` is importable (checked without importing it)."""
    return importlib.util.find_spec(_TRACKER_PACKAGES[name]) is not None


def check_trackers_installed(names: tuple[str, ...]) -> None:
    """Refuse trackers that are not installed, naming the pip command; ``all`` needs at least one.

    Raises:
        ValueError: a missing package, or ``all`` with none installed.
    """
    if names == ("all",):
        if not any(tracker_installed(n) for n in TRACKERS):
            raise ValueError(
                "report_to=all but none of tensorboard, wandb, trackio is installed; "
                "pip install tensorboard (or wandb, trackio), or set report_to=none"
            )
        return
    missing = [n for n in names if not tracker_installed(n)]
    if missing:
        raise ValueError(
            f"report_to names {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(_TRACKER_PACKAGES[n] for n in missing)} (or drop it from report_to)"
        )


PACKED_ATTENTION_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
)


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size_or_none(size: str) -> int | None:
    """Bytes in a size string, or None when it is not a positive size."""
    value = _parse_size(size)
    return value if value > 0 else None


def _parse_size(size: str) -> int:
    text = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                return int(float(number) * _UNITS[unit])
            except (ValueError, OverflowError):
                return -1
    try:
        return int(text)
    except (ValueError, OverflowError):
        return -1


def parse_size(size: str) -> int:
    """Bytes in a size string such as ``"5GB"``, ``"500MB"`` or ``"2GiB"``.

    Raises:
        ConfigError: the string is not a positive size.
    """
    value = _parse_size(size)
    if value <= 0:
        raise ConfigError(f"max_shard_size={size!r} must be a positive size such as '5GB' or '500MB'")
    return value


def repo_id_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a valid hub repo id (``namespace/name``), or None when it is."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return f"hub_model_id={repo_id!r} is not a valid repo id: {err}"
    return None
