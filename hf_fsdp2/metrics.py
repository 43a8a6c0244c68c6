"""What training does, step by step: throughput, MFU, memory, the metrics file, trackers, progress, summary.

Conventions (docs/observability.md):

- Tokens are counted without padding. ``target_tokens`` carry a loss; ``tokens`` are every non-pad
  input token processed (prompt and completion).
- FLOPs follow torchtitan / nanoGPT: a sequence of ``s`` real tokens costs ``s * (6 * N + 12 * L * H * Q * s)``
  where ``N`` is the parameter count without the input embedding table, ``L`` layers, ``H`` attention
  heads, ``Q`` head dim; ``T = s`` is each sequence's own non-pad length (a packed row holds several
  sequences). Forward + backward only: activation-checkpointing recompute is never counted.
- MFU = achieved FLOP/s per device / the device's peak dense bf16 FLOP/s (``PEAK_FLOPS`` or the
  ``peak_flops`` key). Without a known peak (CPU, unlisted GPU) only the achieved FLOP/s is reported.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hf_fsdp2.train.loss import IGNORE_INDEX

logger = logging.getLogger("hf_fsdp2")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
GIB = 2**30

# Peak dense bf16 tensor-core FLOP/s per device (no sparsity), matched against
# torch.cuda.get_device_name() in order: the first name contained in it wins, so the specific
# variants come before the generic ones. The same numbers as torchtitan's get_peak_flops.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops_for(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from ``PEAK_FLOPS``, or None when it is not listed."""
    for name, flops in PEAK_FLOPS:
        if name in device_name:
            return flops
    return None


# --------------------------------------------------------------------------------------------------
# FLOPs per token
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsModel:
    """FLOPs of forward + backward: ``6 * N`` per token plus ``12 * L * H * Q`` per token and unit of length.

    Attributes:
        non_embedding_params: ``N``: every parameter except the input embedding table (an output head
            is a matmul and counts; a head tied to the embeddings counts once, as the head).
        layers: ``L``, decoder layers.
        heads: ``H``, attention (query) heads.
        head_dim: ``Q``, dimension of each head.
    """

    non_embedding_params: int
    layers: int
    heads: int
    head_dim: int

    def per_token(self, seq_len: int) -> float:
        """``6 * N + 12 * L * H * Q * T`` for a token of a sequence of ``T = seq_len`` tokens."""
        return 6.0 * self.non_embedding_params + 12.0 * self.layers * self.heads * self.head_dim * seq_len

    def for_sequences(self, lengths: Sequence[int]) -> float:
        """FLOPs of sequences of these non-pad lengths: ``sum(s * per_token(s))``."""
        total = sum(lengths)
        squares = sum(s * s for s in lengths)
        return (
            6.0 * self.non_embedding_params * total
            + 12.0 * self.layers * self.heads * self.head_dim * squares
        )


def non_embedding_params(model: torch.nn.Module) -> int:
    """Parameters of ``model`` minus its input embedding table (works on meta and unsharded models).

    A tied output head shares the table's tensor: it is then counted once, as the head's matmul.
    """
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    get_input, get_output = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    embeddings = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    if isinstance(embeddings, torch.nn.Module):
        table = getattr(embeddings, "weight", None)
        head_weight = getattr(head, "weight", None) if head is not None else None
        if table is not None and table is not head_weight:
            total -= table.numel()
    return total


def flops_model(model_config: Any, non_embedding: int) -> FlopsModel:
    """The :class:`FlopsModel` of an HF decoder config (``num_hidden_layers``, ``num_attention_heads``, ...).

    Args:
        model_config: the model's ``PretrainedConfig`` (its text config for multimodal models).
        non_embedding: ``N`` from :func:`non_embedding_params`.

    Returns:
        The FLOPs model; ``head_dim`` is the config's, else ``hidden_size // num_attention_heads``.
    """
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return FlopsModel(non_embedding, int(config.num_hidden_layers), heads, int(head_dim))


