"""Pushing to a hub, tested against huggingface_hub's real client (HfApi, upload_folder, its httpx
transport) talking over real HTTP to a local fake hub on 127.0.0.1 (HF_ENDPOINT / endpoint=).

The fake hub implements the endpoints an upload uses: repo and branch creation, README metadata
validation, preupload (upload modes and remote oids, which make re-uploads resume), the git-LFS batch
API and the upload it points to, tree listing, and the ndjson commit. It stores what arrives, so tests
compare the bytes on the "hub" with the local files. Failures are injected per path (HTTP status N
times). It also stands in for Xet storage, which hf_xet (installed with huggingface_hub) uses for
LFS-mode files: the write-token endpoint, the CAS's global-dedup query, xorb upload and the NDJSON
shard upload; the test decodes the uploaded xorbs (uncompressed chunks of random data) back into the
file's bytes. Not emulated: the CAS's xorb upload grants (the client's documented
HF_XET_CLIENT_LEGACY_DIRECT_XORB_UPLOAD=1 switch uses the direct xorb upload instead), compressed
chunks, and the CAS validating a shard against its xorbs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest
import yaml
from huggingface_hub import constants as hub_constants

from hf_fsdp2.export.card import render_model_card
from hf_fsdp2.export.hub import (
    RUN_FOLDER_IGNORE,
    CheckpointPusher,
    HubError,
    check_can_push,
    push_folder,
    resolve_token,
    upload_plan,
)

TOKEN = "hf_test_write_token"
REPO = "tester/tiny-sft"


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """A minimal hub: repos with branches of files, LFS objects, commits, and failure injection."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.failures: list[list[Any]] = []  # [method, path regex, status, remaining]
        self.upload_mode = "auto"  # "auto": lfs for *.safetensors and files >= 1 MB; "regular": all regular
        self.xorbs: list[bytes] = []  # Xet storage: xorbs in upload order
        self.shards: list[bytes] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, "GET")

            def do_POST(self) -> None:
                hub.handle(self, "POST")

            def do_PUT(self) -> None:
                hub.handle(self, "PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, method: str, path_regex: str, status: int, times: int) -> None:
        self.failures.append([method, path_regex, status, times])

    def files(self, repo: str = REPO, branch: str = "main") -> dict[str, bytes]:
        return self.repos[repo]["branches"][branch]

    # ---- HTTP plumbing
    @staticmethod
    def _body(req: BaseHTTPRequestHandler) -> bytes:
        if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(req.rfile.readline().strip(), 16)
                if size == 0:
                    req.rfile.readline()
                    return out
                out += req.rfile.read(size)
                req.rfile.readline()
        return req.rfile.read(int(req.headers.get("Content-Length") or 0))

    @staticmethod
    def _send(
        req: BaseHTTPRequestHandler, status: int, body: Any = None, headers: dict | None = None
    ) -> None:
        data = json.dumps(body if body is not None else {}).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(data)

    def handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        path = urlparse(req.path).path
        body = self._body(req)
        self.requests.append((method, path))
        for failure in self.failures:
            if failure[0] == method and failure[3] > 0 and re.search(failure[1], path):
                failure[3] -= 1
                return self._send(req, failure[2], {"error": "injected failure"})
        if path.startswith("/_lfs/"):
            oid = path.rsplit("/", 1)[1]
            if hashlib.sha256(body).hexdigest() != oid:
                return self._send(req, 400, {"error": "sha256 mismatch"})
            self.lfs[oid] = body
            return self._send(req, 200)
        if path.startswith("/cas/") or path == "/v1/telemetry":
            return self.xet_storage(req, method, path, body)
        if req.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._send(req, 401, {"error": "Invalid credentials in Authorization header"})
        routes = [
            ("POST", r"^/api/repos/create$", self.create_repo),
            ("POST", r"^/api/validate-yaml$", self.validate_yaml),
            ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>.+)$", self.create_branch),
            ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>.+)$", self.preupload),
            ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>.+)$", self.commit),
            ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?P<sub>/.*)?$", self.tree),
            ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>.+)$", self.revision),
            ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/xet-write-token/(?P<rev>.+)$", self.xet_token),
            ("POST", r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$", self.lfs_batch),
        ]
        for verb, pattern, fn in routes:
            match = re.match(pattern, path)
            if verb == method and match:
                params = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
                status, answer = fn(json.loads(body) if body and "commit" not in path else body, **params)
                return self._send(req, status, answer)
        return self._send(req, 404, {"error": f"no route {method} {path}"})

    # ---- Xet storage (CAS), as hf_xet's client speaks to it
    def xet_token(self, payload: Any, repo: str, rev: str) -> tuple[int, Any]:
        return 200, {"casUrl": f"{self.url}/cas", "accessToken": "xet-write", "exp": 4102444800}

    def xet_storage(self, req: BaseHTTPRequestHandler, method: str, path: str, body: bytes) -> None:
        if path == "/v1/telemetry":
            return self._send(req, 200, {})
        if req.headers.get("authorization") != "Bearer xet-write":
            return self._send(req, 401, {"error": "bad xet token"})
        if method == "GET" and path.startswith("/cas/v1/chunks/"):
            return self._send(req, 404, {"error": "no global dedup match"})
        if method == "POST" and path.startswith("/cas/v1/xorbs/"):
            self.xorbs.append(body)
            return self._send(req, 200, {"was_inserted": True})
        if method == "POST" and path == "/cas/v2/shards":
            self.shards.append(body)
            frames = b'{"type":"validating","verified":1,"total":1}\n{"type":"result"}\n'
            req.send_response(200)
            req.send_header("Content-Type", "application/x-ndjson")
            req.send_header("Content-Length", str(len(frames)))
            req.end_headers()
            req.wfile.write(frames)
            return None
        return self._send(req, 404, {"error": f"no CAS route {method} {path}"})

    def xorb_payload(self) -> bytes:
        """The chunk data of every uploaded xorb, in order (uncompressed chunks only)."""
        out = b""
        for xorb in self.xorbs:
            i = 0
            while i + 8 <= len(xorb):
                version, csize, scheme = xorb[i], int.from_bytes(xorb[i + 1 : i + 4], "little"), xorb[i + 4]
                usize = int.from_bytes(xorb[i + 5 : i + 8], "little")
                if version != 0 or scheme != 0 or csize != usize or i + 8 + csize > len(xorb):
                    break  # the footer (or a compressed chunk, which this fake does not decode)
                out += xorb[i + 8 : i + 8 + csize]
                i += 8 + csize
        return out

    # ---- endpoints
    def _repo(self, repo: str) -> dict[str, Any] | None:
        return self.repos.get(repo)

    def create_repo(self, payload: dict) -> tuple[int, Any]:
        repo = (
            f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        )
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
        self.repos[repo] = {"visibility": payload.get("visibility"), "branches": {"main": {}}, "commits": []}
        return 200, {"url": f"{self.url}/{repo}"}

    def validate_yaml(self, payload: dict) -> tuple[int, Any]:
        content = payload["content"]
        try:
            meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": str(err)}]}
        return (
            (200, {"errors": [], "warnings": []})
            if isinstance(meta, dict)
            else (400, {"errors": [{"message": "bad"}]})
        )

    def create_branch(self, payload: dict, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo)
        if r is None:
            return 404, {"error": "Repository not found"}
        if rev in r["branches"]:
            return 409, {"error": "Reference already exists"}
        r["branches"][rev] = dict(r["branches"]["main"])
        return 200, {}

    def _mode(self, path: str, size: int) -> str:
        if self.upload_mode == "regular":
            return "regular"
        return "lfs" if path.endswith(".safetensors") or size >= 2**20 else "regular"

    def preupload(self, payload: dict, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo)
        if r is None:
            return 404, {"error": "Repository not found"}
        if rev not in r["branches"]:
            return 404, {"error": "Revision not found"}
        files = []
        for f in payload["files"]:
            mode = self._mode(f["path"], f["size"])
            have = r["branches"][rev].get(f["path"])
            oid = None
            if have is not None:
                oid = hashlib.sha256(have).hexdigest() if mode == "lfs" else git_oid(have)
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return 200, {"files": files}

    def lfs_batch(self, payload: dict, repo: str) -> tuple[int, Any]:
        objects = []
        for obj in payload["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.lfs:
                entry["actions"] = {"upload": {"href": f"{self.url}/_lfs/{obj['oid']}", "header": {}}}
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}

    def tree(self, payload: Any, repo: str, rev: str, sub: str | None) -> tuple[int, Any]:
        r = self._repo(repo)
        if r is None or rev not in r["branches"]:
            return 404, {"error": "not found"}
        prefix = (sub or "").strip("/")
        entries = [
            {"type": "file", "path": p, "size": len(d), "oid": git_oid(d)}
            for p, d in sorted(r["branches"][rev].items())
            if not prefix or p.startswith(prefix + "/")
        ]
        return 200, entries

    def revision(self, payload: Any, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo)
        if r is None or rev not in r["branches"]:
            return 404, {"error": "not found"}
        sha = r["commits"][-1]["oid"] if r["commits"] else "0" * 40
        return 200, {"id": repo, "sha": sha, "siblings": [{"rfilename": p} for p in r["branches"][rev]]}

    def commit(self, body: bytes, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo)
        if r is None:
            return 404, {"error": "Repository not found"}
        if rev not in r["branches"]:
            return 404, {"error": f"Invalid rev id: {rev}"}
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        files = dict(r["branches"][rev])
        header = lines[0]["value"]
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] in self.lfs:
                    files[value["path"]] = self.lfs[value["oid"]]
                elif self.shards:  # uploaded through Xet storage: the test checks the xorbs
                    files[value["path"]] = b"xet:" + value["oid"].encode()
                else:
                    return 422, {"error": f"LFS object {value['oid']} was never uploaded"}
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
        r["branches"][rev] = files
        oid = hashlib.sha1(f"{repo}{rev}{len(r['commits'])}".encode()).hexdigest()
        r["commits"].append({"oid": oid, "branch": rev, "summary": header["summary"], "paths": sorted(files)})
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    server = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)  # scripts/test.sh sets HF_HUB_OFFLINE=1
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)  # LFS files through git-LFS, see top
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login-token"))
    monkeypatch.setattr("time.sleep", lambda s: None)  # the library's own backoff between retries
    yield server
    server.close()


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    """An export-like folder: weights (LFS), config, tokenizer, a card; plus run files to skip."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.safetensors").write_bytes(os.urandom(300_000))
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "tokenizer.json").write_bytes(os.urandom(1_200_000))  # >= 1 MB: LFS on this hub
    (out / "README.md").write_text("---\nlibrary_name: transformers\n---\n# tiny\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    ckpt = out / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"shard")
    (ckpt / ".metadata").write_bytes(b"meta")
    (out / "latest").write_text("5\n")
    (out / ".export-incomplete").mkdir()
    (out / ".export-incomplete" / "x.safetensors").write_bytes(b"partial")
    return out


EXPORT_FILES = ["README.md", "config.json", "metrics.jsonl", "model.safetensors", "tokenizer.json"]


def local(folder: Path, names: list[str]) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in names}


# ---------------------------------------------------------------------------------------------------
# Pushing a folder
# ---------------------------------------------------------------------------------------------------


def test_push_creates_the_repo_and_branch_and_uploads_every_file(hub: FakeHub, export_dir: Path) -> None:
    result = push_folder(
        export_dir,
        REPO,
        private=True,
        revision="v1",
        commit_message="first",
        ignore_patterns=RUN_FOLDER_IGNORE,
        endpoint=hub.url,
        backoff_s=0,
    )
    assert hub.repos[REPO]["visibility"] == "private"
    assert hub.files(branch="v1") == local(export_dir, EXPORT_FILES)  # checkpoints, dotfiles skipped
    assert hub.files(branch="main") == {}
    assert hub.repos[REPO]["commits"][-1]["summary"] == "first"
    assert sorted(p for p, _ in result.files) == EXPORT_FILES and result.attempts == 3  # repo, branch, upload
    assert result.commit_url and result.commit_url.startswith(hub.url)
    assert set(hub.lfs.values()) == {
        (export_dir / "model.safetensors").read_bytes(),
        (export_dir / "tokenizer.json").read_bytes(),
    }
    assert ("POST", f"/api/models/{REPO}/preupload/v1") in hub.requests


def test_push_to_an_existing_repo_updates_files_and_keeps_its_visibility(
    hub: FakeHub, export_dir: Path
) -> None:
    push_folder(export_dir, REPO, private=True, ignore_patterns=RUN_FOLDER_IGNORE, endpoint=hub.url)
    (export_dir / "config.json").write_text('{"model_type": "llama", "v": 2}')
    push_folder(export_dir, REPO, private=False, ignore_patterns=RUN_FOLDER_IGNORE, endpoint=hub.url)
    assert hub.repos[REPO]["visibility"] == "private"
    assert hub.files()["config.json"] == b'{"model_type": "llama", "v": 2}'
    assert len(hub.repos[REPO]["commits"]) == 2


def test_the_resumable_multi_commit_pipeline_with_hf_xet_installed(
    hub: FakeHub, export_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("hf_xet")
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", False)
    hub.upload_mode = "regular"  # no Xet storage here: every file goes inline in the commits
    from huggingface_hub import _upload_pipeline

    monkeypatch.setattr(_upload_pipeline, "INITIAL_COMMIT_SIZE_INDEX", 0)  # 20 files per commit
    for i in range(45):
        (export_dir / f"extra-{i:02d}.json").write_text(json.dumps({"i": i}))
    # The first commit attempt fails five times (the library retries it), so the call fails once and
    # the second call resumes: what was committed is skipped by oid.
    hub.fail("POST", r"/commit/main$", 503, 6)
    result = push_folder(export_dir, REPO, ignore_patterns=RUN_FOLDER_IGNORE, endpoint=hub.url, backoff_s=0)
    names = EXPORT_FILES + [f"extra-{i:02d}.json" for i in range(45)]
    assert hub.files() == local(export_dir, names)
    summaries = [c["summary"] for c in hub.repos[REPO]["commits"]]
    assert len(summaries) >= 3 and summaries[1].endswith("(part 2)")  # several commits, one call
    assert result.attempts >= 3


def test_a_transient_failure_is_retried_and_the_upload_completes(hub: FakeHub, export_dir: Path) -> None:
    hub.fail("POST", r"/commit/main$", 503, 2)
    result = push_folder(export_dir, REPO, ignore_patterns=RUN_FOLDER_IGNORE, endpoint=hub.url, backoff_s=0)
    assert result.attempts == 1 + 3  # create_repo, then the upload three times
    assert hub.files() == local(export_dir, EXPORT_FILES)


def test_a_failed_upload_is_a_clear_error_and_the_local_folder_stays_intact(
    hub: FakeHub, export_dir: Path
) -> None:
    before = {p: p.read_bytes() for p in sorted(export_dir.rglob("*")) if p.is_file()}
    hub.fail("PUT", r"^/_lfs/", 500, 10**6)
    waits: list[float] = []
    with pytest.raises(HubError) as err:
        push_folder(
            export_dir,
            REPO,
            ignore_patterns=RUN_FOLDER_IGNORE,
            endpoint=hub.url,
            retries=2,
            backoff_s=5,
            sleep=waits.append,
        )
    message = str(err.value)
    assert f"uploading {export_dir} to {REPO}@main failed after 3 attempts" in message
    assert "is intact" in message and f"hf-fsdp2 push {export_dir} {REPO}" in message
    assert waits == [5, 10]  # exponential backoff between attempts
    assert {p: p.read_bytes() for p in sorted(export_dir.rglob("*")) if p.is_file()} == before
    assert hub.files() == {}


def test_a_bad_token_is_not_retried(hub: FakeHub, export_dir: Path) -> None:
    with pytest.raises(HubError, match=r"HTTP 401 \(the token is invalid or expired\)") as err:
        push_folder(export_dir, REPO, token="hf_wrong", endpoint=hub.url, backoff_s=0)
    assert "after" not in str(err.value).split(":")[0]  # one attempt
    assert hub.requests.count(("POST", "/api/repos/create")) == 1 and hub.repos == {}


def test_no_token_is_an_error_before_any_request(
    hub: FakeHub, export_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(HubError, match="needs a token with write access.*HF_TOKEN.*hf auth login"):
        push_folder(export_dir, REPO, endpoint=hub.url)
    with pytest.raises(HubError, match="needs a token"):
        check_can_push(REPO)
    assert hub.requests == []


def test_token_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert resolve_token("hf_arg") == ("hf_arg", "argument")
    assert resolve_token() == ("hf_env", "HF_TOKEN")
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "token").write_text("hf_stored\n")  # what `hf auth login` writes
    assert resolve_token() == ("hf_stored", "login")


def test_offline_mode_and_bad_repo_ids_are_refused_before_any_request(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(HubError, match="not a valid repo id"):
        check_can_push("not a repo id!")
    with pytest.raises(HubError, match="needs a repo id"):
        check_can_push(None)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1"):
        check_can_push(REPO)
    assert hub.requests == []


def test_dry_run_lists_the_files_without_network_or_token(
    hub: FakeHub, export_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    result = push_folder(export_dir, REPO, ignore_patterns=RUN_FOLDER_IGNORE, dry_run=True, endpoint=hub.url)
    assert result.dry_run and result.commit_url is None and result.attempts == 0
    assert result.files == [(n, (export_dir / n).stat().st_size) for n in EXPORT_FILES]
    assert hub.requests == []
    assert upload_plan(export_dir, path_in_repo="sub") == [
        (f"sub/{p.relative_to(export_dir).as_posix()}", p.stat().st_size)
        for p in sorted(export_dir.rglob("*"))
        if p.is_file()
    ]  # without the run-folder patterns, everything (the library still skips .git and .cache/huggingface)


# ---------------------------------------------------------------------------------------------------
# Intermediate checkpoints to a branch
# ---------------------------------------------------------------------------------------------------


def make_checkpoint(run: Path, step: int, payload: bytes) -> Path:
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(payload)
    (path / f"only-in-{step}.txt").write_text(str(step))
    (path / ".metadata").write_bytes(b"meta%d" % step)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_checkpoints_are_pushed_to_a_branch_each_replacing_the_last(hub: FakeHub, tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_checkpoint(run, 1, b"earlier run")  # there before: not pushed again
    pusher = CheckpointPusher(
        run, REPO, "checkpoints", token=TOKEN, private=True, endpoint=hub.url, backoff_s=0
    )
    make_checkpoint(run, 2, os.urandom(2**20 + 5))  # >= 1 MB: an LFS upload
    pusher.push_new()
    pusher.push_new()  # nothing new: nothing queued
    make_checkpoint(run, 4, b"four")
    pusher.push_new()
    results = pusher.wait()
    assert [r.revision for r in results] == ["checkpoints", "checkpoints"]
    files = hub.files(branch="checkpoints")
    assert files == {
        "last-checkpoint/__0_0.distcp": b"four",
        "last-checkpoint/only-in-4.txt": b"4",  # checkpoint-2's own file was deleted
        "last-checkpoint/.metadata": b"meta4",
        "last-checkpoint/trainer_state.json": json.dumps({"step": 4}).encode(),
    }
    assert [c["summary"] for c in hub.repos[REPO]["commits"]] == [
        "checkpoint-2 (hf_fsdp2 sharded checkpoint)",
        "checkpoint-4 (hf_fsdp2 sharded checkpoint)",
    ]
    assert hub.files(branch="main") == {}


def test_a_failed_checkpoint_push_is_reported_at_the_end(hub: FakeHub, tmp_path: Path) -> None:
    run = tmp_path / "run"
    pusher = CheckpointPusher(
        run, REPO, "checkpoints", token=TOKEN, private=None, endpoint=hub.url, backoff_s=0
    )
    make_checkpoint(run, 3, b"x")
    hub.fail("POST", r"/commit/checkpoints$", 500, 10**6)
    pusher.push_new()
    with pytest.raises(HubError, match="pushing checkpoints failed: checkpoint-3: uploading"):
        pusher.wait()


# ---------------------------------------------------------------------------------------------------
# The command line, in a fresh process, pointed at the fake hub with HF_ENDPOINT
# ---------------------------------------------------------------------------------------------------


def cli_env(hub: FakeHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env.update(extra)
    return env


def run_cli(args: list[str], env: dict[str, str]):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "hf_fsdp2.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_push_and_dry_run(hub: FakeHub, export_dir: Path, tmp_path: Path) -> None:
    env = cli_env(hub, tmp_path)
    dry = run_cli(["push", str(export_dir), REPO, "--dry-run", "--force"], dict(env, HF_TOKEN=""))
    assert dry.returncode == 0, dry.stderr
    summary = json.loads(dry.stdout.strip().splitlines()[-1])
    assert summary["paths"] == EXPORT_FILES and summary["dry_run"] and summary["token"] is None
    assert "would upload model.safetensors (300000 bytes)" in dry.stderr
    assert hub.requests == []
    proc = run_cli(
        [
            "push",
            str(export_dir),
            REPO,
            "--public",
            "--revision",
            "release",
            "--commit-message",
            "v1 weights",
            "--force",  # the fixture's weights are random bytes (test_command_inputs.py checks the refusal)
        ],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["files"] == 5 and summary["revision"] == "release"
    assert hub.files(branch="release") == local(export_dir, EXPORT_FILES)
    assert (
        hub.repos[REPO]["visibility"] == "public"
        and hub.repos[REPO]["commits"][-1]["summary"] == "v1 weights"
    )


def test_cli_push_imports_neither_torch_nor_transformers(
    hub: FakeHub, export_dir: Path, tmp_path: Path
) -> None:
    """Pushing a folder is an upload: ``hf-fsdp2 push`` starts in a fraction of a second, not after ~3 s of
    torch and transformers imports (the package ``__init__`` files load their names on first use)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom hf_fsdp2.cli import main\nstatus = main(sys.argv[1:])\n"
        "print(status, sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "push", str(export_dir), REPO, "--dry-run", "--force"],
        capture_output=True,
        text=True,
        env=dict(cli_env(hub, tmp_path), HF_TOKEN=""),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout


