"""``hf-fsdp2 push``: an export folder to a hub model repo (:mod:`hf_fsdp2.export.hub`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_fsdp2.commands.common import Subparsers, user_error


def _run_push(args: argparse.Namespace) -> int:
    from hf_fsdp2.export.hub import RUN_FOLDER_IGNORE, HubError, push_folder, resolve_token

    try:
        result = push_folder(
            args.out_dir,
            args.repo_id,
            token=args.token,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            ignore_patterns=RUN_FOLDER_IGNORE,
            retries=args.retries,
            dry_run=args.dry_run,
            check_export=True,
            force=args.force,
        )
    except HubError as err:
        return user_error("push", err)
    summary = {
        "repo_id": result.repo_id,
        "revision": result.revision,
        "files": len(result.files),
        "total_bytes": result.total_bytes,
        "commit_url": result.commit_url,
        "dry_run": result.dry_run,
        "verified_export": not result.problems,
    }
    if args.dry_run:
        for path, size in result.files:
            print(f"would upload {path} ({size} bytes)", file=sys.stderr)
        try:
            summary["token"] = resolve_token(args.token)[1]
        except HubError:
            summary["token"] = None  # the real push would stop here; a dry run only reports it
        summary["paths"] = [path for path, _ in result.files]
    print(json.dumps(summary))
    return 0


def register_push(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "push",
        help="upload an export folder to a hub model repo (resumable; --dry-run lists the files)",
        description=(
            "Check that OUT_DIR is a verified export (config, safetensors headers, index, and the export's record "
            "of its verification; --force to push it anyway), create REPO_ID if needed (and the branch given by "
            "--revision), then upload OUT_DIR with "
            "huggingface_hub's upload_folder (resumable: re-run after a failure and it continues). Sharded "
            "checkpoints, staging folders and hidden files of a run folder are skipped. Token: --token, else "
            "HF_TOKEN, else `hf auth login`."
        ),
    )
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the export folder (or a run's output_dir)")
    p.add_argument("repo_id", metavar="REPO_ID", help="namespace/name of the model repo")
    visibility = p.add_mutually_exclusive_group()
    visibility.add_argument(
        "--private", dest="private", action="store_true", default=None, help="create the repo private"
    )
    visibility.add_argument("--public", dest="private", action="store_false", help="create the repo public")
    p.add_argument("--revision", default=None, help="branch to push to, created if missing (default: main)")
    p.add_argument("--commit-message", default=None, help="title of the commit")
    p.add_argument(
        "--token", default=None, help="hub token (prefer HF_TOKEN: a command line is visible to others)"
    )
    p.add_argument("--retries", type=int, default=3, help="retries after a transient failure (default: 3)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the folder as the push does and list what would be uploaded; no network, no token",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="push a folder that is not a verified export (damaged files, or no record of the export's "
        "verification) anyway; its problems are printed as warnings",
    )
    p.set_defaults(func=_run_push)