def sequence_lengths(batch: Mapping[str, torch.Tensor], pad_token_id: int | None) -> list[int]:
    """Non-pad lengths of the sequences of a collated batch (what FLOPs and ``tokens`` count).

    A padded batch (``attention_mask``) holds one sequence per row. A batch with ``position_ids``
    (packed or padding-free) holds a sequence wherever the positions restart at 0; a row's trailing
    run of pad ids without labels is its padding, not a sequence.

    Args:
        batch: ``input_ids`` and optionally ``attention_mask``, ``position_ids``, ``labels``.
        pad_token_id: the pad id (None: no padding detection in packed rows).

    Returns:
        One length per real sequence.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    labels = batch.get("labels")
    if positions is None:
        if mask is None:
            return [int(ids.shape[1])] * int(ids.shape[0])
        return [int(n) for n in mask.sum(dim=1).tolist()]
    lengths: list[int] = []
    width = int(ids.shape[1])
    for row in range(int(ids.shape[0])):
        starts = (positions[row] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, width]
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            n = int(mask[row, a:b].sum()) if mask is not None else b - a
            last = i == len(bounds) - 2
            if mask is None and last and i > 0 and pad_token_id is not None:
                is_pad = bool((ids[row, a:b] == pad_token_id).all()) and (
                    labels is None or bool((labels[row, a:b] == IGNORE_INDEX).all())
                )
                if is_pad:
                    continue
            if n:
                lengths.append(n)
    return lengths


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# The per-step meter
# --------------------------------------------------------------------------------------------------

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
            "steps": 0, "tokens": 0, "target_tokens": 0, "flops": 0.0, "step_time_s": 0.0,
            "data_wait_s": 0.0, "peak_memory_gib": 0.0,
        }  # fmt: skip

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
            lengths = sequence_lengths(batch, self.pad_token_id)
            self._interval[_TOKENS] += sum(lengths)
            self._interval[_FLOPS] += self.flops.for_sequences(lengths)

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
        table = gather_rows(local, self.device)  # [world, fields]
        sums, maxes = table.sum(dim=0).tolist(), table.max(dim=0).values.tolist()
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

    def mean_throughput(self) -> dict[str, float | None]:
        """Run-level means of the logged intervals: tokens/s (global, per device), TFLOP/s per device, MFU."""
        t = self.totals
        seconds = max(t["step_time_s"], 1e-9)
        per_device_flops = t["flops"] / seconds / self.world_size
        return {
            "tokens_per_s": t["tokens"] / seconds,
            "tokens_per_s_per_device": t["tokens"] / seconds / self.world_size,
            "target_tokens_per_s": t["target_tokens"] / seconds,
            "tflops_per_device": per_device_flops / 1e12,
            "mfu": per_device_flops / self.peak_flops if self.peak_flops else None,
        }


def gather_rows(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Every rank's ``values`` as rows of a ``[world, len(values)]`` float64 tensor (all ranks call it)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local[None].cpu()
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)  # every rank: a few floats each
    return torch.stack(rows).cpu()


# --------------------------------------------------------------------------------------------------
# The metrics file and the log line
# --------------------------------------------------------------------------------------------------


class MetricsWriter:
    """Appends one JSON object per logged optimizer step to ``<output_dir>/metrics.jsonl``.

    Only the main process writes; the others hold a writer that does nothing, so the recipe needs
    no rank checks at its call sites.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, resume_step: int | None = None) -> None:
        """Start the file, or on resume keep its records up to ``resume_step`` (later ones are re-run)."""
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_step is not None and self.path.is_file():
                kept = [
                    line
                    for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step
                ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (numbers rounded for reading, NaN/inf kept as strings)."""
        if not self.enabled:
            return
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()
        }
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def format_duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``12s``."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_log_line(record: dict[str, Any], total_steps: int) -> str:
    """The human-readable line printed for a logged step (fields a record lacks are left out)."""
    line = (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} lr {record['lr']:.3e} "
        f"grad_norm {record['grad_norm']:.3f} target_tokens {record['target_tokens']} "
        f"tok/s {record['target_tokens_per_s']:.1f} step_time {record['step_time_s']:.2f}s"
    )
    if "tokens_per_s" in record:
        line += f" | all tok/s {record['tokens_per_s']:.1f} ({record['tokens_per_s_per_device']:.1f}/dev)"
    if "mfu" in record:
        line += f" mfu {record['mfu']:.1%}"
    elif "tflops_per_device" in record:
        line += f" {record['tflops_per_device']:.3g} TFLOP/s/dev"
    if "data_wait_s" in record:
        line += f" data_wait {record['data_wait_s']:.3f}s"
    if "padding_efficiency" in record:
        line += f" pad_eff {record['padding_efficiency']:.3f}"
    if "mem_allocated_gib" in record:
        line += f" mem {record['mem_allocated_gib']:.1f}/{record['mem_reserved_gib']:.1f}GiB"
    elif "host_rss_gib" in record:
        line += f" rss {record['host_rss_gib']:.2f}GiB"
    if "eta_s" in record:
        line += f" eta {format_duration(record['eta_s'])}"
    return line


# --------------------------------------------------------------------------------------------------
# Progress: a bar on an interactive terminal, one line per logged step otherwise
# --------------------------------------------------------------------------------------------------


class Progress:
    """tqdm bar on rank 0 when stderr is a terminal; otherwise the log line of each logged step.

    With the bar, log lines of the recipe go through tqdm (they do not break the bar) and each logged
    step's numbers appear in the bar's postfix instead of a line.
    """

    def __init__(
        self, total_steps: int, first_step: int, *, enabled: bool, interactive: bool | None = None
    ) -> None:
        """Args:
        total_steps: last step of the run.
        first_step: first step this process runs (after a resume, > 1).
        enabled: this is the main process.
        interactive: force the bar on or off; None = when stderr is a terminal.
        """
        self.total_steps = total_steps
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self.bar: Any = None
        self._redirect: Any = None
        if enabled and interactive:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", dynamic_ncols=True)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
        self.enabled = enabled

    def step(self) -> None:
        """One optimizer step done."""
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict[str, Any]) -> None:
        """Show a logged step: the bar's postfix, or one log line."""
        if not self.enabled:
            return
        if self.bar is None:
            logger.info(format_log_line(record, self.total_steps))
            return
        postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record.get('tokens_per_s', 0.0):.0f}"}
        if "mfu" in record:
            postfix["mfu"] = f"{record['mfu']:.1%}"
        if "eval_loss" in record:
            postfix["eval"] = f"{record['eval_loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        """Close the bar and give logging back its own handlers."""
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
            self.bar = None


# --------------------------------------------------------------------------------------------------
# Trackers (through accelerate)
# --------------------------------------------------------------------------------------------------

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


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def build_trackers(report_to: str, log_dir: str | Path, *, project: str, run_name: str) -> list[Any]:
    """Accelerate trackers for ``report_to``, ready to pass as ``Accelerator(log_with=...)``.

    Args:
        report_to: the config value (see :func:`parse_report_to`); ``all`` = every one installed.
        log_dir: folder of local logs (TensorBoard events go to ``log_dir/run_name``).
        project: wandb / trackio project.
        run_name: the run's name in every tracker.

    Returns:
        ``GeneralTracker`` instances (empty for ``none``); accelerate starts them in ``init_trackers``.

    Raises:
        ValueError: a named tracker is not installed (the message gives the pip command), or ``all``
            finds none installed.
    """
    from accelerate.tracking import TensorBoardTracker, TrackioTracker, WandBTracker

    names = parse_report_to(report_to)
    if names == ("all",):
        names = tuple(n for n in TRACKERS if _installed(_TRACKER_PACKAGES[n]))
        if not names:
            raise ValueError(
                "report_to=all but none of tensorboard, wandb, trackio is installed; "
                "pip install tensorboard (or wandb, trackio), or set report_to=none"
            )
        logger.info("report_to=all: %s", ", ".join(names))
    missing = [n for n in names if not _installed(_TRACKER_PACKAGES[n])]
    if missing:
        raise ValueError(
            f"report_to={report_to!r} needs {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(_TRACKER_PACKAGES[n] for n in missing)} (or drop it from report_to)"
        )
    trackers: list[Any] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_name, str(log_dir)))
        elif name == "wandb":
            trackers.append(WandBTracker(project, name=run_name, dir=str(log_dir)))
        else:
            trackers.append(TrackioTracker(project, name=run_name))
    return trackers


def tracker_values(record: Mapping[str, Any]) -> dict[str, int | float | str]:
    """The numbers of a record (not the step itself) for ``accelerator.log``."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def tracker_config(flat_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config as trackers accept it: lists joined, None as an empty string, secrets left out."""
    out: dict[str, Any] = {}
    for key, value in flat_config.items():
        if "token" in key:
            continue
        if isinstance(value, list | tuple):
            value = ",".join(map(str, value))
        out[key] = "" if value is None else value
    return out


