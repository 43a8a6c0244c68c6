"""``python -m hf_fsdp2.methods NAME [--config r.yaml] [--key value ...]``: run a training method with the library's
loop on this rank (what ``hf-fsdp2 train NAME`` launches on every rank through accelerate launch; a checkout's
``recipes/NAME.py`` does the same)."""

from __future__ import annotations

import sys

from hf_fsdp2.methods import get_method, method_names, parse_method_config
from hf_fsdp2.run.finish import run_recipe
from hf_fsdp2.run.loop import run


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        raise SystemExit(
            f"usage: python -m hf_fsdp2.methods {{{','.join(method_names())}}} [--config r.yaml] [--key value ...]"
        )
    method = get_method(args[0])
    run(parse_method_config(method, args[1:]), method)


if __name__ == "__main__":
    run_recipe(main)
