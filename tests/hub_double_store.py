"""The repository store of HubDouble (the local Hub TEST DOUBLE): files per commit, branches, and the listings
the Hub API returns for them (git blob ids, LFS pointers)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".msgpack", ".onnx", ".h5", ".zip")
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    oid = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n".encode()


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    def oid(self) -> str:
        """What preupload reports: sha256 for LFS files, the git blob sha1 for regular ones (as the Hub
        does)."""
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_sha1(self.data)

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data)}
        if self.lfs:
            pointer = lfs_pointer(self.data)
            entry.update(
                oid=git_blob_sha1(pointer),
                lfs={
                    "oid": hashlib.sha256(self.data).hexdigest(),
                    "size": len(self.data),
                    "pointerSize": len(pointer),
                },
            )
        else:
            entry["oid"] = git_blob_sha1(self.data)
        return entry


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, StoredFile]] = field(default_factory=dict)

    def files_at(self, revision: str) -> dict[str, StoredFile] | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)

    def add_commit(self, branch: str, files: dict[str, StoredFile], summary: str) -> str:
        oid = hashlib.sha1(f"{len(self.commits)}:{branch}:{summary}".encode()).hexdigest()
        self.commits[oid] = files
        self.branches[branch] = oid
        return oid


def tree_listing(files: dict[str, StoredFile], prefix: str, recursive: bool) -> list[dict]:
    base = f"{prefix}/" if prefix else ""
    entries: dict[str, dict] = {}
    for path in sorted(files):
        if not path.startswith(base):
            continue
        rel_parts = path[len(base) :].split("/")
        for depth in range(1, len(rel_parts)):
            folder = base + "/".join(rel_parts[:depth])
            if recursive or depth == 1:
                entries.setdefault(
                    folder,
                    {"type": "directory", "path": folder, "oid": git_blob_sha1(folder.encode()), "size": 0},
                )
        if recursive or len(rel_parts) == 1:
            entries[path] = files[path].tree_entry(path)
    return list(entries.values())
