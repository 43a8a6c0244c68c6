"""Pushing folders to a hub with huggingface_hub (the model card of an export is :mod:`hf_fsdp2.export.card`).

Token: ``hub_token`` / ``--token`` if given, else ``HF_TOKEN``, else the stored ``hf auth login`` token
(:func:`resolve_token`); a missing one is an error raised before any training or upload work.
Uploads go through ``HfApi.upload_folder``, which with ``hf_xet`` installed (a dependency of
huggingface_hub) is the library's resumable large-folder path: files are chunked, deduplicated and
committed in batches, and re-running an interrupted upload skips what already arrived. On a
transient failure (connection, 429, 5xx) :func:`push_folder` retries the whole call with backoff,
then raises :class:`HubError`; the local folder is never modified.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_fsdp2.config.plans import repo_id_problem

logger = logging.getLogger("hf_fsdp2")

# What a run folder holds that is not the model: sharded checkpoints, staging folders, pointers.
RUN_FOLDER_IGNORE = [
    "checkpoint-*",
    "checkpoint-*/**",
    ".tmp-checkpoint-*",
    ".tmp-checkpoint-*/**",
    ".export-incomplete",
    ".export-incomplete/**",
    "latest",
    ".*",
    "**/.*",
    # Run artefacts of the observability features: per-rank traces and tracker logs are not model files.
    "profile/**",
    "tensorboard/**",
    "debug/**",
    "merged/**",
]
CHECKPOINT_PATH_IN_REPO = "last-checkpoint"


class HubError(RuntimeError):
    """A push that cannot start or did not complete; the message says why and what to do."""


@dataclass(kw_only=True)
class PushResult:
    """Where a push went (or would go, for a dry run) and what it carried."""

    repo_id: str
    revision: str
    files: list[tuple[str, int]]  # (path in the repo, bytes)
    commit_url: str | None
    attempts: int
    dry_run: bool
    problems: list[str] = field(default_factory=list)  # why it is not a verified export (pushed with force)

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)


def resolve_token(explicit: str | None = None) -> tuple[str, str]:
    """The hub token to push with, and where it came from.

    Args:
        explicit: ``hub_token`` / ``--token``; wins when given.

    Returns:
        (token, source) with source ``argument``, ``HF_TOKEN`` or ``login``.

    Raises:
        HubError: no token anywhere, with the ways to provide one.
    """
    if explicit:
        return explicit, "argument"
    env = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if env:
        return env.strip(), "HF_TOKEN"
    from huggingface_hub import get_token

    stored = get_token()
    if stored:
        return stored, "login"
    raise HubError(
        "pushing to the hub needs a token with write access and none was found: set HF_TOKEN=hf_..., run "
        "`hf auth login`, or give hub_token (prefer the environment: a token in a command line is visible "
        "to other users of the machine). Nothing was started"
    )


def check_can_push(repo_id: str | None, token: str | None = None) -> str:
    """Everything about a push that can be checked without the network; run it before any work.

    Args:
        repo_id: ``hub_model_id`` (``namespace/name``).
        token: explicit token, else the environment / login.

    Returns:
        The token to push with.

    Raises:
        HubError: no repo id, an invalid one, offline mode, or no token.
    """
    from huggingface_hub import constants

    if not repo_id:
        raise HubError("pushing needs a repo id: set hub_model_id (e.g. 'my-org/llama3-8b-sft')")
    problem = repo_id_problem(repo_id)
    if problem:
        raise HubError(problem)
    if constants.is_offline_mode():
        raise HubError(
            "HF_HUB_OFFLINE=1 is set, so nothing can be pushed; unset it, or set push_to_hub=false"
        )
    value, source = resolve_token(token)
    logger.info("hub token found (%s); will push to %s", source, repo_id)
    return value


def upload_plan(
    folder: str | Path, *, ignore_patterns: list[str] | None = None, path_in_repo: str = ""
) -> list[tuple[str, int]]:
    """The files ``upload_folder`` would send, filtered exactly as the library filters them.

    Returns:
        (path in the repo, bytes) of each file, sorted.

    Raises:
        HubError: the folder does not exist.
    """
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise HubError(f"{folder} is not a folder; give the export folder (OUT_DIR of `hf-fsdp2 export`)")
    rel = {p.relative_to(root).as_posix(): p for p in sorted(root.glob("**/*")) if p.is_file()}
    ignore = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
    prefix = f"{path_in_repo.strip('/')}/" if path_in_repo else ""
    return [
        (prefix + r, rel[r].stat().st_size) for r in filter_repo_objects(list(rel), ignore_patterns=ignore)
    ]


def _transient(err: BaseException) -> bool:
    """Worth retrying: network trouble, rate limits and server errors; not auth, 4xx or bad input."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return False
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        return status is None or status == 429 or status >= 500
    if isinstance(err, (ValueError, PermissionError, FileNotFoundError)):
        return False
    # httpx transport errors, timeouts, and the RuntimeError the LFS/xet uploaders wrap them in.
    return isinstance(err, (OSError, RuntimeError, TimeoutError))


