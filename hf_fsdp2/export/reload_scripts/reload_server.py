"""The shared reload interpreter (hf_fsdp2/export/reload_process.py's ``shared_reload_process``).

Run by path (``python reload_server.py``). Reads requests on stdin as JSON lines ``[script, request file, output
file, environment]``; runs each script (a file, by its path) as ``python script request out`` would run it
(``__main__``, those ``sys.argv``, that environment, a fresh namespace: only imported modules carry over); answers
one JSON line per request on the real stdout, ``{"ok": true}`` or ``{"ok": false, "error": ...}`` (the scripts' own
prints go to stderr, so they cannot be taken for an answer). The loop ends when stdin closes.

Imports nothing of hf_fsdp2 (hf_fsdp2/export/reload_scripts/__init__.py says why).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback
from typing import TextIO


def serve(requests: TextIO, answers: TextIO) -> None:
    """Run every request read from ``requests``; one answer line each on ``answers``."""
    for line in requests:
        script, req, out, env = json.loads(line)
        sys.argv = [script, req, out]
        os.environ.clear()
        os.environ.update(env)
        answer: dict[str, bool | str]
        try:
            runpy.run_path(script, run_name="__main__")  # its namespace is dropped with its objects
            answer = {"ok": True}
        except BaseException as err:
            answer = {"ok": False, "error": " | ".join(traceback.format_exception_only(err)[-3:]).strip()}
        gc.collect()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    answers = sys.stdout
    sys.stdout = sys.stderr
    serve(sys.stdin, answers)


if __name__ == "__main__":
    main()
