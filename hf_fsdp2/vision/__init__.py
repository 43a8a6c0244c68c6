"""Vision-language training of composite checkpoints on image records: which composites train on images and how their
batches are laid out (``families``), the processor and a dummy image (``processor``), Qwen's 3-D positions per
document (``positions``), the tower run on every micro-batch that keeps the ranks' collectives alike (``tower``), and
the tower's FSDP2 grain, one unit or one per block (``grain``)."""