def _describe(err: BaseException) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(err, HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        hint = {
            401: "the token is invalid or expired",
            403: "the token has no write access to this repo or namespace",
            404: "the repo or revision does not exist, or the token cannot see it",
        }.get(status, "")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"HTTP {status}{f' ({hint})' if hint else ''}: {first}"
    cause = err.__cause__ or err.__context__
    text = f"{type(err).__name__}: {err}"
    return f"{text} <- {type(cause).__name__}: {cause}" if cause is not None else text


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    path_in_repo: str = "",
    ignore_patterns: list[str] | None = None,
    delete_patterns: list[str] | None = None,
    retries: int = 3,
    backoff_s: float = 10.0,
    dry_run: bool = False,
    endpoint: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    check_export: bool = False,
    force: bool = False,
) -> PushResult:
    """Upload a folder to a hub model repo: create the repo and branch if needed, then upload_folder.

    Args:
        folder: the export folder (or a run folder: pass ``RUN_FOLDER_IGNORE`` to skip checkpoints).
        repo_id: ``namespace/name``.
        token: explicit token; else HF_TOKEN, else the stored login.
        private: visibility of a repo created here (None: the namespace's default); an existing
            repo keeps its visibility.
        revision: branch to push to (created from main when missing); None = main.
        commit_message: the commit's title.
        path_in_repo: folder in the repo to upload into (root by default).
        ignore_patterns: glob patterns of files not to upload.
        delete_patterns: remote files to delete in the same commit (e.g. a previous checkpoint's).
        retries: further attempts after a transient failure (the upload resumes where it stopped).
        backoff_s: wait before the first retry, doubled after each.
        dry_run: list what would be uploaded; no network, no token required.
        endpoint: hub URL; default ``HF_ENDPOINT`` or huggingface.co.
        sleep: the wait function (tests pass a no-op).
        check_export: check, dry run or not, that the files are a verified export (:func:`export_problems`).
        force: push a folder that fails ``check_export`` anyway (its problems are logged and returned).

    Returns:
        What was pushed (or would be, for a dry run).

    Raises:
        HubError: no token, an invalid repo id, an empty folder, a permanent error (auth, not found), or
            transient errors on every attempt. The local folder is left as it was in every case.
    """
    files = upload_plan(folder, ignore_patterns=ignore_patterns, path_in_repo=path_in_repo)
    target = revision or "main"
    problems: list[str] = []
    if check_export:  # the names as in the folder (path_in_repo is where they go in the repo)
        problems = export_problems(
            folder, [f for f, _ in upload_plan(folder, ignore_patterns=ignore_patterns)]
        )
    if problems and not force:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise HubError(
            f"{folder} is not a verified export: {'; '.join(problems[:3])}{more}. Nothing was uploaded: export it "
            "again (`hf-fsdp2 export CHECKPOINT OUT_DIR`), or pass --force to push it as it is"
        )
    for problem in problems:
        logger.warning("pushing anyway (--force): %s", problem)
    if dry_run:
        return PushResult(
            repo_id=repo_id,
            revision=target,
            files=files,
            commit_url=None,
            attempts=0,
            dry_run=True,
            problems=problems,
        )
    if not files:
        raise HubError(f"{folder} holds no file to upload (after ignoring {ignore_patterns or []})")
    value = check_can_push(repo_id, token)
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=value)
    attempts = 0

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        nonlocal attempts
        wait = backoff_s
        for i in range(retries + 1):
            attempts += 1
            try:
                return fn()
            except Exception as err:
                if not _transient(err) or i == retries:
                    raise HubError(
                        f"{what} failed{f' after {i + 1} attempts' if i else ''}: {_describe(err)}. The local "
                        f"folder {folder} is intact; retry with `hf-fsdp2 push {folder} {repo_id}"
                        f"{f' --revision {revision}' if revision else ''}` (the upload resumes)"
                    ) from err
                logger.warning(
                    "%s failed (%s); retrying in %.0fs (%d/%d)", what, _describe(err), wait, i + 1, retries
                )
                sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    attempt(f"creating {repo_id}", lambda: api.create_repo(repo_id, private=private, exist_ok=True))
    if target != "main":
        attempt(f"creating branch {target}", lambda: api.create_branch(repo_id, branch=target, exist_ok=True))
    info = attempt(
        f"uploading {folder} to {repo_id}@{target}",
        lambda: api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            path_in_repo=path_in_repo or None,
            revision=target,
            commit_message=commit_message or f"Upload {Path(folder).name} with hf_fsdp2",
            ignore_patterns=list(ignore_patterns or []),
            delete_patterns=delete_patterns,
        ),
    )
    url = getattr(info, "commit_url", None)
    logger.info(
        "pushed %d files (%.1f MB) to %s@%s: %s",
        len(files),
        sum(n for _, n in files) / 1e6,
        repo_id,
        target,
        url,
    )
    return PushResult(
        repo_id=repo_id,
        revision=target,
        files=files,
        commit_url=url,
        attempts=attempts,
        dry_run=False,
        problems=problems,
    )


