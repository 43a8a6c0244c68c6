"""A rank started by torch's elastic agent in a test: the faults this attempt of this rank is to suffer, then the
script as ``__main__``.

``python tests/support/elastic_rank.py SCRIPT ARGS...`` (or, from an agent that forks its workers, the same through
torchrun's ``--run-path``). The faults come from ``HF_FSDP2_TEST_FAULTS`` (a JSON list, read by this file alone:
the library holds no hook a user could trip), each ``{"attempt": a, "rank": r, "at": where, ...}`` applied to rank
``r`` of attempt ``a`` (``TORCHELASTIC_RESTART_COUNT``):

- ``{"at": "step", "step": s}``: the rank kills itself (SIGKILL) as step ``s`` starts;
- ``{"at": "save", "step": s}``: killed while checkpoint-``s`` is written (the shards on disk, not yet published:
  the library's own ``HF_FSDP2_FAULT=kill_during_save``);
- ``{"at": "export"}``: killed in the export, once its own weight files are written, before the export is verified
  and published;
- ``{"at": "error", "step": s}``: raises ``RuntimeError`` as step ``s`` starts (an error of its own);
- ``{"at": "hang", "step": s}``: stops answering as step ``s`` starts (sleeps), so the others wait for it in the
  step's first collective;
- ``{"at": "node", "step": s}``: kills its node as step ``s`` starts (the agent, its parent, then itself: one rank
  per node), a machine lost.

A worker forked by the agent (``--run-path``, start method fork) returns from the script instead of leaving with
``os._exit(0)`` (:func:`hf_fsdp2.run.finish.leave`): the agent's multiprocessing worker reports its end through a
return value, and leaves without interpreter finalization itself.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from typing import Any

FAULTS_ENV = "HF_FSDP2_TEST_FAULTS"
HANG_S = 3600.0


def _kill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _at_step(step: int, fault: dict[str, Any]) -> None:
    """What the fault does at the start of its step."""
    rank, now = os.environ.get("RANK"), time.time()
    print(f"test fault: {fault['at']} at step {step} (rank {rank}) at {now:.1f}", file=sys.stderr, flush=True)
    if fault["at"] == "step":
        _kill()
    if fault["at"] == "error":
        raise RuntimeError(f"injected failure at step {step}")
    if fault["at"] == "hang":
        time.sleep(HANG_S)
    if fault["at"] == "node":  # the whole node: its agent (this rank's parent), then this rank
        sys.stderr.flush()
        os.kill(os.getppid(), signal.SIGKILL)
        _kill()


def install(faults: list[dict[str, Any]]) -> None:
    """Apply this rank's faults of this attempt to the library's functions (in this process only)."""
    from hf_fsdp2.run import observer

    at_start = {int(f["step"]): f for f in faults if f["at"] in ("step", "error", "hang", "node")}
    if at_start:
        start = observer.Observer.start_step

        def start_step(self: Any, step: int) -> None:
            if step in at_start:
                _at_step(step, at_start[step])
            start(self, step)

        observer.Observer.start_step = start_step  # type: ignore[method-assign]
    for fault in faults:
        if fault["at"] == "save":
            os.environ["HF_FSDP2_FAULT"] = f"kill_during_save:{fault['step']}:{os.environ['RANK']}"
        if fault["at"] == "export":
            from hf_fsdp2.export import writer

            def write_weights(*args: Any, write: Any = writer._write_weights, **kwargs: Any) -> None:
                write(*args, **kwargs)
                print("test fault: export (killed after writing its weights)", file=sys.stderr, flush=True)
                _kill()

            writer._write_weights = write_weights  # type: ignore[assignment]


def _return_on_success() -> None:
    """A forked multiprocessing worker ends by returning (see the module's docstring); other statuses leave now."""
    from hf_fsdp2.run import finish

    leave = finish.leave

    def leave_or_return(status: int, *, destroy: bool = True) -> None:
        if status != 0:
            leave(status, destroy=destroy)
        import logging

        import torch

        if destroy and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()

    finish.leave = leave_or_return  # type: ignore[assignment]


def main() -> None:
    script, *args = sys.argv[1:]
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("RANK", "0"))
    faults = [
        f
        for f in json.loads(os.environ.get(FAULTS_ENV, "[]"))
        if f["attempt"] == attempt and f["rank"] == rank
    ]
    os.environ.pop("HF_FSDP2_FAULT", None)
    install(faults)
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        _return_on_success()
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
