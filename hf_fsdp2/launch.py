"""`hf-fsdp2 train`: run a packaged recipe on every local device through `accelerate launch`.

The launch is accelerate's own (never a home-made process layer): ``accelerate launch --config_file <config>
--num_processes N [multi-node flags] -m hf_fsdp2.methods <recipe> --config recipe.yaml [--key value ...]`` (the
method found in :mod:`hf_fsdp2.methods`' registry, run by the library's loop on every rank). The
accelerate config is the packaged ``fsdp2.yaml`` with one process per visible GPU, or ``fsdp2_cpu.yaml`` (gloo,
2 processes) on a machine without one, unless ``--config_file`` / ``--num_processes`` say otherwise.

SIGTERM to ``hf-fsdp2 train`` (a scheduler's preemption) is passed to the training processes themselves, not to
the launcher: each saves a checkpoint at the next step boundary (or lets a running export finish) and exits 0, so
the launcher ends cleanly instead of raising its own ``SignalException`` over them.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from hf_fsdp2.methods import method_names

CPU_PROCESSES = 2  # gloo processes on a machine without a GPU (what the CPU configs are tuned for)
ACCELERATE_LAUNCH = "accelerate.commands.launch"
# Set for the ranks hf-fsdp2 train launches: their launcher reports a failure in one line (see launcher_main).
QUIET_LAUNCH_ENV = "HF_FSDP2_QUIET_LAUNCH"
# torch's switch that gives each rendezvous round (attempt) of a c10d launch its own TCP store.
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Who usually sends the signal that ended a rank, for the launcher's line.
_SIGNAL_CAUSES = {
    "SIGKILL": ": kill -9, or the out-of-memory killer (dmesg says 'Out of memory')",
    "SIGSEGV": ": a crash in native code",
    "SIGABRT": ": an abort in native code",
    "SIGBUS": ": a crash in native code, or a full /dev/shm",
}


def packaged_accelerate_config(name: str) -> Path:
    """The path of a packaged accelerate config (``fsdp2.yaml``, ``fsdp2_cpu.yaml``, ``fsdp2_multinode.yaml``)."""
    path = Path(str(importlib.resources.files("hf_fsdp2.accelerate_configs") / name))
    if not path.is_file():
        raise FileNotFoundError(f"the packaged accelerate config {name} is missing from {path.parent}")
    return path


def _no_gpu_driver() -> bool:
    """Linux without NVIDIA's driver library (libcuda) or AMD's GPU device (/dev/kfd, ROCm): torch could see no GPU.
    Known without importing torch, which costs the launching process ~2 s of CPU before its own launcher starts."""
    if sys.platform != "linux" or Path("/dev/kfd").exists():
        return False
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def gpu_count() -> int:
    if _no_gpu_driver():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch_command(
    recipe: str,
    recipe_args: Sequence[str],
    *,
    config_file: str | None = None,
    num_processes: int | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int | None = None,
    gpus: int | None = None,
    max_restarts: int | None = None,
) -> list[str]:
    """The ``accelerate launch`` command line that runs ``recipe`` with ``recipe_args``.

    Args:
        recipe: a method's name (:func:`hf_fsdp2.methods.method_names`).
        recipe_args: the recipe's own arguments (``--config x.yaml --learning_rate 1e-5 ...``).
        config_file: an accelerate config; default the packaged one for this machine.
        num_processes: processes over all machines; default one per local GPU (x machines), 2 on CPU.
        num_machines, machine_rank, main_process_ip, main_process_port: multi-node, passed through.
        gpus: local GPUs (detected when None).
        max_restarts: the recipe's ``max_restarts``: the launcher's ``--max_restarts`` (torch's elastic agent
            restarts the ranks that many times; :func:`recipe_max_restarts`). None: the launcher's default, 0.

    Raises:
        ValueError: an unknown recipe or bad multi-node flags, naming the value.
    """
    if recipe not in method_names():
        raise ValueError(f"unknown recipe {recipe!r}; one of {', '.join(method_names())}")
    if num_machines > 1 and not main_process_ip:
        raise ValueError(
            f"--num_machines {num_machines} needs --main_process_ip (the address of machine rank 0)"
        )
    local = gpu_count() if gpus is None else gpus
    if config_file is None:
        # Several nodes with restarts: torchrun's c10d rendezvous, which the nodes of each attempt meet through.
        multinode = "fsdp2_multinode_elastic.yaml" if max_restarts else "fsdp2_multinode.yaml"
        name = multinode if num_machines > 1 else ("fsdp2.yaml" if local else "fsdp2_cpu.yaml")
        config_file = str(packaged_accelerate_config(name))
    if num_processes is None:
        num_processes = (local or CPU_PROCESSES) * num_machines
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config_file,
        "--num_processes",
        str(num_processes),
        "--num_machines",
        str(num_machines),
    ]
    if num_machines > 1:
        cmd += ["--machine_rank", str(machine_rank), "--main_process_ip", str(main_process_ip)]
    if main_process_port is not None:
        cmd += ["--main_process_port", str(main_process_port)]
    if max_restarts:
        cmd += ["--max_restarts", str(max_restarts)]
    return [*cmd, "-m", "hf_fsdp2.methods", recipe, *recipe_args]


def recipe_value(recipe_args: Sequence[str], key: str) -> object:
    """The value a recipe's arguments give ``key`` (the command line's ``--key``, else the YAML's ``--config``
    file's), read before the launch; None when they give none."""
    args = list(recipe_args)
    value: object = None
    for i, arg in enumerate(args):
        if arg.startswith("--config=") or (arg == "--config" and i + 1 < len(args)):
            from hf_fsdp2.config import load_yaml

            value = load_yaml(arg.split("=", 1)[1] if "=" in arg else args[i + 1]).get(key, value)
    for i, arg in enumerate(args):
        if arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{key}" and i + 1 < len(args):
            value = args[i + 1]
    return value


