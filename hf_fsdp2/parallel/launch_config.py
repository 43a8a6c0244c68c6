"""What the launcher was asked for, read back by every run and by ``hf-fsdp2 doctor``.

Most users arrive with an accelerate config written for FSDP1 (``fsdp_version: 1``, ``fsdp_backward_prefetch``,
``fsdp_sync_module_states``, ``fsdp_state_dict_type: FULL_STATE_DICT``, ...). This toolkit always shards with
FSDP2's ``fully_shard``, so each of those keys either has an FSDP2 meaning (mapped, and said so in one log block)
or would change what the user asked for (refused, with the recipe key that says it in FSDP2).

Where the settings come from: the ``accelerate launch`` command line that started this process (its
``--config_file``, ``--num_processes`` and ``--cpu``, read from ``/proc`` in the process's ancestors, parsed by
accelerate's own parser), else accelerate's default config file, else the ``FSDP_*`` variables accelerate sets.
A world smaller than the processes asked for (accelerate's launcher starts one process for an FSDP config under
``--cpu``) or than the GPUs visible on the node is a warning naming both numbers, an error under
``strict_launch: true``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEVELS = ("ok", "warning", "error")
_STRATEGIES = {
    "1": "FULL_SHARD",
    "2": "SHARD_GRAD_OP",
    "3": "NO_SHARD",
    "4": "HYBRID_SHARD",
    "5": "HYBRID_SHARD_ZERO2",
}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One line of a check: its level (ok / warning / error), what was checked, the value, what it means, the fix."""

    level: str
    check: str
    value: str
    message: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.level:<7} {self.check}: {self.value} -> {self.message}"
        return f"{text}; fix: {self.fix}" if self.fix else text

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """The launcher's settings: accelerate config keys (``fsdp_config`` flattened in), the processes asked for."""

    source: str
    settings: dict[str, Any] = field(default_factory=dict)
    num_processes: int | None = None
    num_machines: int = 1
    cpu_flag: bool = False


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    """An accelerate config file (YAML or JSON) as one flat dict (its ``fsdp_config`` keys beside the top level).

    Raises:
        ValueError: the file is missing or not a mapping, naming the path.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise ValueError(
            f"accelerate config {path}: cannot be read ({err}); give an accelerate config file"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(f"accelerate config {path}: not a mapping of keys; give an accelerate config file")
    flat = {k: v for k, v in data.items() if k != "fsdp_config"}
    flat.update(data.get("fsdp_config") or {})
    return flat


def _launch_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``launch`` of an ``accelerate launch`` command line, or None for another command."""
    for i, token in enumerate(argv):
        name = Path(token).name
        if token == "accelerate.commands.launch" or name == "accelerate-launch":
            return argv[i + 1 :]
        if name == "accelerate" and i + 1 < len(argv) and argv[i + 1] == "launch":
            return argv[i + 2 :]
    return None


def parse_launch_command(argv: list[str]) -> LaunchRequest | None:
    """The request of an ``accelerate launch`` command line (parsed by accelerate's own parser), or None."""
    args = _launch_args(argv)
    if args is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    parsed, _ = launch_command_parser().parse_known_args(args)
    config_file = parsed.config_file
    if config_file is None:
        from accelerate.commands.config.config_args import default_config_file

        config_file = default_config_file if Path(default_config_file).is_file() else None
    settings = read_accelerate_config(config_file) if config_file else {}
    asked = parsed.num_processes if parsed.num_processes is not None else settings.get("num_processes")
    machines = parsed.num_machines if parsed.num_machines is not None else settings.get("num_machines", 1)
    source = (
        f"accelerate launch --config_file {config_file}"
        if config_file
        else "accelerate launch (no config file)"
    )
    return LaunchRequest(
        source=source,
        settings=settings,
        num_processes=int(asked) if asked else None,
        num_machines=int(machines or 1),
        cpu_flag=bool(parsed.cpu),
    )