# --------------------------------------------------------------------------------------------------
# Run summary
# --------------------------------------------------------------------------------------------------


def run_summary(
    meter: StepMeter,
    *,
    first_step: int,
    last_step: int,
    wall_seconds: float,
    last_record: Mapping[str, Any] | None,
    last_eval: Mapping[str, Any] | None,
    export_dir: str | Path | None,
    compile_stats: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """What the run did, for the log and ``summary.json``.

    Args:
        meter: the loop's meter (its totals over the logged intervals).
        first_step: first step this process ran.
        last_step: last step it ran.
        wall_seconds: time from the start of the recipe to now.
        last_record: the last metrics record (final training loss), or None.
        last_eval: the last eval results (``eval_loss``, ``eval_perplexity``), or None.
        export_dir: where the consolidated HF folder went, or None.
        compile_stats: with torch.compile, ``compile_s`` (seconds compiling inside the steps, rank 0),
            ``compiled_graphs`` and ``recompiles``; the summary then also gives the throughput without
            the compile time.

    Returns:
        A JSON-ready dict.
    """
    t = meter.totals
    extra: dict[str, Any] = {}
    if compile_stats is not None:
        compile_s = float(compile_stats.get("compile_s", 0.0))
        steady = max(t["step_time_s"] - compile_s, 1e-9)
        extra = {
            "compile_time_s": compile_s,
            "compiled_graphs": int(compile_stats.get("compiled_graphs", 0)),
            "recompiles": int(compile_stats.get("recompiles", 0)),
            "tokens_per_s_excluding_compile": t["tokens"] / steady,
        }
    return {
        "steps": last_step - first_step + 1 if last_step >= first_step else 0,
        "first_step": first_step,
        "last_step": last_step,
        "tokens": int(t["tokens"]),
        "target_tokens": int(t["target_tokens"]),
        "wall_time_s": wall_seconds,
        "train_time_s": t["step_time_s"],
        "data_wait_s": t["data_wait_s"],
        **meter.mean_throughput(),
        "peak_memory_gib": t["peak_memory_gib"],
        "peak_memory_kind": "cuda_allocated" if meter.device.type == "cuda" else "host_rss",
        "world_size": meter.world_size,
        "final_loss": last_record.get("loss") if last_record else None,
        "final_eval_loss": last_eval.get("eval_loss") if last_eval else None,
        "final_eval_perplexity": last_eval.get("eval_perplexity") if last_eval else None,
        "export_dir": str(export_dir) if export_dir is not None else None,
        **extra,
    }


def format_summary(summary: Mapping[str, Any]) -> list[str]:
    """Log lines of a :func:`run_summary`."""
    mfu = summary.get("mfu")
    lines = [
        f"summary: {summary['steps']} steps ({summary['first_step']}..{summary['last_step']}) in "
        f"{format_duration(summary['wall_time_s'])} wall, {format_duration(summary['train_time_s'])} in steps "
        f"({format_duration(summary['data_wait_s'])} waiting for data)",
        f"summary: {summary['tokens']} tokens ({summary['target_tokens']} target) at "
        f"{summary['tokens_per_s']:.1f} tok/s ({summary['tokens_per_s_per_device']:.1f} per device), "
        f"{summary['tflops_per_device']:.3g} TFLOP/s per device"
        + (f", MFU {mfu:.1%}" if mfu is not None else " (no MFU: unknown peak; set peak_flops)"),
        f"summary: peak memory {summary['peak_memory_gib']:.2f} GiB ({summary['peak_memory_kind']}, max over ranks)",
    ]
    if summary.get("compile_time_s") is not None:
        lines.append(
            f"summary: torch.compile {format_duration(summary['compile_time_s'])} compiling inside the steps, "
            f"{summary['compiled_graphs']} graphs, {summary['recompiles']} recompiles; "
            f"{summary['tokens_per_s_excluding_compile']:.1f} tok/s without the compile time"
        )
    losses = []
    if summary.get("final_loss") is not None:
        losses.append(f"final loss {summary['final_loss']:.4f}")
    if summary.get("final_eval_loss") is not None:
        losses.append(
            f"eval loss {summary['final_eval_loss']:.4f} (perplexity {summary['final_eval_perplexity']:.3f})"
        )
    if losses:
        lines.append("summary: " + ", ".join(losses))
    lines.append(
        f"summary: export in {summary['export_dir']}" if summary.get("export_dir") else "summary: no export"
    )
    return lines


def write_summary(summary: Mapping[str, Any], output_dir: str | Path) -> Path:
    """Write ``<output_dir>/summary.json``; returns its path."""
    path = Path(output_dir) / SUMMARY_FILE
    path.write_text(json.dumps(dict(summary), indent=2) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# Plots (`hf-fsdp2 plot RUN_DIR`)
# --------------------------------------------------------------------------------------------------

# One PNG per panel: (file name, title, y label, [(record key, legend label)]).
PLOTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("loss.png", "Loss", "cross entropy", (("loss", "train loss"), ("eval_loss", "eval loss"))),
    (
        "throughput.png",
        "Throughput",
        "tokens / s (global)",
        (("tokens_per_s", "all tokens"), ("target_tokens_per_s", "target tokens")),
    ),
    (
        "memory.png",
        "Peak memory",
        "GiB (max over ranks)",
        (
            ("mem_allocated_gib", "CUDA allocated"),
            ("mem_reserved_gib", "CUDA reserved"),
            ("host_peak_rss_gib", "host peak RSS"),
        ),
    ),
    ("lr.png", "Learning rate", "lr", (("lr", "lr"),)),
)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """PNG plots of a run's metrics.jsonl: loss (+ eval loss), tokens/s, memory, learning rate.

    Args:
        run_dir: the run's output_dir (holding metrics.jsonl).
        out_dir: where to write the PNGs (default ``run_dir/plots``).

    Returns:
        The PNG files written (a panel without any data is skipped).

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: the file holds no record, or matplotlib is not installed.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; give the output_dir of a run")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a running job is writing
    if not records:
        raise ValueError(f"{path} holds no record yet")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("hf-fsdp2 plot needs matplotlib: pip install matplotlib") from err
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, title, ylabel, series in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=label)
                drawn = True
        if drawn:
            ax.set(title=title, xlabel="step", ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(target / filename, dpi=100)
            written.append(target / filename)
        plt.close(fig)
    return written
