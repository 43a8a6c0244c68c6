"""The ``hf-fsdp2`` sub-commands, one module per concern: each has ``register_<command>`` (the parser, whose
``func`` default is the function that runs it) beside that run function. ``hf_fsdp2.cli`` only dispatches.

Nothing here imports torch, transformers or datasets at import time (the run functions import what they
need), so ``hf-fsdp2 --help`` is instant; tests/unit/test_cli_commands.py holds that.
"""
