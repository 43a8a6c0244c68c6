"""Parallelism: the accelerator and FSDP2 sharding, activation checkpointing, compile, kernels."""
