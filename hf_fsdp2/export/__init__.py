"""The consolidated HF folder: naming, the gather-free writer, verification, offline export, the hub.

``export_model`` is the entry point a recipe calls (every rank); ``export_checkpoint`` the offline one.

The names below load on first use (PEP 562): ``hf-fsdp2 push`` imports :mod:`hf_fsdp2.export.hub`, which needs
neither torch nor transformers, and importing this package must not cost it their ~3 s of imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_fsdp2.export.errors import ExportError, ExportResult, ExportVerificationError, VerifyReport
    from hf_fsdp2.export.naming import checkpoint_layout, tied_targets
    from hf_fsdp2.export.offline import export_checkpoint, load_checkpoint_model
    from hf_fsdp2.export.plan import EXPORT_DTYPES, make_plan
    from hf_fsdp2.export.probe import probe_limit
    from hf_fsdp2.export.verify import verify_export
    from hf_fsdp2.export.writer import STAGE_NAME, check_export_dir, export_model

_HOME = {
    "ExportError": "errors",
    "ExportResult": "errors",
    "ExportVerificationError": "errors",
    "VerifyReport": "errors",
    "checkpoint_layout": "naming",
    "tied_targets": "naming",
    "export_checkpoint": "offline",
    "load_checkpoint_model": "offline",
    "EXPORT_DTYPES": "plan",
    "make_plan": "plan",
    "probe_limit": "probe",
    "verify_export": "verify",
    "STAGE_NAME": "writer",
    "check_export_dir": "writer",
    "export_model": "writer",
}

__all__ = [
    "EXPORT_DTYPES",
    "ExportError",
    "ExportResult",
    "ExportVerificationError",
    "STAGE_NAME",
    "VerifyReport",
    "check_export_dir",
    "checkpoint_layout",
    "export_checkpoint",
    "export_model",
    "load_checkpoint_model",
    "make_plan",
    "probe_limit",
    "tied_targets",
    "verify_export",
]


def __getattr__(name: str) -> Any:
    """``from hf_fsdp2.export import export_model`` imports the one module that defines it."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value
