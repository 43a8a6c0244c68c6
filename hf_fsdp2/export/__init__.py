"""The consolidated HF folder: naming, the gather-free writer, verification, offline export, the hub.

``export_model`` is the entry point a recipe calls (every rank); ``export_checkpoint`` the offline one.
"""

from hf_fsdp2.export.errors import ExportError, ExportResult, ExportVerificationError, VerifyReport
from hf_fsdp2.export.naming import checkpoint_layout, tied_targets
from hf_fsdp2.export.offline import export_checkpoint, load_checkpoint_model
from hf_fsdp2.export.plan import EXPORT_DTYPES, make_plan
from hf_fsdp2.export.probe import probe_limit
from hf_fsdp2.export.verify import verify_export
from hf_fsdp2.export.writer import STAGE_NAME, check_export_dir, export_model

__all__ = [
    "EXPORT_DTYPES",
    "STAGE_NAME",
    "ExportError",
    "ExportResult",
    "ExportVerificationError",
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
