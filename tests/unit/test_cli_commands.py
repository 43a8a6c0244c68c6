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
        "train", "convert-smollm2", "demo-data", "eval-task", "eval-preference", "export", "merge-adapter",
        "push", "show-data", "plan", "plot",
    ]  # fmt: skip