def test_cli_push_through_xet_storage(hub: FakeHub, tmp_path: Path) -> None:
    """The path every real push of weights takes: hf_xet chunks the file and uploads xorbs and a shard."""
    pytest.importorskip("hf_xet")
    folder = tmp_path / "export"
    folder.mkdir()
    weights = os.urandom(300_000)  # random: stored uncompressed, so the fake can read the xorbs back
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text("{}")
    env = cli_env(hub, tmp_path, HF_HUB_DISABLE_XET="0", HF_XET_CLIENT_LEGACY_DIRECT_XORB_UPLOAD="1")
    proc = run_cli(["push", str(folder), REPO, "--force"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sha = hashlib.sha256(weights).hexdigest()
    assert hub.files()["model.safetensors"] == b"xet:" + sha.encode()  # committed by its sha256
    assert hub.files()["config.json"] == b"{}"  # regular file, inline in the commit
    assert hub.lfs == {} and hub.shards  # no git-LFS upload: Xet storage only
    assert hub.xorb_payload() == weights
    assert ("GET", f"/api/models/{REPO}/xet-write-token/main") in hub.requests


def test_cli_push_errors_are_one_clear_line(hub: FakeHub, export_dir: Path, tmp_path: Path) -> None:
    no_token = run_cli(["push", str(export_dir), REPO, "--force"], cli_env(hub, tmp_path, HF_TOKEN=""))
    assert no_token.returncode == 2
    assert (
        no_token.stderr.strip()
        .splitlines()[-1]
        .startswith("hf-fsdp2 push: error: pushing to the hub needs a token")
    )
    hub.fail("POST", r"/commit/main$", 500, 10**6)
    failed = run_cli(["push", str(export_dir), REPO, "--retries", "0", "--force"], cli_env(hub, tmp_path))
    assert failed.returncode == 2 and "is intact" in failed.stderr and "HTTP 500" in failed.stderr
    assert (export_dir / "model.safetensors").stat().st_size == 300_000


# ---------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_model_card_with_hub_ids() -> None:
    cfg = {
        "model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dataset_name": "HuggingFaceH4/ultrachat_200k",
        "learning_rate": 2e-05,
        "max_steps": 100,
        "export_dtype": "bfloat16",
        "hub_token": "hf_SECRET",
        "output_dir": "/runs/a",
    }
    card = render_model_card(
        cfg,
        metrics={"step": 100, "loss": 1.234567891},
        world_size=8,
        repo_id="me/smol-sft",
        recipe_title="supervised fine-tuning",
    )
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["datasets"] == ["HuggingFaceH4/ultrachat_200k"]
    assert meta["library_name"] == "transformers" and "hf_fsdp2" in meta["tags"]
    assert "# smol-sft" in card and "on 8 ranks" in card and "recipes/sft.py" in card
    assert "| learning_rate | `2e-05` |" in card and "| loss | 1.23457 |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/smol-sft")' in card
    assert "hf_SECRET" not in card and "hub_token" not in card
    assert "sft" in meta["tags"] and "(supervised fine-tuning, FSDP2 on 8 ranks)" in card
    dpo = render_model_card(cfg, metrics=None, recipe="dpo", recipe_title="preference optimisation")
    assert "recipes/dpo.py` (preference optimisation" in dpo and "dpo" in front_matter(dpo)["tags"]
    rm = render_model_card(cfg, metrics=None, recipe="rm", recipe_title="reward modelling", reward=True)
    assert "reward-model" in front_matter(rm)["tags"] and "(reward modelling" in rm
    assert "AutoModelForSequenceClassification.from_pretrained" in rm and "generate" not in rm


def test_model_card_with_local_paths_and_no_metrics(tmp_path: Path) -> None:
    cfg = {"model_name_or_path": str(tmp_path), "dataset_name": "data/train.jsonl", "output_dir": "/runs/b"}
    card = render_model_card(cfg, metrics=None)
    meta = front_matter(card)
    assert "base_model" not in meta and "datasets" not in meta  # the hub would reject local paths
    assert str(tmp_path) in card and "No metrics were recorded." in card and "# b" in card


def test_run_folder_ignore_patterns_skip_checkpoints_and_staging(export_dir: Path) -> None:
    plan = [p for p, _ in upload_plan(export_dir, ignore_patterns=RUN_FOLDER_IGNORE)]
    assert plan == EXPORT_FILES
    shutil.rmtree(export_dir / "checkpoint-5")


def test_run_folder_ignore_patterns_skip_traces_tracker_logs_and_debug_dumps(export_dir: Path) -> None:
    for extra in ("profile/rank0.pt.trace.json", "tensorboard/run/events.out.tfevents.1", "debug/rank0_fr"):
        (export_dir / extra).parent.mkdir(parents=True, exist_ok=True)
        (export_dir / extra).write_text("x")
    plan = [p for p, _ in upload_plan(export_dir, ignore_patterns=RUN_FOLDER_IGNORE)]
    assert plan == EXPORT_FILES


# ---------------------------------------------------------------------------------------------------
# The recipe: push at the end of training, checkpoints to a branch, and the token checked first
# ---------------------------------------------------------------------------------------------------


def recipe_args(tmp_path: Path, **overrides: object) -> list[str]:
    from support.tiny import make_tiny_llama_dir, write_chat_jsonl

    model = make_tiny_llama_dir(tmp_path / "model", seed=6)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=2)
    values: dict[str, object] = {
        "model_name_or_path": model,
        "dataset_name": data,
        "output_dir": tmp_path / "run",
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "max_length": 48,
        "learning_rate": 1e-3,
        "push_to_hub": "true",
        "hub_model_id": REPO,
    }
    values.update(overrides)
    return [f"--{k}={v}" for k, v in values.items()]


