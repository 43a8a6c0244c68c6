"""A launch server for the test session: one interpreter per pytest worker imports what the recipes import, once,
and forks the ranks of each launched run from there.

Why: a launched 2-rank run of a tiny model spends most of its time before its first step: torchrun's agent and two
ranks each import torch, transformers, accelerate, datasets and peft (~6 s of CPU each on this machine). Forked from
an interpreter that holds those modules, a rank starts at once; it then runs the script exactly as ``torchrun`` would
(``__main__``, ``sys.argv``, the working folder), with torchrun's environment for its rank (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, ...): torch.distributed initialises from that environment and rank 0 hosts the store,
as in any ``env://`` launch. The server itself never runs a tensor operation: it only imports, so each fork starts
clean (one OpenMP thread, no process group, no compiled code).

Protocol: one JSON request per line on stdin, ``{"script", "args", "nproc", "env", "stdout", "stderr", "cwd"}``
(``script`` a file, or ``-m`` with the module first in ``args``), or ``{"agents": [{"launcher", "argv", "stdout",
"stderr"}, ...], "env", "cwd", "pgids"}``: one real launcher per node (accelerate launch or torchrun, with
restarts) whose elastic agent forks each attempt's ranks from its own copy of this server (tests/support/launch.py:
``elastic``);
one JSON answer per line on stdout, ``{"rc", "codes"}``. Every rank appends to the same stdout and stderr files, as
torchrun's children share its streams. When a rank fails, the others get SIGTERM and, 30 s later, SIGKILL, as
torchrun's agent does. A served run's export verification reloads the export in a process forked from a zygote
that has imported torch and transformers but not hf_fsdp2 (tests/support/reload_zygote.py). A test whose subject is the launcher's own behaviour (its report of the ranks, signals sent
to it) runs the real torchrun (tests/support/launch.py).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

import reload_zygote

# What a recipe, a bench or a test worker imports (their top-level imports, and the modules transformers loads
# lazily for the families the tests build); anything else is imported by the rank, as before.
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "accelerate",
    "datasets",
    "peft",
    "safetensors.torch",
    "torchao",  # QLoRA's; transformers imports it in every from_pretrained when installed (~3 s)
    "hf_fsdp2.run.loop",
    "hf_fsdp2.methods.sft",
    "hf_fsdp2.methods.dpo",
    "hf_fsdp2.methods.cpt",
    "torch.distributed.run",  # the launchers of elastic runs (_run_agent)
)

_RELOAD_SOCKET = os.path.join(os.environ.get("HF_FSDP2_TEST_RELOAD_DIR") or tempfile.mkdtemp(), "reload.sock")
_GRACE_S = 30.0  # torchrun's agent: SIGTERM to the other ranks, SIGKILL 30 s later
_ANSWERS = None


def _rank_env(base: dict[str, str], rank: int, nproc: int) -> dict[str, str]:
    """torchrun's environment for ``rank`` of a one-node run of ``nproc`` ranks (the variables torch sets)."""
    env = dict(base)
    if nproc > 1 or "MASTER_PORT" in base:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_WORLD_SIZE="1",
            ROLE_WORLD_SIZE=str(nproc),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID="none",
            TORCHELASTIC_USE_AGENT_STORE="False",
            TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
        )
    return env


def _run_rank(request: dict, rank: int) -> None:
    """In the forked child: become the rank's process, run the script as ``__main__``, never return."""
    code = 1
    try:
        if _ANSWERS is not None:
            _ANSWERS.close()  # the answers pipe is the server's alone: the test sees it close when the server ends
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(_rank_env(request["env"], rank, request["nproc"]))
        os.chdir(request["cwd"])
        # Folders the request's PYTHONPATH adds to the server's: where Python puts PYTHONPATH, after the script's.
        added = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]
        sys.path[1:1] = added
        reload_zygote.install(
            _RELOAD_SOCKET
        )  # the export's reload forks from the zygote (tests/support/reload_zygote.py)
        if request["script"] == "-m":  # python -m module args: the module found from the working folder
            module, *args = request["args"]
            sys.argv = [module, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(request["script"])
            sys.argv = [script, *request["args"]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _launch(request: dict) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank)
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline: float | None = None
    while len(codes) < len(pids):
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for other in pids:
                        if pids[other] not in codes:
                            _signal(other, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        if pid not in pids:
            continue
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and deadline is None:
            for other, rank in pids.items():
                if rank not in codes:
                    _signal(other, signal.SIGTERM)
            deadline = time.monotonic() + _GRACE_S
    ordered = [codes[rank] for rank in range(len(pids))]
    failed = [code for code in ordered if code != 0]
    return {"rc": failed[0] if failed else 0, "codes": ordered}


def _run_agent(request: dict, agent: dict) -> None:
    """In the forked child: become a node's launcher (``accelerate launch`` or ``torchrun``, their own code, in a
    process group of its own), whose elastic agent forks each attempt's ranks from here (torchrun's ``--run-path``
    with the fork start method: the ranks start with the server's imports); never return."""
    code = 1
    try:
        os.setsid()  # the node: the agent and its ranks, one process group (a test may end it whole)
        if _ANSWERS is not None:
            _ANSWERS.close()
        for fd, path in ((1, agent["stdout"]), (2, agent["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"], PET_RUN_PATH="1", PET_START_METHOD="fork")
        os.chdir(request["cwd"])
        added = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]
        sys.path[1:1] = added
        reload_zygote.install(_RELOAD_SOCKET)  # the ranks' export reloads, as a served rank's
        if agent["launcher"] == "hf_fsdp2":  # hf-fsdp2 train's launcher: accelerate launch in this process
            from hf_fsdp2.launch import ACCELERATE_LAUNCH, QUIET_LAUNCH_ENV, launcher_main

            os.environ[QUIET_LAUNCH_ENV] = "1"
            sys.exit(launcher_main([ACCELERATE_LAUNCH, *agent["argv"]]))
        elif agent["launcher"] == "accelerate":
            from accelerate.commands.launch import launch_command, launch_command_parser

            launch_command(launch_command_parser().parse_args(agent["argv"]))
        else:
            import torch.distributed.run

            torch.distributed.run.main(agent["argv"])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _launch_agents(request: dict) -> dict:
    """One launcher per node (``request["agents"]``), each forked from here; their exit statuses, in order. Each
    node's group id is written to ``request["pgids"]`` (one per line) once all are started."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for agent in request["agents"]:
        pid = os.fork()
        if pid == 0:
            _run_agent(request, agent)
        pids.append(pid)
    if request.get("pgids"):
        with open(request["pgids"], "w") as f:
            f.write("".join(f"{pid}\n" for pid in pids))
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    failed = [code for code in codes if code != 0]
    return {"rc": failed[0] if failed else 0, "codes": codes}


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def main() -> None:
    reload_zygote.start(
        _RELOAD_SOCKET
    )  # before hf_fsdp2 is imported: its forks are plain-transformers processes
    for module in PRELOAD:
        importlib.import_module(module)
    reload_zygote.settle()
    global _ANSWERS
    answers = _ANSWERS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing but answers on the pipe the test reads
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        answer = _launch_agents(request) if "agents" in request else _launch(request)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
