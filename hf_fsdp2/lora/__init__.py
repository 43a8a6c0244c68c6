"""LoRA under FSDP2: ``adapter`` (settings, wrapping, memory), ``save`` (the verified adapter export),
``merge`` (the gather-free merged export, offline merging)."""