def run_recipe(args: list[str], env: dict[str, str]):
    import subprocess
    import sys

    from support.launch import REPO as ROOT
    from support.launch import SFT

    env = dict(env, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, str(SFT), *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_recipe_without_a_token_stops_before_any_work(hub: FakeHub, tmp_path: Path) -> None:
    proc = run_recipe(recipe_args(tmp_path), cli_env(hub, tmp_path, HF_TOKEN=""))
    assert proc.returncode == 2
    assert "hf_fsdp2 error: pushing to the hub needs a token" in proc.stderr
    assert not (tmp_path / "run").exists() and hub.requests == []


@pytest.mark.slow
def test_recipe_pushes_the_export_and_its_checkpoints(hub: FakeHub, tmp_path: Path) -> None:
    args = recipe_args(
        tmp_path, save_steps=1, push_checkpoints_to_branch="checkpoints", hub_private_repo="true"
    )
    proc = run_recipe(args + [f"--hub_token={TOKEN}"], cli_env(hub, tmp_path, HF_TOKEN=""))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    main = hub.files()
    expected = sorted(
        p.name for p in run.iterdir() if p.is_file() and p.name != "latest" and p.name[0] != "."
    )
    assert sorted(main) == expected and {"model.safetensors", "README.md", "metrics.jsonl"} <= set(main)
    assert not any(p.startswith("checkpoint-") for p in main)
    for name in expected:
        assert main[name] == (run / name).read_bytes(), name
    assert f'from_pretrained("{REPO}")' in main["README.md"].decode()
    assert hub.repos[REPO]["visibility"] == "private"
    assert hub.repos[REPO]["commits"][-1]["summary"] == "hf_fsdp2 sft: 2 steps"
    # Both checkpoints went to the branch in turn; it ends with the last one.
    branch = hub.files(branch="checkpoints")
    assert (
        branch["last-checkpoint/trainer_state.json"]
        == (run / "checkpoint-2" / "trainer_state.json").read_bytes()
    )
    assert "last-checkpoint/.metadata" in branch
    summaries = [c["summary"] for c in hub.repos[REPO]["commits"] if c["branch"] == "checkpoints"]
    assert summaries == [
        "checkpoint-1 (hf_fsdp2 sharded checkpoint)",
        "checkpoint-2 (hf_fsdp2 sharded checkpoint)",
    ]
    # The token never reaches the disk.
    for path in run.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
