"""The export's refusal of non-finite weights, whatever put them there (a diverged run, damaged checkpoint bytes).

A NaN or inf weight makes every output of the model NaN; the byte-exact verification compares the files with the
live model, so it passes when both hold the same NaN. The writer checks each group of tensors before writing it:
one host read per group (a stack of per-tensor flags), not one per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from hf_fsdp2.export.errors import ExportError

# How many offending tensor names a message lists.
NAMES_SHOWN = 5


def nonfinite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the tensors holding a NaN or an infinity (this rank's shards only; not collective).

    Args:
        tensors: name -> tensor (a DTensor is checked by its local shard).

    Returns:
        The offending names, in the mapping's order (empty: every value is finite).
    """
    floating = [
        (k, v.to_local() if isinstance(v, DTensor) else v)
        for k, v in tensors.items()
        if v.is_floating_point()
    ]
    floating = [(k, v) for k, v in floating if v.numel()]
    if not floating:
        return []
    flags = torch.stack([torch.isfinite(v.detach()).all() for _, v in floating])
    return [k for (k, _), ok in zip(floating, flags.tolist(), strict=True) if not ok]  # one host read


def check_finite(tensors: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Refuse to write ``what`` when any of ``tensors`` holds a NaN or an infinity (this rank's shards).

    Raises:
        ExportError: naming the tensors and what to do.
    """
    bad = nonfinite_names(tensors)
    if bad:
        shown = ", ".join(bad[:NAMES_SHOWN]) + (
            f" and {len(bad) - NAMES_SHOWN} more" if len(bad) > NAMES_SHOWN else ""
        )
        raise ExportError(
            f"refusing to export {what}: non-finite values (NaN or inf) in {shown}. The weights are unusable: the "
            "run diverged (lower learning_rate; see on_nonfinite) or the checkpoint's files are damaged; export an "
            "earlier checkpoint-<step>"
        )
