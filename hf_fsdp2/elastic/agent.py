"""What torch's elastic agent (torchrun, and ``accelerate launch``, which runs torchrun) tells a rank about its
launch, and what a run makes of it: how many restarts it has, which attempt this is, and where it resumes from.

The agent restarts the whole group of ranks when one fails, up to ``--max_restarts`` times, and gives each rank
``TORCHELASTIC_RESTART_COUNT`` (this attempt: 0, then 1, ...) and ``TORCHELASTIC_MAX_RESTARTS``. The launcher's flag
is the one that acts: a recipe's ``max_restarts`` reaches it through ``hf-fsdp2 train`` (:mod:`hf_fsdp2.launch`), and
a run whose recipe asks for other restarts than its launcher gives is refused at start-up, naming both. Not
collective: every rank reads the same environment.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hf_fsdp2.config import ConfigError

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
AUTO = "auto"


@dataclass(frozen=True)
class AgentLaunch:
    """This rank's launch: under torch's elastic agent or not, its attempt and its restarts."""

    under_agent: bool
    attempt: int = 0
    max_restarts: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentLaunch:
        env = os.environ if env is None else env
        if MAX_RESTARTS not in env:
            return cls(under_agent=False)
        return cls(
            under_agent=True, attempt=int(env.get(RESTART_COUNT, "0")), max_restarts=int(env[MAX_RESTARTS])
        )

    @property
    def restarts_left(self) -> int:
        return max(self.max_restarts - self.attempt, 0)

    def describe(self) -> str:
        """``attempt 2 of 4 (restart 1 of max_restarts 3)`` for the log."""
        if not self.under_agent:
            return "no elastic agent: nothing restarts this run"
        return (
            f"attempt {self.attempt + 1} of {self.max_restarts + 1} (max_restarts {self.max_restarts}"
            + (f", restart {self.attempt}" if self.attempt else "")
            + ")"
        )


def check_max_restarts(asked: int | None, launch: AgentLaunch) -> None:
    """Refuse a recipe's ``max_restarts`` that its launcher does not give (every rank alike, before any work).

    Raises:
        ConfigError: naming the recipe's value, the launcher's and the command that gives them.
    """
    if (
        asked is None
        or (asked == launch.max_restarts and launch.under_agent)
        or (asked == 0 and not launch.under_agent)
    ):
        return
    if not launch.under_agent:
        raise ConfigError(
            f"max_restarts={asked} but no elastic agent started this process (no {MAX_RESTARTS} in its "
            "environment): nothing would restart it. Launch it with hf-fsdp2 train (which passes max_restarts to "
            f"the launcher), or accelerate launch / torchrun --max_restarts {asked}"
        )
    raise ConfigError(
        f"max_restarts={asked} in the recipe, but the launcher restarts the run {launch.max_restarts} time(s) "
        f"({MAX_RESTARTS}={launch.max_restarts}): accelerate launch and torchrun read --max_restarts from their own "
        f"command line, not from the recipe. Add --max_restarts {asked} to the launcher's command line, launch with "
        "hf-fsdp2 train (which passes it), or remove the key"
    )


@dataclass(frozen=True)
class ResumeSetting:
    """Where an attempt resumes from and whether it clears the folder first, with the note that says why."""

    resume: str | None
    overwrite: bool
    note: str | None = None


def resume_setting(asked: str | None, *, overwrite: bool, launch: AgentLaunch) -> ResumeSetting:
    """``resume_from_checkpoint`` and ``overwrite_output_dir`` as this attempt applies them.

    A run with restarts resumes by itself: ``auto`` (its newest checkpoint when the folder holds one, a fresh start
    when it holds none) is the default, and a restarted attempt always continues the run from where it got (a
    checkpoint path given for the first attempt is behind it by then; its folder is never cleared again).
    """
    if launch.attempt > 0:
        dropped = [
            f"resume_from_checkpoint={asked}" if asked not in (None, AUTO) else "",
            "overwrite_output_dir=true" if overwrite else "",
        ]
        dropped = [d for d in dropped if d]
        note = (
            f"restarted ({launch.describe()}): resuming the run's newest checkpoint (resume_from_checkpoint=auto)"
            + (f"; {' and '.join(dropped)} applied to the first attempt only" if dropped else "")
        )
        return ResumeSetting(resume=AUTO, overwrite=False, note=note)
    if asked is None and launch.max_restarts > 0 and not overwrite:
        return ResumeSetting(
            resume=AUTO,
            overwrite=False,
            note=f"max_restarts={launch.max_restarts}: resume_from_checkpoint=auto (the run's newest checkpoint "
            "in output_dir when it holds one, else a fresh start)",
        )
    return ResumeSetting(resume=asked, overwrite=overwrite)


# A restarted attempt's process group rendezvous: the agent's store, under a name of this attempt's own.
ATTEMPT_SCHEME = "hf-fsdp2-attempt"
_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def attempt_init_method(launch: AgentLaunch) -> str | None:
    """The ``init_method`` of this attempt's default process group: None (``env://``, torch's own) except for a
    restarted attempt whose ranks share the agent's store (``TORCHELASTIC_USE_AGENT_STORE``): that store outlives
    the attempts, and the keys the previous attempt's ranks wrote there (their gloo addresses, NCCL's unique id) would
    be read as this attempt's before its ranks write their own (a restart then fails to connect, or connects to a dead
    rank's port: pytorch/pytorch#135712). Under ``hf-fsdp2-attempt://`` every key of the attempt's groups lives under
    ``/hf_fsdp2/attempt_<k>/``. Every rank of a node reads the same attempt from its agent; across nodes the agents
    count alike when every node's ranks fail together, as they do when one is lost (docs/restarts.md)."""
    if launch.attempt == 0 or os.environ.get(_USE_AGENT_STORE) != str(True):
        return None
    from torch.distributed.rendezvous import register_rendezvous_handler

    with contextlib.suppress(RuntimeError):  # registered by an earlier run in this process
        register_rendezvous_handler(ATTEMPT_SCHEME, _attempt_rendezvous)
    return f"{ATTEMPT_SCHEME}://"