def recipe_max_restarts(recipe_args: Sequence[str]) -> int | None:
    """The ``max_restarts`` a recipe's arguments ask for (:func:`recipe_value`), so that it reaches the launcher;
    None when they ask for none.

    Raises:
        ValueError: a value that is not a whole number, naming it.
    """
    value = recipe_value(recipe_args, "max_restarts")
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"max_restarts={value!r} must be a whole number of restarts") from None


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux /proc; empty where it cannot be read)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return []
    return sorted(set(found))


def run_train(recipe: str, recipe_args: Sequence[str], **launch: object) -> int:
    """Run the launch (stdout/stderr pass through); returns its exit status.

    SIGTERM is passed to the launcher's children (the training processes), or to the launcher when it has none.
    """
    cmd = launch_command(recipe, recipe_args, max_restarts=recipe_max_restarts(recipe_args), **launch)  # type: ignore[arg-type]
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise FileNotFoundError(f"no Python interpreter at {cmd[0]}")
    print("hf-fsdp2 train: " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ)
    if "--max_restarts" in cmd and launch.get("num_machines", 1) != 1:  # type: ignore[operator]
        # Each attempt's own store on several nodes: the agent's shared one would hand a restart the previous attempt's
        # keys, and its nodes need not count their restarts alike (docs/restarts.md).
        env.setdefault(SHARE_STORE_ENV, "1")
    if not env.get("HF_FSDP2_DEBUG") and cmd[1:3] == ["-m", ACCELERATE_LAUNCH]:
        # The same accelerate launch, run by launcher_main: a failed rank's error is not followed by the launcher's
        # traceback (the command line keeps "accelerate.commands.launch": the ranks read their launch from it).
        cmd, env[QUIET_LAUNCH_ENV] = [cmd[0], "-m", "hf_fsdp2.launch", *cmd[2:]], "1"
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        workers = child_pids(proc.pid)
        for pid in workers or [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        print(
            f"hf-fsdp2 train: SIGTERM passed to the {len(workers)} training process(es): they save a checkpoint "
            "at the next step boundary (or finish a running export) and stop",
            file=sys.stderr,
            flush=True,
        )

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _flag_value(argv: Sequence[str]) -> list[str]:
    """The value after a bare ``--max_restarts`` of the launcher's arguments (before the script), if any."""
    args = list(argv)
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--max_restarts"][:1]


def launcher_main(argv: Sequence[str]) -> int:
    """``accelerate launch`` run in this process (``python -m hf_fsdp2.launch accelerate.commands.launch ARGS``,
    what :func:`run_train` starts): accelerate's own launch of ``ARGS``, but a failed training process ends in one
    line with each rank's exit status instead of torch elastic's 20-30 line traceback and failure table; the rank
    has said its error itself. Returns the status of the rank that failed first (2 for a recipe's bad input).
    """
    import logging

    from accelerate.commands.launch import launch_command as accelerate_launch
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if list(argv[:1]) != [ACCELERATE_LAUNCH]:
        raise ValueError(
            f"usage: python -m hf_fsdp2.launch {ACCELERATE_LAUNCH} [accelerate launch arguments]"
        )
    # Its "failed (exitcode: 2) local_rank: 0 ..." and "Sending process ... closing signal" lines: the line below. With
    # restarts its "failed (exitcode: -9) local_rank: 1 (pid ...)" stays: the one place a restarted rank's signal shows.
    restarts = recipe_max_restarts([a for a in argv if a.startswith("--max_restarts")] + _flag_value(argv))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
        logging.ERROR if restarts else logging.CRITICAL
    )
    started = time.time()
    try:
        accelerate_launch(launch_command_parser().parse_args(list(argv[1:])))
    except RendezvousTimeoutError:
        # A restart's rendezvous waited for every node and one never came back: name it from the run's records.
        args = list(argv[1:])
        node = int(recipe_value(args, "machine_rank") or recipe_value(args, "node_rank") or 0)  # type: ignore[call-overload]
        output_dir = recipe_value(args, "output_dir")
        from hf_fsdp2.elastic.attempts import lost_nodes

        lost = lost_nodes(Path(str(output_dir)), node) if output_dir else "the recipe names no output_dir"
        print(
            f"hf-fsdp2 train: exit status 1: the restart's rendezvous timed out on node {node}: {lost}. Start it "
            "again (or replace it) and run the same command on every node: the run resumes from its newest "
            "checkpoint (resume_from_checkpoint: auto); --rdzv_conf join_timeout=<s> waits longer",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except ChildFailedError as err:
        # Which rank to name: one killed by a signal printed nothing and the others' errors follow from losing it, but
        # the agent stamps a killed rank when it notices, often after the rank that lost it wrote its error, so a
        # killed rank comes first; then a rank that exited with its own error; then one that exited on losing another
        # (its record in the run folder says so: the same status 1, often stamped first); last one ended by SIGTERM,
        # the agent's signal to the ranks still running once one failed (collateral). Ties: the earlier stamp.
        failures = err.failures
        output_dir = recipe_value(list(argv[1:]), "output_dir")
        from hf_fsdp2.elastic.attempts import lost_only

        # A second's margin: a file's time comes from the kernel's coarse clock, behind time.time() by a tick.
        lost_ranks = lost_only(Path(str(output_dir)), since=started - 1.0) if output_dir else set()

        def precedence(rank: int) -> tuple[int, float]:
            f = failures[rank]
            if f.exitcode < 0:
                return (3 if f.signal_name() == "SIGTERM" else 0), f.timestamp
            return (2 if rank in lost_ranks else 1), f.timestamp

        first = min(failures, key=precedence)
        failure = failures[first]
        statuses = ", ".join(
            f"rank {rank}: {f.exitcode if f.exitcode >= 0 else f.signal_name()}"
            for rank, f in sorted(err.failures.items())
        )
        status = failure.exitcode if failure.exitcode > 0 else 1
        attempts = (
            f" in the last of its {restarts + 1} attempts (max_restarts {restarts})" if restarts else ""
        )
        if failure.exitcode < 0:  # killed by a signal: it printed nothing, the others' errors follow from it
            print(
                f"hf-fsdp2 train: exit status {status}: rank {first} stopped (killed by signal {-failure.exitcode}, "
                f"{failure.signal_name()}{_SIGNAL_CAUSES.get(failure.signal_name(), '')}) without an error of its "
                f"own{attempts}; the errors above are the other ranks' losing it ({statuses})",
                file=sys.stderr,
                flush=True,
            )
            return status
        print(
            f"hf-fsdp2 train: exit status {status} (rank {first} failed first{attempts}; {statuses}); its error is above "
            "(HF_FSDP2_DEBUG=1 also shows the launcher's report)",
            file=sys.stderr,
            flush=True,
        )
        return status
    return 0


if __name__ == "__main__":
    sys.exit(launcher_main(sys.argv[1:]))
