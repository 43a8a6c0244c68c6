"""``hf-fsdp2`` dispatches to hf_fsdp2/commands/: every sub-command's parser sits beside the function that runs
it, and building the whole parser (what ``hf-fsdp2 --help`` does) imports no torch, transformers or datasets."""

from __future__ import annotations

import argparse
import subprocess
import sys

from hf_fsdp2 import cli


def test_the_parser_imports_nothing_heavy():
    code = (
        "import sys; from hf_fsdp2.cli import build_parser; build_parser().format_help(); "
        "print(sorted({'torch', 'transformers', 'datasets', 'accelerate', 'peft'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", (
        f"hf-fsdp2 --help imports {out.stdout.strip()}: import them in run functions"
    )


def test_each_parser_runs_a_function_of_its_own_module():
    subparsers = argparse.ArgumentParser().add_subparsers(dest="command")
    names = []
    for register in cli.SUBCOMMANDS:
        before = set(subparsers.choices)
        register(subparsers)
        (name,) = set(subparsers.choices) - before  # one command per register function
        func = subparsers.choices[name].get_default("func")
        assert func.__module__ == register.__module__, (name, func.__module__, register.__module__)
        assert register.__module__.startswith("hf_fsdp2.commands."), register.__module__
        names.append(name)
    assert names == [
        "train",
        "convert-smollm2",
        "demo-data",
        "eval-task",
        "eval-preference",
        "score",
        "eval-harness",
        "export",
        "merge-adapter",
        "push",
        "show-data",
        "plan",
        "plot",
        "doctor",
        "vllm-serve",
    ]


def test_torchaos_noise_is_dropped_by_every_command_and_other_warnings_kept(caplog) -> None:
    """The three messages torchao's import logs on every rank (hf_fsdp2/noise.py) are dropped once the CLI (or a
    run's logging) is set up; another warning of the same loggers still shows."""
    import logging

    from hf_fsdp2.noise import FOREIGN_NOISE, quiet_foreign_noise

    quiet_foreign_noise()
    quiet_foreign_noise()  # idempotent: one filter per logger
    with caplog.at_level(logging.WARNING):
        for name, text in FOREIGN_NOISE.items():
            assert len(logging.getLogger(name).filters) >= 1
            logging.getLogger(name).warning("Warning: %s, on systems without it", text)
            logging.getLogger(name).warning("something else from %s", name)
    messages = [r.getMessage() for r in caplog.records]
    assert not any(text in m for m in messages for text in FOREIGN_NOISE.values()), messages
    assert sum("something else" in m for m in messages) == len(FOREIGN_NOISE)


def test_every_method_is_a_train_subcommand_that_launches_the_library() -> None:
    from hf_fsdp2.launch import launch_command
    from hf_fsdp2.methods import get_method, method_names

    assert method_names() == ["sft", "cpt", "dpo", "kto", "rm", "grpo"]
    parser = cli.build_parser()
    for recipe in method_names():
        args, extra = parser.parse_known_args(
            ["train", "--recipe", recipe, "--config", "r.yaml", "--beta", "0.2"]
        )
        assert (args.recipe, extra) == (recipe, ["--beta", "0.2"])
        command = launch_command(recipe, ["--config", "r.yaml"], num_processes=2, gpus=0)
        assert command[-5:] == ["-m", "hf_fsdp2.methods", recipe, "--config", "r.yaml"], command
        assert get_method(recipe).name == recipe
