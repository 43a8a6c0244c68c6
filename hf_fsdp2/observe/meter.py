"""The per-step meter: tokens (without padding), FLOPs, time, data wait and memory of every rank, gathered
at logged steps in one collective."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

import torch

from hf_fsdp2 import collectives
from hf_fsdp2.observe.flops import FlopsModel, tokens_and_flops

GIB = 2**30


def host_rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes."""
    import psutil  # a dependency of accelerate

    current = int(psutil.Process().memory_info().rss)
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    peak *= 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    return current, max(current, peak)


def device_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) CUDA memory since the last reset; (0, 0) off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))


# Layout of the vector every rank contributes at a logged step (the one collective of logging).
_LOSS, _TOKENS, _FLOPS, _WAIT, _STEP_TIME, _ALLOC, _RESERVED, _RSS, _PEAK_RSS = range(9)
_FIELDS = 9


class StepMeter:
    """Counts tokens, FLOPs and time of the optimizer steps between two logged steps.

    Per step it only adds numbers on the host; at a logged step :meth:`collect` gathers one small
    vector from every rank (one collective) and returns the record's throughput, MFU, memory and
    timing fields. Time spent between steps (eval, checkpoints, logging) is not step time.
    """

    def __init__(
        self,
        *,
        flops: FlopsModel,
        world_size: int,
        device: torch.device,
        total_steps: int,
        peak_flops: float | None,
        pad_token_id: int | None,
    ) -> None:
        """Args:
        flops: FLOPs model of the trained model.
        world_size: ranks training together.
        device: this rank's device (its memory is reported; CUDA is synchronised at logged steps).
        total_steps: last step of the run (for the ETA).
        peak_flops: peak FLOP/s of one device, or None (no MFU).
        pad_token_id: pad id, to recognise padding in packed rows.
        """
        self.flops, self.world_size, self.device = flops, world_size, device
        self.total_steps, self.peak_flops, self.pad_token_id = total_steps, peak_flops, pad_token_id
        self._interval = [0.0] * _FIELDS  # local sums since the last logged step
        self._interval_steps = 0
        self._interval_targets = 0
        self._step_start = time.perf_counter()
        self._steps_timed = 0
        self._time_after_first = 0.0
        self.totals: dict[str, float] = {
            "steps": 0,
            "tokens": 0,
            "target_tokens": 0,
            "flops": 0.0,
            "step_time_s": 0.0,
            "data_wait_s": 0.0,
            "peak_memory_gib": 0.0,
        }

    def wrap(self, batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """``batches``, timing how long each ``next`` waits for data (the data-wait time)."""
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._interval[_WAIT] += time.perf_counter() - start
            yield batch

    def start_step(self) -> None:
        """Mark the start of an optimizer step."""
        self._step_start = time.perf_counter()

    def count(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Add the non-pad tokens and FLOPs of this rank's micro-batches of the step (host tensors)."""
        for batch in micro_batches:
            tokens, flops = tokens_and_flops(batch, self.flops, self.pad_token_id)
            self._interval[_TOKENS] += tokens
            self._interval[_FLOPS] += flops

    def end_step(self, target_tokens: int, *, sync: bool) -> float:
        """Mark the end of an optimizer step.

        Args:
            target_tokens: the step's global target tokens (already summed over ranks).
            sync: wait for the device first (at logged steps, so queued GPU work is in the time).

        Returns:
            The step's wall time in seconds.
        """
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._step_start
        self._interval[_STEP_TIME] += elapsed
        self._interval_steps += 1
        self._interval_targets += target_tokens
        self._steps_timed += 1
        if self._steps_timed > 1:  # the first step holds compile and warm-up: not in the ETA
            self._time_after_first += elapsed
        return elapsed

    def eta_seconds(self, step: int) -> float:
        """Seconds left for the steps after ``step`` at the mean step time so far."""
        timed = self._steps_timed - 1
        mean = (
            self._time_after_first / timed
            if timed > 0
            else self._interval[_STEP_TIME] / max(self._interval_steps, 1)
        )
        return max(self.total_steps - step, 0) * mean

    def collect(self, step: int, loss_sum: torch.Tensor) -> dict[str, float]:
        """Gather the interval's numbers from every rank (one all_gather; every rank calls it).

        Args:
            step: the logged step.
            loss_sum: this rank's summed CE over its target tokens of the step.

        Returns:
            ``loss_sum`` (global), ``tokens``, ``tokens_per_s`` (+ ``_per_device``), ``target_tokens_per_s``
            (+ ``_per_device``), ``tflops_per_device``, ``mfu`` (with a known peak), ``step_time_s`` and
            ``data_wait_s`` (means per step, slowest rank), memory in GiB (max over ranks), ``eta_s``.
        """
        local = list(self._interval)
        local[_LOSS] = float(loss_sum.detach().float().item())
        local[_ALLOC], local[_RESERVED] = device_memory_bytes(self.device)
        local[_RSS], local[_PEAK_RSS] = host_rss_bytes()
        table = collectives.gather_rows(local, self.device)  # [world, fields]
        sums, maxes = table.sum(dim=0).tolist(), table.max(dim=0).values.tolist()
        # The ranks of a tensor-parallel group hold the same batch: each counted its loss, tokens and FLOPs. Those of a
        # context-parallel group too, but each computes (and sums the loss of) its part of every row only: each
        # counted the whole batch's tokens and FLOPs, the group's parts add up to its loss.
        for i in (_LOSS, _TOKENS, _FLOPS):
            sums[i] /= collectives.tp_size() * (1 if i == _LOSS else collectives.cp_size())
        steps = max(self._interval_steps, 1)
        seconds = max(maxes[_STEP_TIME], 1e-9)
        tokens, flops = int(sums[_TOKENS]), sums[_FLOPS]
        record: dict[str, float] = {
            "loss_sum": sums[_LOSS],
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_device": tokens / seconds / self.world_size,
            "target_tokens_per_s": self._interval_targets / seconds,
            "target_tokens_per_s_per_device": self._interval_targets / seconds / self.world_size,
            "tflops_per_device": flops / seconds / self.world_size / 1e12,
        }
        if self.peak_flops:
            record["mfu"] = flops / seconds / self.world_size / self.peak_flops
        record["step_time_s"] = seconds / steps
        record["data_wait_s"] = maxes[_WAIT] / steps
        if self.device.type == "cuda":
            record["mem_allocated_gib"] = maxes[_ALLOC] / GIB
            record["mem_reserved_gib"] = maxes[_RESERVED] / GIB
            torch.cuda.reset_peak_memory_stats(self.device)
        record["host_rss_gib"] = maxes[_RSS] / GIB
        record["host_peak_rss_gib"] = maxes[_PEAK_RSS] / GIB
        record["eta_s"] = self.eta_seconds(step)
        t = self.totals
        t["steps"] += self._interval_steps
        t["tokens"] += tokens
        t["target_tokens"] += self._interval_targets
        t["flops"] += flops
        t["step_time_s"] += seconds
        t["data_wait_s"] += maxes[_WAIT]
        peak = maxes[_ALLOC] if self.device.type == "cuda" else maxes[_PEAK_RSS]
        t["peak_memory_gib"] = max(t["peak_memory_gib"], peak / GIB)
        self._interval = [0.0] * _FIELDS
        self._interval_steps = self._interval_targets = 0
        return record

    def mean_throughput(self, exclude_seconds: float = 0.0) -> dict[str, float | None]:
        """Run-level means of the logged intervals: tokens/s (global, per device), TFLOP/s per device, MFU.

        Args:
            exclude_seconds: time inside the steps that is not training (torch.compile compiling), taken off
                the step time the rates divide by; ignored when it is not below the step time.
        """
        t = self.totals
        seconds = (
            t["step_time_s"] - exclude_seconds
            if 0 <= exclude_seconds < t["step_time_s"]
            else t["step_time_s"]
        )
        seconds = max(seconds, 1e-9)
        per_device_flops = t["flops"] / seconds / self.world_size
        return {
            "tokens_per_s": t["tokens"] / seconds,
            "tokens_per_s_per_device": t["tokens"] / seconds / self.world_size,
            "target_tokens_per_s": t["target_tokens"] / seconds,
            "tflops_per_device": per_device_flops / 1e12,
            "mfu": per_device_flops / self.peak_flops if self.peak_flops else None,
        }
