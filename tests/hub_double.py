"""HubDouble: a TEST DOUBLE of the Hugging Face Hub HTTP API, served on 127.0.0.1 for publish/pull tests.

It implements the endpoints huggingface_hub 1.x calls for `create_repo`, `create_branch`, `create_commit`
(preupload, LFS batch + basic single-part PUT + verify, the ndjson commit), `list_repo_tree`,
`get_paths_info`, `repo_info` and `hf_hub_download`/`snapshot_download` (HEAD/GET resolve). Xet storage (the
default upload path when `hf_xet` is installed) runs in Rust against a CAS service and cannot be doubled here,
so tests set huggingface_hub's own switch `HF_HUB_DISABLE_XET`, which makes the library take the plain LFS
path; downloads take the plain HTTP path because the double sends no `X-Xet-Hash` header. Every request is
recorded (method, path) without its headers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml
from hub_double_store import GITATTRIBUTES, LFS_MIN_SIZE, LFS_SUFFIXES, Repo, StoredFile, tree_listing

UPLOAD_MARKERS = ("/preupload/", "/info/lfs/objects/batch", "/commit/")


class HubDouble:
    """In-memory Hub: repos, branches, commits, an LFS object store, and a log of every request received."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.last_commit_body = b""
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubDouble:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def uploads(self) -> list[tuple[str, str]]:
        """Requests that carry file content or samples, or create a commit (preupload, LFS batch/PUT,
        commit)."""
        return [r for r in self.requests if r[0] == "PUT" or any(m in r[1] for m in UPLOAD_MARKERS)]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return {p: f.data for p, f in self.repos[repo_id].files_at(revision).items()}