def export_problems(folder: str | Path, names: list[str]) -> list[str]:
    """Why the files ``names`` (relative paths) of ``folder`` are not a verified export: what a loader would
    trip on (config, safetensors headers, index: :func:`hf_fsdp2.export.folder.folder_problems`), else the
    export's record of its verification missing, negative or outdated. Reads headers only.

    Returns:
        One message per problem (empty: a verified export whose files are the ones verified).
    """
    from hf_fsdp2.export.folder import folder_problems, record_problem

    root = Path(folder).expanduser()
    problems = folder_problems(root, names)
    if not problems and (problem := record_problem(root, names)):
        problems.append(problem)
    return problems


class CheckpointPusher:
    """Uploads each new complete checkpoint of a run to a branch, in the background, one at a time.

    Rank 0 only. Each upload replaces ``last-checkpoint/`` on the branch (the branch's history keeps
    the earlier ones), so a run can resume from the hub: download the branch, then
    ``--resume_from_checkpoint <download>/last-checkpoint``. Checkpoints already in the run folder
    when it is created (an earlier run's, on resume) are not pushed again.
    """

    def __init__(
        self,
        run_dir: str | Path,
        repo_id: str,
        branch: str,
        *,
        token: str,
        private: bool | None,
        **push_kwargs: Any,
    ) -> None:
        from hf_fsdp2.checkpoint.resume import list_checkpoints

        self.run_dir, self.repo_id, self.branch = Path(run_dir), repo_id, branch
        self.token, self.private, self.push_kwargs = token, private, push_kwargs
        self.pushed = {p.name for p in list_checkpoints(self.run_dir)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_fsdp2-push")
        self._futures: list[tuple[Path, Future[PushResult | None]]] = []

    def push_new(self) -> None:
        """Queue every complete checkpoint of the run not queued yet (call after each save)."""
        from hf_fsdp2.checkpoint.resume import list_checkpoints

        for path in list_checkpoints(self.run_dir):
            if path.name not in self.pushed:
                self.pushed.add(path.name)
                self._futures.append((path, self._pool.submit(self._push, path)))

    def _push(self, checkpoint: Path) -> PushResult | None:
        if not checkpoint.is_dir():
            logger.warning("%s was removed (save_total_limit) before its upload started; skipped", checkpoint)
            return None
        return push_folder(
            checkpoint,
            self.repo_id,
            token=self.token,
            private=self.private,
            revision=self.branch,
            path_in_repo=CHECKPOINT_PATH_IN_REPO,
            delete_patterns=["*"],  # relative to last-checkpoint/: the previous checkpoint's files
            commit_message=f"{checkpoint.name} (hf_fsdp2 sharded checkpoint)",
            **self.push_kwargs,
        )

    def wait(self) -> list[PushResult]:
        """Wait for every queued upload.

        Raises:
            HubError: naming each checkpoint whose upload failed.
        """
        self._pool.shutdown(wait=True)
        done, failed = [], []
        for path, future in self._futures:
            try:
                result = future.result()
                if result is not None:
                    done.append(result)
            except HubError as err:
                failed.append(f"{path.name}: {err}")
        if failed:
            raise HubError("pushing checkpoints failed: " + " | ".join(failed))
        return done
