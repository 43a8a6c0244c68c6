"""GRPO's vLLM rollouts: ``client`` (the trainer's HTTP client of the server, a generator over it and the per-layer
weight sync), ``colocate`` (an engine in each training process, ``vllm_mode: colocate``, in .venv-vllm),
``importance`` (the importance-sampling correction of vLLM's log-probs) and ``server`` (``hf-fsdp2 vllm-serve``'s
server, run by path in .venv-vllm; it imports nothing of hf_fsdp2)."""
