"""Launching multi-process runs (torchrun, accelerate launch) from tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "recipes" / "sft.py"


# Parallel pytest workers (xdist) each take ports from their own block below the kernel's ephemeral range
# (32768 and up on Linux), so two workers' launches never pick the same rendezvous port, and no port the
# kernel hands out for gloo's own connections.
_PORT_BLOCK = 1500
_PORT_BASE = 20000


def _port_candidates() -> list[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    start = _PORT_BASE + (index % 8) * _PORT_BLOCK
    ports = list(range(start, start + _PORT_BLOCK))
    random.shuffle(ports)
    return ports


def free_port() -> int:
    """A port no process listens on now, from this pytest worker's own block."""
    for port in _port_candidates():
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {_PORT_BLOCK} from {_PORT_BASE}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _log(fields: dict) -> None:
    """With HF_FSDP2_TEST_LAUNCH_LOG=file, one JSON line (``fields`` and the test's name) per event: profiling."""
    log = os.environ.get("HF_FSDP2_TEST_LAUNCH_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, **fields}) + "\n")


def _log_launch(cmd: list[str], seconds: float, returncode: int, server: bool = False) -> None:
    """A launch: which test, what, how long, its status, and whether the launch server ran it."""
    script = next((Path(c).name for c in cmd[1:] if c.endswith(".py")), " ".join(cmd[1:3]))
    _log({"script": script, "s": round(seconds, 1), "rc": returncode, "server": server})


def _run(cmd: list[str], timeout: int, check: bool) -> subprocess.CompletedProcess[str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    _log_launch(cmd, time.perf_counter() - start, proc.returncode)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def torchrun(
    script: Path | str,
    args: list[str],
    *,
    nproc: int = 2,
    timeout: int = 600,
    check: bool = True,
    real_launcher: bool = False,
):
    """``torchrun --nproc_per_node N script args`` on a free port.

    The ranks are forked from this worker's launch server with torchrun's environment (tests/support/launch_server.py:
    the same script and torch.distributed, without ~6 s of imports per rank; status 1 when a rank fails, as torchrun's).
    ``real_launcher=True`` runs torchrun itself: for a test that reads torchrun's own report of its ranks."""
    if _server_enabled() and not real_launcher:
        return _served(script, args, nproc=nproc, timeout=timeout, master_port=free_port(), check=check)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return _run(cmd, timeout, check)


def accelerate_launch(
    config_file: str,
    script: Path | str,
    args: list[str],
    *,
    timeout: int = 600,
    check: bool = True,
    launcher_args: list[str] | None = None,
    served: bool = False,
):
    """``accelerate launch --config_file F [launcher_args] script args`` on a free port.

    ``served=True``: accelerate's own launcher code reads the config file and the launcher arguments and makes the
    environment it hands torchrun (``prepare_multi_gpu_env``, its FSDP path), and the ranks are forked from this
    worker's launch server with it, as :func:`torchrun` forks them: for a test whose subject is the run rather than the
    launcher's processes (tests/recipes/test_launch_mapping.py, test_launch_errors.py and test_sft_recipe.py run the
    real ``accelerate launch``). Without the launch server (HF_FSDP2_TEST_LAUNCH_SERVER=0) it is the real one."""
    port = free_port()
    launcher = [
        "--config_file",
        str(REPO / config_file),
        *(launcher_args or []),
        "--main_process_port",
        str(port),
    ]
    if served and _server_enabled():
        return _served_accelerate(launcher, script, args, port=port, timeout=timeout, check=check)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, str(script), *args]
    return _run(cmd, timeout, check)


def _served_accelerate(
    launcher: list[str], script: Path | str, args: list[str], *, port: int, timeout: int, check: bool
) -> subprocess.CompletedProcess[str]:
    """``accelerate launch`` of an FSDP config with the ranks forked from the launch server (see accelerate_launch)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parsed = launch_command_parser().parse_args([*launcher, str(script), *[str(a) for a in args]])
    parsed, _, _ = _validate_launch_command(parsed)
    if not parsed.use_fsdp or parsed.cpu:
        raise ValueError(
            f"accelerate_launch(served=True) serves the FSDP launch path (torchrun's); {launcher} takes another: "
            "launch it with served=False"
        )
    # The variables accelerate adds for the ranks (ACCELERATE_*, FSDP_*): read when the Accelerator is built, so the
    # running server serves them.
    env = prepare_multi_gpu_env(parsed)
    added = {
        k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_")) and os.environ.get(k) != v
    }
    return _served(
        script,
        args,
        nproc=int(parsed.num_processes),
        timeout=timeout,
        master_port=port,
        check=check,
        extra_env=added,
    )


ELASTIC_RANK = REPO / "tests" / "support" / "elastic_rank.py"


def elastic(
    script: Path | str,
    args: list[str],
    *,
    launcher_args: list[str],
    launcher: str = "accelerate",
    faults: list[dict] | None = None,
    nodes: list[list[str]] | None = None,
    timeout: int = 600,
    check: bool = True,
    pgids: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """A real launcher with torch's elastic agent (``accelerate launch``, ``torchrun`` or hf-fsdp2 train's
    ``hf_fsdp2`` (accelerate launch in its process) and their ``--max_restarts``,
    restarts and rendezvous: their own code) running ``script args`` on every rank, with ``faults`` for its attempts
    (tests/support/elastic_rank.py). Forked from this worker's launch server, the agent forks each attempt's ranks
    (torchrun's ``--run-path``, fork start method), which start with the server's imports instead of ~6 s each.
    ``nodes``: one launcher per node, each with its own launcher arguments after ``launcher_args`` (multi-node on
    loopback); ``pgids``: a file the server writes each node's process group id to. The result's ``stderr`` is every
    node's, in order; ``rank_codes`` each launcher's status. Without the launch server the launchers are fresh
    processes."""
    env = _env()
    env["HF_FSDP2_TEST_FAULTS"] = json.dumps(faults or [])
    module = {"accelerate": "accelerate.commands.launch", "torchrun": "torch.distributed.run"}.get(
        launcher, "hf_fsdp2.launch accelerate.commands.launch"
    )
    if launcher == "hf_fsdp2":
        env["HF_FSDP2_QUIET_LAUNCH"] = "1"  # as hf-fsdp2 train runs it
    run_args = [str(ELASTIC_RANK), str(Path(script).resolve()), *[str(a) for a in args]]
    argvs = [[*launcher_args, *node, *run_args] for node in (nodes or [[]])]
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        outs = [(Path(folder) / f"stdout{i}", Path(folder) / f"stderr{i}") for i in range(len(argvs))]
        start = time.perf_counter()
        if _server_enabled():
            request = {
                "agents": [
                    {"launcher": launcher, "argv": argv, "stdout": str(o), "stderr": str(e)}
                    for argv, (o, e) in zip(argvs, outs, strict=True)
                ],
                "env": env,
                "cwd": str(REPO),
                "pgids": str(pgids) if pgids else None,
            }
            answer = _server(env).launch(request, timeout)
            codes = list(answer["codes"])
        else:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", *module.split(), *argv],
                    cwd=REPO,
                    env=env,
                    stdout=open(o, "w"),  # noqa: SIM115
                    stderr=open(e, "w"),  # noqa: SIM115
                    start_new_session=True,
                )
                for argv, (o, e) in zip(argvs, outs, strict=True)
            ]
            if pgids:
                pgids.write_text("".join(f"{p.pid}\n" for p in procs))
            codes = [p.wait(timeout=timeout) for p in procs]
        cmd = [sys.executable, "-m", module, *argvs[0]]
        returncode = next((c for c in codes if c != 0), 0)
        _log_launch(cmd, time.perf_counter() - start, returncode, server=_server_enabled())
        stdout = "".join(o.read_text() for o, _ in outs if o.exists())
        stderr = "".join(e.read_text() for _, e in outs if e.exists())
    if check and returncode != 0:
        raise AssertionError(
            f"elastic run failed (launcher statuses {codes}): {' '.join(cmd)}\n--- stdout ---\n{stdout[-6000:]}"
            f"\n--- stderr ---\n{stderr[-8000:]}"
        )
    done = subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
    done.rank_codes = codes  # type: ignore[attr-defined]
    return done


def python(script: Path | str, args: list[str], *, timeout: int = 600, check: bool = True):
    """A plain ``python script args`` in a fresh process, forked from the launch server. ``-c`` code (``args[0]``;
    those reload an export with plain transformers) is forked from the server's reload zygote: an interpreter that
    has imported torch and transformers but never hf_fsdp2, as a new ``python -c`` is."""
    if _server_enabled() and script == "-c":
        return _zygote_code(args[0], args[1:], timeout=timeout, check=check)
    if _server_enabled():
        return _served(script, args, nproc=1, timeout=timeout, master_port=None, check=check)
    return _run([sys.executable, str(script), *args], timeout, check)


# The launch server (one per pytest worker, started at its first launch)
# ----------------------------------------------------------------------

# Variables a launched run reads when it runs, not when it imports: a change in them needs no new server.
_READ_AT_RUN_TIME = (
    "HF_FSDP2_FAULT",
    "HF_FSDP2_TEST_FAULTS",
    # Read by a launcher and its ranks as they run (hf-fsdp2 train's, torch's rendezvous): an elastic run's own.
    "HF_FSDP2_QUIET_LAUNCH",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "PYTEST_CURRENT_TEST",
    "PYTEST_XDIST_WORKER",
    "HF_FSDP2_TEST_LAUNCH_LOG",
    # Left in the worker's environment by in-process tests (a one-process group's variables, set as torchrun would;
    # inductor's note to its compile workers); nothing imports them, and each rank gets its own RANK... anyway.
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    # Set for good by scikit-learn's import (lm-eval's, bitsandbytes'...) in the worker; read by an OpenMP runtime as
    # it loads, and the server loads none that reads it (torch's is libgomp): a rank that loads one reads it then.
    "KMP_DUPLICATE_LIB_OK",
)


def _path_entries(env: dict[str, str]) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


_BASE_PYTHONPATH = os.environ.get("PYTHONPATH", "")  # this pytest process's, before any test sets its own


def _server_env(env: dict[str, str]) -> dict[str, str]:
    """A new server's environment: the run's, with PYTHONPATH as every run has it (tests/ and this process's own),
    so that the folders one test adds for its runs do not make the next test's runs start another server."""
    return dict(env, PYTHONPATH=str(REPO / "tests") + os.pathsep + _BASE_PYTHONPATH)


def _server_enabled() -> bool:
    """HF_FSDP2_TEST_LAUNCH_SERVER=0 runs every launch as a fresh torchrun / python, as a user does."""
    return os.environ.get("HF_FSDP2_TEST_LAUNCH_SERVER", "1") != "0"


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.folder = tempfile.mkdtemp(prefix="launch-server-")  # the reload zygote's socket
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "support" / "launch_server.py")],
            cwd=REPO,
            env={
                **env,
                "PYTHONPATH": str(REPO) + os.pathsep + env["PYTHONPATH"],
                "HF_FSDP2_TEST_RELOAD_DIR": self.folder,
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ready = self._answer(timeout=300)
        if not ready.get("ready"):
            raise RuntimeError(f"the launch server did not start: {ready}")

    def _answer(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.stop()
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"the launch server ended (status {self.proc.wait()})")
        return json.loads(line)

    def launch(self, request: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)  # the server, its reload zygote and any process they forked
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def changed(self, env: dict[str, str]) -> set[str]:
        """The variables that differ from the server's own, other than those read at run time. PYTHONPATH may
        add folders (a test's reward-function module): a served rank puts them on its ``sys.path`` as Python
        would at start-up; one that drops a folder of the server's needs a new server."""
        keys = (set(self.env) | set(env)) - set(_READ_AT_RUN_TIME) - {"PYTHONPATH"}
        changed = {k for k in keys if self.env.get(k) != env.get(k)}
        if not set(_path_entries(self.env)) <= set(_path_entries(env)):
            changed.add("PYTHONPATH")
        return changed

    def fits(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and not self.changed(env)


_SERVER: _Server | None = None


def _server(env: dict[str, str]) -> _Server:
    """This worker's launch server for runs with ``env``: the running one, or a new one if it cannot serve them."""
    global _SERVER
    if _SERVER is None or not _SERVER.fits(env):
        changed = sorted(_SERVER.changed(env)) if _SERVER is not None else []
        if _SERVER is not None:
            _SERVER.stop()
        start = time.perf_counter()
        _SERVER = _Server(_server_env(env))
        _log(
            {"server_start": round(time.perf_counter() - start, 1), "changed": changed}
        )  # why it (re)started
    return _SERVER


def _zygote_code(
    code: str, args: list[str], *, timeout: int, check: bool
) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` forked from the launch server's reload zygote (tests/support/reload_zygote.py)."""
    from support.reload_zygote import run_code

    env = _env()
    server = _server(env)
    cmd = [sys.executable, "-c", code, *args]
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        start = time.perf_counter()
        returncode = run_code(
            str(Path(server.folder) / "reload.sock"),
            code,
            [str(a) for a in args],
            env=env,
            cwd=str(REPO),
            stdout=str(out),
            stderr=str(err),
            timeout=timeout,
        )
        _log_launch(cmd, time.perf_counter() - start, returncode, server=True)
        return _completed(
            cmd, returncode, out, err, check, f"python -c failed ({returncode}): {code[:200]}..."
        )


def _served(
    script: Path | str,
    args: list[str],
    *,
    nproc: int,
    timeout: int,
    master_port: int | None,
    check: bool,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` on ``nproc`` ranks forked from this worker's launch server; a CompletedProcess whose status
    is torchrun's for a distributed run (1 when a rank failed) and the process's own for a plain one."""
    global _SERVER
    env = _env()
    server = _server(env)
    run_env = dict(env)
    run_env.update(extra_env or {})  # the ranks' own: the server that imported for env serves them
    if master_port is not None:
        run_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), str(script), *args]
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        request = {
            "script": str(script),
            "args": [str(a) for a in args],
            "nproc": nproc,
            "env": run_env,
            "stdout": str(out),
            "stderr": str(err),
            "cwd": str(REPO),
        }
        start = time.perf_counter()
        try:
            answer = server.launch(request, timeout)
        except (subprocess.TimeoutExpired, RuntimeError):
            _SERVER = None
            raise
        returncode = int(answer["rc"] != 0) if master_port is not None else answer["rc"]
        _log_launch(cmd, time.perf_counter() - start, returncode, server=True)
        failure = f"run failed (rank exit codes {answer['codes']}): {' '.join(cmd)}"
        done = _completed(cmd, returncode, out, err, check, failure)
    done.rank_codes = answer["codes"]  # type: ignore[attr-defined]  # each rank's exit status, rank order
    return done


def _completed(
    cmd: list[str], returncode: int, out: Path, err: Path, check: bool, failure: str
) -> subprocess.CompletedProcess[str]:
    """A served process's result from its output files; with ``check``, a non-zero status raises ``failure`` and
    the ends of both outputs."""
    stdout = out.read_text() if out.exists() else ""
    stderr = err.read_text() if err.exists() else ""
    if check and returncode != 0:
        raise AssertionError(f"{failure}\n--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
