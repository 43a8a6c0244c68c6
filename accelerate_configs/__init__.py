"""Accelerate config files of hf_fsdp2 (installed as ``hf_fsdp2.accelerate_configs`` so that `hf-fsdp2 train`
finds them in a wheel): fsdp2.yaml (one GPU node), fsdp2_cpu.yaml (CPU, gloo), fsdp2_multinode.yaml."""
