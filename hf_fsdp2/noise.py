"""Messages of other packages that say nothing about a run, dropped on every rank and by every command.

torchao (imported by transformers' quantizer registry whenever it is installed, QLoRA's extra) registers Enum
classes with torch's pytree, which torch 2.13 calls deprecated; fails to load its CUDA-build extensions (mxfp8,
cutlass: kernels hf_fsdp2 does not use) on CPU or another Python; and, where Triton is absent (CPU machines), warns
that some of its kernels will not work (none of them is used here). Each repeats on every rank of every run.
Standing on ``logging`` alone, so that the CLI installs the filters before any command imports torchao.
"""

from __future__ import annotations

import logging

# logger name -> a piece of the message dropped (a filter on a logger sees the records that logger creates).
FOREIGN_NOISE = {
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
    "torchao": "Failed to load ",
    "torchao.kernel.intmm": "Detected no triton",
}


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_foreign_noise() -> None:
    """Drop the messages of :data:`FOREIGN_NOISE` (idempotent)."""
    for name, text in FOREIGN_NOISE.items():
        logger_ = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger_.filters):
            logger_.addFilter(_DropMessage(text))