def _ancestors(proc: Path, start: int, depth: int = 4) -> list[int]:
    """``start`` and its parents, nearest first (Linux /proc; shorter where it cannot be read)."""
    found, pid = [], start
    for _ in range(depth):
        if pid <= 1:
            break
        found.append(pid)
        try:
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def request_from_environment(environ: dict[str, str] | os._Environ[str]) -> LaunchRequest | None:
    """The FSDP settings accelerate put in the environment (``FSDP_*``, ``ACCELERATE_MIXED_PRECISION``), or None."""
    if environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return None
    settings: dict[str, Any] = {"distributed_type": "FSDP"}
    for key, value in environ.items():
        if key.startswith("FSDP_"):
            settings["fsdp_" + key[5:].lower()] = value
    if environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        settings["fsdp_transformer_layer_cls_to_wrap"] = settings.pop("fsdp_transformer_cls_to_wrap")
    if environ.get("ACCELERATE_MIXED_PRECISION"):
        settings["mixed_precision"] = environ["ACCELERATE_MIXED_PRECISION"]
    return LaunchRequest(source="the variables accelerate launch set (FSDP_*)", settings=settings)


def find_launch_request(
    environ: dict[str, str] | os._Environ[str] | None = None, proc: Path = Path("/proc")
) -> LaunchRequest | None:
    """The launch that started this process: an ``accelerate launch`` among its ancestors' command lines, else the
    variables accelerate set; None for torchrun or a plain ``python`` run."""
    environ = os.environ if environ is None else environ
    for pid in _ancestors(proc, os.getppid()):
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        request = parse_launch_command([a for a in argv if a])
        if request is not None:
            return request
    return request_from_environment(environ)


