"""hf_fsdp2: fine-tune HF causal LMs with FSDP2 through Accelerate."""

__version__ = "0.1.0"
