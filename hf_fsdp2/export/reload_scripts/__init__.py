"""The scripts verification runs in a separate interpreter, as a user would load an export: plain transformers
(and PEFT for an adapter), no hf_fsdp2.

Each is a file run by its path (``python <file> request.pt out.pt``, or inside the shared interpreter of
:func:`hf_fsdp2.export.reload_process.shared_reload_process`, ``runpy.run_path``), never imported as
``hf_fsdp2.export.reload_scripts.<name>``: running a file by path imports no package above it, so the interpreter
holds no hf_fsdp2 module, which the scripts record and verification checks. They import nothing of hf_fsdp2
(tests/unit/test_reload_scripts.py holds that); they are modules so that ruff and mypy read them.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPORT = HERE / "reload_export.py"  # an exported model folder (hf_fsdp2/export/verify.py)
ADAPTER = HERE / "reload_adapter.py"  # a LoRA adapter on its base (hf_fsdp2/lora/save.py)
SERVER = (
    HERE / "reload_server.py"
)  # the shared interpreter that runs the others (hf_fsdp2/export/reload_process.py)