def _truth(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in ("true", "1", "yes") else False if text in ("false", "0", "no") else None


def _strategy(settings: dict[str, Any]) -> str | None:
    """FSDP1's sharding strategy (``fsdp_sharding_strategy``, or the strategy name accelerate >= 1.6 writes as
    ``fsdp_reshard_after_forward`` for FSDP1), upper case; None where the config has none."""
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        value = settings.get(key)
        if value is None or _truth(value) is not None and str(value) not in _STRATEGIES:
            continue
        text = str(value).strip().upper()
        return _STRATEGIES.get(text, text)
    return None


def fsdp_findings(settings: dict[str, Any], cfg: Any) -> list[Finding]:
    """Each accelerate config key against the recipe ``cfg`` (a :class:`hf_fsdp2.config.Config`): its FSDP2 meaning
    (ok), a difference the recipe decides (warning: the recipe's value is used), or a meaning FSDP2 would change
    (error, with the recipe key that says it)."""
    f, t = cfg.fsdp, cfg.train
    out: list[Finding] = []

    def add(level: str, key: str, message: str, fix: str = "") -> None:
        out.append(
            Finding(level=level, check=key, value=str(settings.get(key, "")), message=message, fix=fix)
        )

    kind = str(settings.get("distributed_type", "FSDP")).upper()
    if kind != "FSDP":
        add(
            "error",
            "distributed_type",
            "not an FSDP launch: accelerate would not shard the model",
            "use accelerate_configs/fsdp2.yaml (GPU) or fsdp2_cpu.yaml (CPU): distributed_type: FSDP",
        )
    version = str(settings.get("fsdp_version", "1" if _strategy(settings) else "2"))
    if version == "1":
        out.append(
            Finding(
                level="warning",
                check="fsdp_version",
                value="1",
                message="read as FSDP2 (every run shards with fully_shard); each "
                "FSDP1 key below is mapped to its FSDP2 meaning or refused",
                fix="accelerate to-fsdp2 --config_file OLD.yaml --output_file NEW.yaml, or "
                "accelerate_configs/fsdp2.yaml",
            )
        )
    strategy = _strategy(settings)
    key = "fsdp_sharding_strategy" if "fsdp_sharding_strategy" in settings else "fsdp_reshard_after_forward"
    replicate = f.dp_replicate_size or 1
    if strategy == "FULL_SHARD":
        if f.fsdp_reshard_after_forward:
            add("ok", key, "FSDP2 fully_shard with reshard_after_forward: true (the recipe's default)")
        else:
            add("warning", key, "the recipe's fsdp_reshard_after_forward: false is used (ZeRO-2 style)")
    elif strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2") and f.fsdp_reshard_after_forward:
        add(
            "error",
            key,
            f"{strategy} keeps parameters gathered after forward; the recipe would reshard them",
            "set fsdp_reshard_after_forward: false in the recipe (FSDP2's spelling of it)",
        )
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") and replicate <= 1:
        add(
            "error",
            key,
            f"{strategy} shards within a node and replicates across nodes; the recipe shards over all",
            "set dp_replicate_size: <number of nodes> in the recipe (FSDP2's HSDP mesh)",
        )
    elif strategy == "NO_SHARD":
        add(
            "error",
            key,
            "NO_SHARD replicates every parameter (DDP); FSDP2 always shards",
            "remove it to shard (the point of FSDP), or set dp_replicate_size equal to the world size",
        )
    elif strategy is not None:
        add("ok", key, f"{strategy} = the recipe's fsdp_reshard_after_forward / dp_replicate_size, as set")
    reshard = settings.get("fsdp_reshard_after_forward")
    if strategy is None and reshard is not None and _truth(reshard) is not None:
        if _truth(reshard) == f.fsdp_reshard_after_forward:
            add("ok", "fsdp_reshard_after_forward", "= the recipe's fsdp_reshard_after_forward")
        else:
            add(
                "warning",
                "fsdp_reshard_after_forward",
                f"the recipe's fsdp_reshard_after_forward: {str(f.fsdp_reshard_after_forward).lower()} is used",
            )
    prefetch = str(settings.get("fsdp_backward_prefetch", "")).upper()
    if prefetch in ("BACKWARD_PRE", "BACKWARD_POST"):
        add(
            "ok",
            "fsdp_backward_prefetch",
            "FSDP2 prefetches the next unit's all-gather in backward by default",
        )
    elif prefetch == "NO_PREFETCH":
        add(
            "warning",
            "fsdp_backward_prefetch",
            "FSDP2 always prefetches one unit ahead in backward (its memory is in hf-fsdp2 plan)",
            "remove the key",
        )
    if "fsdp_forward_prefetch" in settings:
        add("ok", "fsdp_forward_prefetch", "FSDP2 issues the next unit's forward all-gather ahead by default")
    if _truth(settings.get("fsdp_sync_module_states")):
        loading = f.fsdp_cpu_ram_efficient_loading
        add(
            "ok",
            "fsdp_sync_module_states",
            "rank 0 loads, the others receive their shards by broadcast: "
            f"fsdp_cpu_ram_efficient_loading ({'auto: on with > 1 process per node' if loading is None else loading})",
        )
    efficient = _truth(settings.get("fsdp_cpu_ram_efficient_loading"))
    if (
        efficient is not None
        and f.fsdp_cpu_ram_efficient_loading is not None
        and efficient != bool(f.fsdp_cpu_ram_efficient_loading)
    ):
        add(
            "warning",
            "fsdp_cpu_ram_efficient_loading",
            "the recipe's fsdp_cpu_ram_efficient_loading: "
            f"{str(f.fsdp_cpu_ram_efficient_loading).lower()} is used",
        )
    elif efficient is not None:
        recipe = f.fsdp_cpu_ram_efficient_loading
        add(
            "ok",
            "fsdp_cpu_ram_efficient_loading",
            "the recipe's key of that name (rank-0 loading + broadcast): "
            + ("auto, on with > 1 process per node" if recipe is None else str(recipe).lower()),
        )
    if "fsdp_use_orig_params" in settings:
        add(
            "ok",
            "fsdp_use_orig_params",
            "not needed: FSDP2's parameters are the originals (DTensor shards), "
            "frozen and trainable ones mix freely (LoRA)",
        )
    state_dict = str(settings.get("fsdp_state_dict_type", "")).upper()
    if state_dict:
        add(
            "ok",
            "fsdp_state_dict_type",
            "the final model is the gather-free, verified safetensors export "
            "(export_dtype); checkpoints are sharded DCP, resumable at another world size",
        )
    wrap = str(settings.get("fsdp_auto_wrap_policy", "")).upper()
    if wrap == "TRANSFORMER_BASED_WRAP":
        add(
            "ok",
            "fsdp_auto_wrap_policy",
            "one FSDP2 unit per decoder layer (fsdp_layer_cls_to_wrap, default the "
            "model's _no_split_modules)",
        )
    elif wrap:
        add(
            "error",
            "fsdp_auto_wrap_policy",
            f"{wrap} is not how this toolkit shards: one unit per decoder layer",
            "remove it (or TRANSFORMER_BASED_WRAP); choose the classes with fsdp_layer_cls_to_wrap",
        )
    classes = settings.get("fsdp_transformer_layer_cls_to_wrap")
    if classes:
        named = [
            c.strip()
            for c in (classes if isinstance(classes, list) else str(classes).split(","))
            if c.strip()
        ]
        if not f.fsdp_layer_cls_to_wrap or list(f.fsdp_layer_cls_to_wrap) == named:
            add(
                "ok",
                "fsdp_transformer_layer_cls_to_wrap",
                "the recipe's fsdp_layer_cls_to_wrap decides (empty: the "
                "model's _no_split_modules, checked against these by hf-fsdp2 doctor)",
            )
        else:
            add(
                "warning",
                "fsdp_transformer_layer_cls_to_wrap",
                f"the recipe's fsdp_layer_cls_to_wrap {list(f.fsdp_layer_cls_to_wrap)} is used",
            )
    for name, recipe_value, recipe_key in (
        ("fsdp_offload_params", f.fsdp_cpu_offload, "fsdp_cpu_offload"),
        ("fsdp_activation_checkpointing", f.ac_mode() != "none", "activation_checkpointing"),
    ):
        value = _truth(settings.get(name)) if name in settings else None
        if value is not None and value != recipe_value:
            add("warning", name, f"the recipe's {recipe_key} is used ({str(recipe_value).lower()})")
        elif value is not None:
            add("ok", name, f"= the recipe's {recipe_key}")
    mixed = settings.get("mixed_precision")
    if mixed is not None and str(mixed) != t.mixed_precision:
        add("warning", "mixed_precision", f"the recipe's mixed_precision: {t.mixed_precision} is used")
    elif mixed is not None:
        add(
            "ok",
            "mixed_precision",
            "= the recipe's (FSDP2 MixedPrecisionPolicy: fp32 master weights, compute "
            "in this dtype, gradients reduced in fsdp_reduce_dtype)",
        )
    return out


def world_findings(
    request: LaunchRequest | None, *, world: int, local_world: int, devices: int, strict: bool
) -> list[Finding]:
    """The world this run got against the processes asked for and the accelerators visible on the node."""
    level = "error" if strict else "warning"
    strict_fix = "" if strict else " (strict_launch: true makes this an error)"
    out = []
    asked = request.num_processes if request is not None else None
    if asked is not None and world < asked:
        cause, fix = "", "look at the launcher's own output for why it started fewer"
        if request is not None and request.cpu_flag:
            cause = ": accelerate launch --cpu starts its single-process launcher for an FSDP config"
            fix = "drop --cpu (a config with use_cpu: true, as accelerate_configs/fsdp2_cpu.yaml, runs FSDP on CPU)"
        out.append(
            Finding(
                level=level,
                check="world size",
                value=f"{world} of {asked} asked",
                message=f"the launcher ({request.source if request else ''}) "
                f"was asked for {asked} processes and this run has {world}{cause}",
                fix=fix + strict_fix,
            )
        )
    elif asked is not None:
        out.append(
            Finding(
                level="ok",
                check="world size",
                value=f"{world} of {asked} asked",
                message="every process asked for runs",
            )
        )
    if devices > local_world:
        out.append(
            Finding(
                level=level,
                check="devices",
                value=f"{local_world} processes, {devices} GPUs visible",
                message=f"{devices - local_world} GPU(s) on this node are idle",
                fix="--num_processes <GPUs per node x nodes>, or CUDA_VISIBLE_DEVICES to the GPUs meant"
                + strict_fix,
            )
        )
    return out