def _make_handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # the request log is `hub.requests`
            pass

        def do_GET(self) -> None:
            self._dispatch()

        do_HEAD = do_POST = do_PUT = do_GET

        # ---- plumbing ----------------------------------------------------------------------------------

        def _dispatch(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            self.query = parse_qs(url.query)
            self.body = self._read_body()
            with hub.lock:
                hub.requests.append((self.command, url.path))
                try:
                    self._route(parts)
                except (KeyError, ValueError) as exc:  # a request the real Hub would also reject
                    self._error(400, f"test double: malformed request: {exc!r}")

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _authorized(self) -> bool:
            return self.headers.get("Authorization") == f"Bearer {hub.token}"

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload: object, status: int = 200) -> None:
            self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        def _error(self, status: int, message: str, code: str | None = None) -> None:
            self._send(
                status,
                json.dumps({"error": message}).encode(),
                {"Content-Type": "application/json", **({"X-Error-Code": code} if code else {})},
            )

        def _repo(self, repo_id: str, write: bool = False) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if write and not self._authorized():
                self._error(401, "Invalid credentials in Authorization header")
                return None
            if repo is None or (repo.private and not self._authorized()):
                self._error(404, f"Repository {repo_id} not found", "RepoNotFound")
                return None
            return repo

        def _files(self, repo: Repo, revision: str) -> dict[str, StoredFile] | None:
            files = repo.files_at(revision)
            if files is None:
                self._error(404, f"Revision {revision} not found", "RevisionNotFound")
            return files

        # ---- routes ------------------------------------------------------------------------------------

        def _route(self, parts: list[str]) -> None:
            method = self.command
            if parts == ["api", "repos", "create"] and method == "POST":
                return self._create_repo()
            if parts == ["api", "validate-yaml"] and method == "POST":
                return self._validate_yaml()
            if parts[:1] == ["lfs-upload"] and method == "PUT":
                return self._lfs_put(parts[1])
            if parts == ["lfs-verify"] and method == "POST":
                oid = json.loads(self.body)["oid"]
                return self._json({}) if oid in hub.lfs_objects else self._error(404, "object not found")
            if (
                len(parts) == 6
                and parts[1].endswith(".git")
                and parts[2:] == ["info", "lfs", "objects", "batch"]
            ):
                return self._lfs_batch(f"{parts[0]}/{parts[1][:-4]}")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id, action, rest = (
                    f"{parts[2]}/{parts[3]}",
                    parts[4] if len(parts) > 4 else "",
                    parts[5:],
                )
                return self._model_api(repo_id, action, rest)
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
            self._error(404, f"test double: no route for {method} {self.path}")

        def _model_api(self, repo_id: str, action: str, rest: list[str]) -> None:
            write = action in ("preupload", "commit", "branch")
            if (repo := self._repo(repo_id, write=write)) is None:
                return
            revision = rest[0] if rest else "main"
            if action == "branch":
                if revision in repo.branches:
                    return self._error(409, f"Branch {revision} already exists")
                repo.branches[revision] = repo.branches["main"]
                return self._json({})
            if action == "xet-write-token":
                return self._error(501, "test double: Xet storage is not doubled; set HF_HUB_DISABLE_XET=1")
            if (files := self._files(repo, revision)) is None:
                return
            if action in ("", "revision"):
                return self._json(
                    {
                        "id": repo_id,
                        "sha": repo.branches.get(revision, revision),
                        "private": repo.private,
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                    }
                )
            if action == "tree":
                return self._json(
                    tree_listing(
                        files, "/".join(rest[1:]), self.query.get("recursive", ["false"])[0] == "true"
                    )
                )
            if action == "paths-info":
                paths = parse_qs(self.body.decode()).get("paths", [])
                return self._json([files[p].tree_entry(p) for p in paths if p in files])
            if action == "preupload":
                return self._json(
                    {"files": [self._upload_mode(f, files) for f in json.loads(self.body)["files"]]}
                )
            if action == "commit":
                return self._commit(repo_id, repo, revision, files)
            self._error(404, f"test double: no route for {self.command} {self.path}")

        def _create_repo(self) -> None:
            if not self._authorized():
                return self._error(401, "Invalid credentials in Authorization header")
            payload = json.loads(self.body)
            repo_id = (
                f"{payload['organization']}/{payload['name']}"
                if payload.get("organization")
                else payload["name"]
            )
            if repo_id in hub.repos:  # the Hub's 409 carries the url, which create_repo(exist_ok=True) reads
                return self._json(
                    {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo_id}"}, 409
                )
            repo = hub.repos[repo_id] = Repo(
                private=payload.get("visibility", "public") != "public" or bool(payload.get("private"))
            )
            repo.add_commit(
                "main", {".gitattributes": StoredFile(GITATTRIBUTES, lfs=False)}, "initial commit"
            )
            self._json({"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})

        def _validate_yaml(self) -> None:
            content = json.loads(self.body)["content"]
            errors = []
            if content.startswith("---\n"):
                try:
                    metadata = yaml.safe_load(content[4:].split("\n---\n", 1)[0])
                    if not isinstance(metadata, dict):
                        errors.append({"message": "metadata must be a YAML mapping"})
                except yaml.YAMLError as exc:
                    errors.append({"message": f"invalid YAML: {exc}"})
            self._json({"errors": errors, "warnings": []}, status=400 if errors else 200)

        def _upload_mode(self, request: dict, files: dict[str, StoredFile]) -> dict:
            lfs = request["path"].endswith(LFS_SUFFIXES) or request["size"] >= LFS_MIN_SIZE
            remote = files.get(request["path"])
            return {
                "path": request["path"],
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": False,
                "oid": remote.oid() if remote else None,
            }

        def _lfs_batch(self, repo_id: str) -> None:
            if self._repo(repo_id, write=True) is None:
                return
            objects = []
            for obj in json.loads(self.body)["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs_objects:
                    entry["actions"] = {
                        "upload": {"href": f"{hub.endpoint}/lfs-upload/{obj['oid']}"},
                        "verify": {"href": f"{hub.endpoint}/lfs-verify"},
                    }
                objects.append(entry)
            self._json({"transfer": "basic", "objects": objects})

        def _lfs_put(self, oid: str) -> None:
            if hashlib.sha256(self.body).hexdigest() != oid:
                return self._error(400, "uploaded content does not match its sha256 oid")
            hub.lfs_objects[oid] = self.body
            self._send(200)

        def _commit(self, repo_id: str, repo: Repo, branch: str, files: dict[str, StoredFile]) -> None:
            hub.last_commit_body = self.body
            lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
            new_files, summary = dict(files), ""
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    summary = value["summary"]
                elif key == "file":
                    new_files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
                elif key == "lfsFile":
                    if value["oid"] not in hub.lfs_objects:
                        return self._error(400, f"LFS object {value['oid']} was never uploaded")
                    new_files[value["path"]] = StoredFile(hub.lfs_objects[value["oid"]], lfs=True)
                elif key == "deletedFile":
                    new_files.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    new_files = {p: f for p, f in new_files.items() if not p.startswith(prefix)}
            oid = repo.add_commit(branch, new_files, summary)
            self._json(
                {
                    "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}",
                    "commitOid": oid,
                    "pullRequestUrl": None,
                }
            )

        def _resolve(self, repo_id: str, revision: str, path: str) -> None:
            if (repo := self._repo(repo_id)) is None or (files := self._files(repo, revision)) is None:
                return
            if path not in files:
                return self._error(404, f"Entry {path} not found", "EntryNotFound")
            stored = files[path]
            self._send(
                200,
                stored.data,
                {
                    "X-Repo-Commit": repo.branches.get(revision, revision),
                    "ETag": f'"{stored.oid()}"',
                    "Content-Type": "application/octet-stream",
                },
            )

    return Handler
