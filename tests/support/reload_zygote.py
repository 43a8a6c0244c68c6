"""A reload zygote for the launch server: the export verification of a served run reloads the export in a process
forked from here instead of a new interpreter.

Why: each launched run that exports verifies the export by reloading it with plain transformers in a separate
interpreter (hf_fsdp2/export/reload_process.py), which pays the interpreter start and the torch + transformers + peft
imports (~6 s of a CPU core) every time; the suite has dozens of such runs. The launch server forks this zygote after
it has imported torch, transformers, accelerate, peft and safetensors and before it imports hf_fsdp2 or a recipe, so a
reload forked from here is what the fresh interpreter was: plain transformers, no hf_fsdp2 module (the reload scripts
record that, and verification refuses a reload that had one). Each request gets its own child: the script (a file,
one of hf_fsdp2/export/reload_scripts/) runs as ``python script request out`` would (``__main__``, ``sys.argv``,
its folder first on ``sys.path``, the request's environment), its output goes to a file, and a failure answers with the last lines of its traceback, as :func:`hf_fsdp2.export.reload_process.run_reload`
reports a failed interpreter. A child that dies answers nothing: the client reports that the reload process ended.

The served ranks use it through :func:`install` (hf_fsdp2's ``reload_process.run_reload`` is replaced in the rank);
runs launched for real (``real_launcher=True``, ``HF_FSDP2_TEST_LAUNCH_SERVER=0``, ``accelerate launch``) keep the
product's own interpreter per reload.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import traceback
from functools import partial

# What the reload scripts import (hf_fsdp2/export/reload_scripts/), and transformers' lazy modules
# for the families the tests build. Nothing here imports hf_fsdp2.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "accelerate",
    "peft",
    "safetensors.torch",
    "torchao",  # transformers imports it in every from_pretrained when installed (~3 s); QLoRA reloads use it
)


def _tail(text: str) -> str:
    # The same summary hf_fsdp2/export/reload_process.py gives of a failed interpreter's stderr.
    return " | ".join(text.strip().splitlines()[-3:])


def _exit_status(run: object) -> int:
    """Run ``run()`` as ``python -c`` runs its code; the interpreter's exit status (a traceback printed on error)."""
    try:
        run()  # type: ignore[operator]
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException as err:  # the traceback python -c prints: from the script's frame on
        tb = err.__traceback__.tb_next if err.__traceback__ else None
        traceback.print_exception(type(err), err, tb.tb_next if tb else None)
        return 1
    return 0


def _run_code(conn: socket.socket, request: dict) -> None:
    """``python -c code args`` for a test (:func:`run_code`): its output to the request's files; answers its status."""
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-c", *request["args"]]
    sys.path[0] = ""  # python -c: the working folder first
    code = _exit_status(lambda: exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"}))
    sys.stdout.flush()
    sys.stderr.flush()
    conn.sendall((json.dumps({"rc": code}) + "\n").encode())


def _run_request(conn: socket.socket) -> None:
    """In the forked child: read one request, run its script as ``python script`` would, answer, never return."""
    code = 1
    try:
        with conn.makefile("r") as reader:
            request = json.loads(reader.readline())
        if isinstance(request, dict):
            _run_code(conn, request)
            code = 0
            return
        script, request_file, out_file, env = request
        with tempfile.TemporaryFile(mode="w+") as log:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [script, request_file, out_file]
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # python script: the script's folder first
            ok = True
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit_:
                ok = exit_.code in (None, 0)
                if not ok and not isinstance(exit_.code, int):
                    print(exit_.code, file=sys.stderr)
            except (
                BaseException
            ) as err:  # the traceback python prints (runpy's frames too: its last lines are the same)
                traceback.print_exception(type(err), err, err.__traceback__)
                ok = False
            sys.stdout.flush()
            sys.stderr.flush()
            log.seek(0)
            answer = {"ok": True} if ok else {"ok": False, "error": _tail(log.read())}
        conn.sendall((json.dumps(answer) + "\n").encode())
        code = 0
    finally:
        os._exit(code)


def serve(listener: socket.socket) -> None:
    """The zygote: fork a child per connection on ``listener``; it ends when the process that started it ends."""
    parent = os.getppid()
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the launch server's answers pipe: only the server may hold it, so that its end is seen
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.setblocking(True)
        if os.fork() == 0:
            listener.close()
            signal.signal(
                signal.SIGCHLD, signal.SIG_DFL
            )  # a script's own subprocesses are waited for as usual
            _run_request(conn)
        conn.close()


def settle() -> None:
    """Make what a forked process would redo once per process part of the fork: transformers' table of checkpoint
    conversions (built at a process's first ``from_pretrained``: thousands of regular expressions, ~1 s of a core), and
    the garbage collector's view of the imported modules, frozen (``gc.freeze``): a child's full collections then skip
    them instead of walking every object (and copying every page of the heap it shares with this process)."""
    import gc

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without the table
        pass
    else:
        get_checkpoint_conversion_mapping("llama")
    gc.collect()
    gc.freeze()


def start(path: str) -> int:
    """Import :data:`PRELOAD`, listen on the Unix socket ``path`` and fork the zygote from the calling process
    (which must not have imported hf_fsdp2); its pid. Connections made before it accepts wait in the backlog."""
    if any(name.startswith("hf_fsdp2") for name in sys.modules):
        raise RuntimeError("the reload zygote must fork from a process that has not imported hf_fsdp2")
    for module in PRELOAD:
        __import__(module)
    settle()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    pid = os.fork()
    if pid == 0:
        try:
            serve(listener)
        finally:
            os._exit(0)
    listener.close()
    return pid


def run_reload(
    path: str, script: object, request_file: object, out_file: object, env: dict[str, str]
) -> str | None:
    """:func:`hf_fsdp2.export.reload_process.run_reload` through the zygote at ``path``: None if the script
    succeeded, else the last lines of its error."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            conn.sendall(
                (json.dumps([str(script), str(request_file), str(out_file), dict(env)]) + "\n").encode()
            )
            with conn.makefile("r") as reader:
                line = reader.readline()
    except OSError as err:
        return f"the reload process ended ({err})"
    if not line:
        return "the reload process ended (it answered nothing)"
    answer = json.loads(line)
    return None if answer["ok"] else str(answer["error"])


def run_code(
    path: str,
    code: str,
    args: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdout: str,
    stderr: str,
    timeout: float,
) -> int:
    """``python -c code args`` forked from the zygote at ``path`` (an interpreter that has imported torch and
    transformers but never hf_fsdp2), its output appended to the files ``stdout`` and ``stderr``; its exit status."""
    request = {"code": code, "args": args, "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(path)
        conn.sendall((json.dumps(request) + "\n").encode())
        with conn.makefile("r") as reader:
            line = reader.readline()
    if not line:
        raise RuntimeError("the reload zygote's child ended without answering (killed?)")
    return int(json.loads(line)["rc"])


def install(path: str) -> None:
    """Route this process's export reloads (hf_fsdp2's ``reload_process.run_reload``) to the zygote at ``path``."""
    from hf_fsdp2.export import reload_process

    reload_process.run_reload = partial(run_reload, path)  # type: ignore[assignment]
