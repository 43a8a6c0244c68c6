"""The run every method shares: its ``session`` (accelerator, run folder, checks before any work), its ``model``
(loading, LoRA, FSDP2, optimizer, loss plan), ``data`` (what a method's data builder returns and the pieces they
share), ``reference`` (the frozen reference of a preference objective), its ``state`` (checkpoints, resume, SIGTERM),
the ``observer`` (metrics, eval, profiling), ``finish`` (the verified export, the summary, the push), ``method``
(what a training method brings: :class:`~hf_fsdp2.run.method.Method`) and ``loop`` (the run, top to bottom)."""
