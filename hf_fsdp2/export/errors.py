"""What an export reports: its errors, the verification's findings, the published folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class ExportError(RuntimeError):
    """An export that cannot be written; the message says why and what to do."""


class ExportVerificationError(ExportError):
    """The written folder does not reproduce the live model (keys, shapes, dtypes, values, config or logits)."""


class ExportInterrupted(ExportError):
    """A signal (a launcher's SIGTERM, Ctrl-C, the OOM killer's SIGKILL) ended the export's verification before it
    reached a finding: nothing is known to be wrong with the files, and nothing was published."""


@dataclass(kw_only=True)
class VerifyReport:
    """What the verification checked, and what it found wrong (empty ``problems`` = verified)."""

    tensors: int = 0
    bytes_compared: int = 0
    reloaded_tensors: int = 0
    config_keys: int = 0
    max_logit_diff: float = float("nan")
    logit_scale: float = 0.0
    logit_noise: float = float("nan")  # the reload's own rounding: its logits in the compute dtype vs float32
    atol: float = 0.0
    reload_dtype: str = ""
    reload_devices: list[str] = field(default_factory=list)  # ["cpu"], or ["cpu", "disk"] when streamed
    carried: int = 0  # tensors copied from the source checkpoint, their sha256 equal to the source's
    source: str = ""  # that checkpoint ("": no source given)
    source_tensors: int = 0  # its tensors, every one in the export (or a tied copy)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def margin(self) -> str:
        """How far under the probe limit the difference stayed ("40x under the limit")."""
        if self.max_logit_diff == 0:
            return "exactly equal"
        if not self.max_logit_diff > 0:
            return "not measured"
        return f"{self.atol / self.max_logit_diff:.0f}x under the limit"

    def _noise(self) -> str:
        return f", reload rounding noise {self.logit_noise:.3g}" if self.logit_noise > 0 else ""

    def _whole(self) -> str:
        if not self.source:
            return ""
        return (
            f"; every one of the {self.source_tensors} tensors of {self.source} in the files under its name, "
            f"{self.carried} of them (what did not train or the class does not load) byte-identical to the source's"
        )

    def summary(self) -> str:
        if not self.ok:
            return "FAILED: " + "; ".join(self.problems)
        return (
            f"verified: {self.tensors} tensors bit-exact on disk ({self.bytes_compared / 1e6:.1f} MB read back by "
            f"the ranks that own them{self._whole()}); reloaded with plain transformers (weights on "
            f"{'+'.join(self.reload_devices)}): no missing or unexpected keys, {self.reloaded_tensors} reloaded "
            f"tensor slices bit-exact, config.json equal to the live config ({self.config_keys} keys); probe logits in "
            f"{self.reload_dtype} from the same rounded weights: max |diff| {self.max_logit_diff:.3g} "
            f"(logit scale {self.logit_scale:.3g}{self._noise()}, limit {self.atol:.3g}: {self.margin()})"
        )


@dataclass(kw_only=True)
class ExportResult:
    """The published folder: its weight files, their total size and dtype, and the verification."""

    out_dir: Path
    files: list[str]
    total_bytes: int
    dtype: str
    seconds: float
    verify: VerifyReport | None
