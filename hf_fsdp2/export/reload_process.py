"""The separate interpreter where verification reloads an export as a user would: plain transformers, no hf_fsdp2.

By default each reload starts its own interpreter (:func:`run_reload`), which pays the interpreter start and the
torch + transformers imports (~6-7 s of a CPU core) every time. Inside :func:`shared_reload_process` the reloads
share one interpreter (hf_fsdp2/export/reload_scripts/reload_server.py), started on the first and ended with the
block: a LoRA export verifies its adapter and then its merge in one; a process that verifies many folders (the tests)
pays once. Each request runs its script file again in a fresh namespace, so only imported modules carry over; the
interpreter never imports hf_fsdp2 (the scripts check it), and it holds no model between requests (each script's
objects are dropped and collected). A request that fails reports its traceback's last lines; a server that dies is
replaced by the next request's.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from hf_fsdp2.export.reload_scripts import SERVER

_shared: list[subprocess.Popen[str]] | None = None  # the interpreter of the block (none yet: empty)


# Signals that ask a process to stop (a launcher's or scheduler's SIGTERM reaches the rank's whole process group,
# the reload included; Ctrl-C; a closed terminal). SIGKILL is not one: it is also the OOM killer's, a finding.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ReloadInterrupted(RuntimeError):
    """A stop signal (:data:`STOP_SIGNALS`) ended the reload interpreter: no finding about the export either way."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"the reload process was killed by {self.signal_name}")


def _ended(status: int | None, reason: str = "") -> str:
    """The error of a reload interpreter that ended with ``status``; a stop signal's end raises instead."""
    if status is not None and -status in STOP_SIGNALS:
        raise ReloadInterrupted(-status)
    return f"the reload process ended (status {status}) {reason}".strip()


def _tail(text: str) -> str:
    return " | ".join(text.strip().splitlines()[-3:])


def run_reload(script: Path, request_file: Path, out_file: Path, env: dict[str, str]) -> str | None:
    """Run ``python script request_file out_file`` (``script``: a file, e.g. one of
    :mod:`hf_fsdp2.export.reload_scripts`) in a separate interpreter with ``env``: None if it succeeded, else the
    last lines of its error. Inside :func:`shared_reload_process` the interpreter is shared; else a new one.

    Raises:
        ReloadInterrupted: a signal ended the interpreter (its exit status is negative): no finding either way.
    """
    if _shared is None:
        proc = subprocess.run(
            [sys.executable, str(script), str(request_file), str(out_file)],
            capture_output=True,
            text=True,
            env=env,
        )
        if -proc.returncode in STOP_SIGNALS:  # a negative status: the signal that ended it
            raise ReloadInterrupted(-proc.returncode)
        return None if proc.returncode == 0 else _tail(proc.stderr or proc.stdout)
    if not _shared or _shared[0].poll() is not None:
        _shared[:] = [
            subprocess.Popen(
                [sys.executable, str(SERVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        ]
    server = _shared[0]
    assert server.stdin is not None and server.stdout is not None
    try:
        server.stdin.write(json.dumps([str(script), str(request_file), str(out_file), env]) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
    except OSError as err:
        line = ""
        reason = str(err)
    else:
        reason = ""
    if not line:  # it died (killed, out of memory): the next request starts a new one
        try:  # its own status (a signal's, or a crash's) before any kill of ours replaces it
            status: int | None = server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            status = None
        return _ended(status, reason)
    answer = json.loads(line)
    return None if answer["ok"] else str(answer["error"])


@contextlib.contextmanager
def shared_reload_process() -> Iterator[None]:
    """Reloads inside the block share one interpreter (whatever their script; each runs with its own environment,
    but what a module read from the environment when it was imported stays); it ends with the block.

    Nested blocks use the outer one's."""
    global _shared
    if _shared is not None:
        yield
        return
    _shared = []
    try:
        yield
    finally:
        servers, _shared = _shared, None
        for server in servers:
            with contextlib.suppress(OSError):
                if server.stdin is not None:
                    server.stdin.close()  # end of requests: the loop ends, the interpreter exits
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
