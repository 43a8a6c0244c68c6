"""The trainer layer every recipe is written over: a run's ``session`` (accelerator, run folder, checks
before any work), its ``model`` (loading, LoRA, FSDP2, optimizer, loss plan), its data (``sft_data`` for
SFT), its ``state`` (checkpoints, resume, SIGTERM), the ``observer`` (metrics, eval, profiling) and
``finish`` (the verified export, the summary, the push). The step itself is ``hf_fsdp2.train.step``."""
