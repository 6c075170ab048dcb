"""Zoo entry manifest (`ascq.json`): what an entry is, where it came from, and a sha256 of every file.

An entry is written into a staging folder beside its target and renamed into place only once complete
(`staged_entry`), so an interrupted write never leaves a folder that `verify_files` accepts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ascq.errors import AscqError
from ascq.paths import zoo_root

MANIFEST_NAME = "ascq.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_entry_files(entry_dir: Path) -> list[str]:
    """Relative paths of every file in an entry except the manifest itself, sorted."""
    return sorted(
        p.relative_to(entry_dir).as_posix()
        for p in entry_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")
    )


def file_records(entry_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        rel: {"size": (entry_dir / rel).stat().st_size, "sha256": sha256_file(entry_dir / rel)}
        for rel in list_entry_files(entry_dir)
    }


def new_manifest(name: str, **fields: Any) -> dict[str, Any]:
    """A manifest dict with the standard keys; `fields` fills or overrides them.

    Standard keys: name, source ({"model", "revision"}), base_model, license, format ("hf", "compressed-tensors",
    "msmodelslim"), scheme, recipe ({"names", "text"} or None), calibration ({"dataset", "num_samples", "seq_len"}
    or None), metrics ({"perplexity", "perplexity_base", "unigram_perplexity", "eval_text", "num_eval_tokens"}),
    conversion ({"seconds", "peak_rss_bytes"}), files (filled by `write_manifest`).
    """
    from ascq import __version__

    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "name": name,
        "source": None,
        "base_model": None,
        "license": None,
        "format": "hf",
        "scheme": None,
        "recipe": None,
        "calibration": None,
        "metrics": {},
        "conversion": None,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "ascq_version": __version__,
        "files": {},
    }
    manifest.update(fields)
    return manifest


def write_manifest(entry_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in `entry_dir` into `manifest["files"]` and write `ascq.json`."""
    manifest = dict(manifest, files=file_records(entry_dir))
    (entry_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(entry_dir: Path) -> dict[str, Any]:
    path = Path(entry_dir) / MANIFEST_NAME
    if not path.is_file():
        raise AscqError(f"{entry_dir} is not a zoo entry: {MANIFEST_NAME} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AscqError(f"{path} is not valid JSON: {exc}") from None


def verify_files(entry_dir: Path, manifest: dict[str, Any] | None = None) -> None:
    """Raise AscqError naming the first file that is missing, extra, or whose size or sha256 differs."""
    entry_dir = Path(entry_dir)
    manifest = manifest or read_manifest(entry_dir)
    expected = manifest.get("files") or {}
    for rel, record in expected.items():
        path = entry_dir / rel
        if not path.is_file():
            raise AscqError(f"{entry_dir.name}: file {rel} is listed in the manifest but missing")
        if path.stat().st_size != record["size"]:
            raise AscqError(f"{entry_dir.name}: file {rel} has size {path.stat().st_size}, manifest says {record['size']}")
        if sha256_file(path) != record["sha256"]:
            raise AscqError(f"{entry_dir.name}: file {rel} has a different sha256 than the manifest")
    extra = sorted(set(list_entry_files(entry_dir)) - set(expected))
    if extra:
        raise AscqError(f"{entry_dir.name}: file {extra[0]} is not listed in the manifest")


def resolve_entry(name_or_path: str | os.PathLike) -> Path:
    """A zoo entry given by path (`zoo/x`, `/any/folder`) or by name (`x`, looked up in the zoo root)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    candidate = zoo_root() / str(name_or_path)
    if candidate.is_dir():
        return candidate
    raise AscqError(f"no zoo entry '{name_or_path}': not a folder, and not in the zoo at {zoo_root()}")


@contextlib.contextmanager
def staged_entry(target: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a staging folder beside `target`; on success it replaces `target` by rename, on error it is deleted.

    The caller writes every file, then calls `write_manifest` on the staging folder, inside the block.
    """
    target = Path(target)
    if target.exists() and not overwrite:
        raise AscqError(f"{target} already exists; pass --overwrite to replace it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes 0700; an entry gets normal folder permissions
    except OSError as exc:
        raise AscqError(f"cannot write to {target.parent}: {exc.strerror or exc}") from None
    try:
        yield staging
        if not (staging / MANIFEST_NAME).is_file():
            raise AssertionError("staged_entry: write_manifest was not called before the block ended")
        _normal_permissions(staging)
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _normal_permissions(folder: Path) -> None:
    """Files 0644 and folders 0755 (less the umask): some writers (safetensors, mkstemp) create 0600."""
    umask = _current_umask()
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _replace_dir(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)