def _attempt_rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """``env://``'s rendezvous (the agent's store at MASTER_ADDR:MASTER_PORT, as a client), under this attempt's
    prefix."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        False,
        timeout if isinstance(timeout, timedelta) else timedelta(minutes=30),
    )
    attempt = AgentLaunch.from_env().attempt
    yield dist.PrefixStore(f"/hf_fsdp2/attempt_{attempt}", store), rank, world
    raise RuntimeError("the hf-fsdp2-attempt:// rendezvous cannot run twice in one process")


class NodeLostError(RuntimeError):
    """A rank of the launch did not join a restarted attempt: its node did not come back."""


ARRIVAL_S = 300.0  # the longest a restarted attempt waits for every rank before its process group (at most ddp_timeout)


def check_arrival(launch: AgentLaunch, *, timeout_s: float, layout: list[dict[str, Any]]) -> Any:
    """A restarted attempt on several nodes: every rank says it is here through the launch's store and waits, at most
    ``timeout_s``, for all of them, before the process group, whose creation would wait ``ddp_timeout`` for a rank
    that never comes. torch's c10d agent restarts its ranks after a failure without meeting the other nodes again,
    so a node lost with the failure is counted in the restart; the ranks find it missing here. Returns what must
    stay alive until the process group exists (rank 0's store); None where there is nothing to check.

    Raises:
        NodeLostError: naming each rank that did not come, with its node and host in the last attempt (``layout``).
    """
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if launch.attempt == 0 or int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1 or world <= 1:
        return None
    from datetime import timedelta

    shared = os.environ.get(_USE_AGENT_STORE) == str(True)
    # The agent's store (shared: under this attempt's prefix), or the one rank 0 hosts for this attempt's process
    # group (created here, multi-tenant: the group's env:// rendezvous reuses it).
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not shared,
        timeout=timedelta(seconds=max(timeout_s, 1.0)),
        wait_for_workers=False,  # the wait is below, bounded, and names who is missing
        multi_tenant=True,
    )
    here = dist.PrefixStore(f"/hf_fsdp2/arrival/attempt_{launch.attempt}", store)
    here.set(f"rank_{rank}", os.environ.get("GROUP_RANK", "0"))
    deadline = time.monotonic() + timeout_s
    keys = [f"rank_{r}" for r in range(world)]
    while time.monotonic() < deadline:
        if here.check(keys):
            return store
        time.sleep(0.2)
    missing = [r for r in range(world) if not here.check([f"rank_{r}"])]
    if not missing:
        return store
    where = {int(p["rank"]): p for p in layout}
    named = ", ".join(
        f"rank {r}" + (f" (node {where[r]['node']}, {where[r]['host']})" if r in where else "")
        for r in missing
    )
    raise NodeLostError(
        f"{launch.describe()}: {named} did not join within {timeout_s:.0f} s: its node did not come back (lost, or "
        "its launcher stopped); the process group cannot form without it"
    )
