"""Zoo entry manifest (`ascq.json`): what an entry is, where it came from, and a sha256 of every file.

An entry is written into a staging folder beside its target and renamed into place only once complete
(`staged_entry`), so an interrupted write never leaves a folder that `verify_files` accepts.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.paths import zoo_root

log = logging.getLogger(__name__)
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

    Standard keys: name, source ({"model", "revision"}), base_model, license, format ("hf",
    "compressed-tensors", "msmodelslim"), scheme, recipe ({"names", "text"} or None), calibration ({"dataset",
    "num_samples", "seq_len"} or None), metrics ({"perplexity", "perplexity_base", "unigram_perplexity",
    "eval_text", "num_eval_tokens"}), conversion ({"seconds", "peak_rss_bytes"}), files (filled by
    `write_manifest`).
    """
    from ascq.core.version import __version__

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
    """The entry's manifest, checked to be well formed (`check_manifest`): an untrusted file (a pulled entry,
    a copied folder) never reaches the code that uses it otherwise."""
    path = Path(entry_dir) / MANIFEST_NAME
    if not path.is_file():
        raise AscqError(f"{entry_dir} is not a zoo entry: {MANIFEST_NAME} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise AscqError(f"{path} is not valid JSON: {why}") from None
    check_manifest(manifest, path)
    return manifest


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
SECTIONS = ("source", "recipe", "calibration", "metrics", "conversion", "planned", "synthetic")
NUMERIC_METRICS = ("perplexity", "perplexity_base", "unigram_perplexity", "num_eval_tokens")


def check_manifest(manifest: Any, where: str | os.PathLike) -> None:
    """Raise a one-line AscqError unless `manifest` is an object with a string `name`, whose sections are
    objects (metrics numbers) and whose `files` (if present) maps entry paths (`check_entry_path`) to records
    with an integer `size` and a hex `sha256`."""
    if not isinstance(manifest, dict):
        raise AscqError(f"{where}: the manifest is not a JSON object")
    if not isinstance(manifest.get("name"), str) or not manifest["name"]:
        raise AscqError(f"{where}: the manifest's name is missing or not a string")
    for section in SECTIONS:
        if not isinstance(manifest.get(section) or {}, dict):
            raise AscqError(f"{where}: the manifest's {section} is not an object")
    for key, value in (manifest.get("metrics") or {}).items():
        if key in NUMERIC_METRICS and value is not None and not isinstance(value, int | float):
            raise AscqError(f"{where}: the manifest's metrics.{key} is not a number")
    files = manifest.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise AscqError(f"{where}: the manifest's files is not an object of path -> {{size, sha256}}")
    for rel, record in files.items():
        check_entry_path(rel, where)
        if not isinstance(record, dict):
            raise AscqError(f"{where}: the record of file {rel} is not an object")
        size, digest = record.get("size"), record.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise AscqError(f"{where}: file {rel} has no valid size (a non-negative integer)")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise AscqError(f"{where}: file {rel} has no valid sha256 (64 hex digits)")


def check_entry_path(rel: Any, where: str | os.PathLike) -> None:
    """A manifest's file path must be relative, normalised (`a/b`, no `.`, `..`, `//` or backslash) and not
    the manifest itself: it names a file inside the entry, never one outside it."""
    text = rel if isinstance(rel, str) else ""
    if (
        not text
        or "\\" in text
        or "\0" in text
        or posixpath.isabs(text)
        or posixpath.normpath(text) != text
        or text.split("/", 1)[0] in (".", "..")
        or text == MANIFEST_NAME
    ):
        raise AscqError(
            f"{where}: file path {rel!r} is not a normalised path relative to the entry (refusing it)"
        )


def entry_file(entry_dir: Path, rel: str) -> Path:
    """`entry_dir / rel` for a manifest path, refused when it (through a symbolic link) leaves the entry."""
    check_entry_path(rel, Path(entry_dir) / MANIFEST_NAME)
    path = Path(entry_dir) / rel
    if not path.resolve().is_relative_to(Path(entry_dir).resolve()):
        raise AscqError(f"{Path(entry_dir).name}: file {rel} leads outside the entry (a symbolic link)")
    return path


def verify_files(entry_dir: Path, manifest: dict[str, Any] | None = None) -> None:
    """Raise AscqError naming the first file that is missing, extra, outside the entry, or whose size or
    sha256 differs."""
    entry_dir = Path(entry_dir)
    manifest = manifest or read_manifest(entry_dir)
    check_manifest(manifest, entry_dir / MANIFEST_NAME)
    expected = manifest.get("files") or {}
    for rel, record in expected.items():
        path = entry_file(entry_dir, rel)
        if not path.is_file():
            raise AscqError(f"{entry_dir.name}: file {rel} is listed in the manifest but missing")
        if path.stat().st_size != record["size"]:
            raise AscqError(
                f"{entry_dir.name}: file {rel} has size {path.stat().st_size}, manifest says {record['size']}"
            )
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


# `.NAME.staging-PID-xxxx` (being written), `.NAME.old-PID-xxxx` (being replaced)
STAGING_TAGS = (
    "staging",
    "old",
)


def check_output(target: Path, sources: Sequence[Path] = (), overwrite: bool = False) -> None:
    """Refuse an output folder that would destroy a user's data, before any work is done: the one check of
    every command that writes a folder (convert, zoo pull, zoo import-gguf, zoo dummy; publish stages in a
    fresh temporary folder).

    Never a source folder, one that contains a source or one inside a source (even with --overwrite); an
    existing path only with --overwrite, and then only a zoo entry (a folder with ascq.json) or an empty
    folder. A planned entry (config and plan, no weights: `is_planned_entry`) is what its own printed convert
    command fills, so it is replaced without --overwrite.
    """
    resolved = Path(target).resolve()
    for source in sources:
        source = Path(source).resolve()
        if resolved == source or resolved in source.parents:
            raise AscqError(
                f"--out {target} is the source model folder or contains it; choose another folder"
            )
        if source in resolved.parents:
            raise AscqError(
                f"--out {target} is inside the source model folder {source.name}; choose another folder"
            )
    if not os.path.lexists(target):
        return
    if not Path(target).is_dir() or Path(target).is_symlink():
        raise AscqError(f"{target} exists and is not a folder; refusing to replace it")
    if not (Path(target) / MANIFEST_NAME).is_file() and any(Path(target).iterdir()):
        raise AscqError(
            f"{target} is not a zoo entry (no {MANIFEST_NAME}); refusing to replace it, even with --overwrite"
        )
    if not overwrite and not is_planned_entry(Path(target)):
        raise AscqError(f"{target} already exists; pass --overwrite to replace it")


def is_planned_entry(entry_dir: Path) -> bool:
    """A zoo entry that only plans its weights: a manifest with a `planned` section and no safetensors."""
    try:
        manifest = read_manifest(entry_dir)
    except AscqError:
        return False
    files = manifest.get("files") or {}
    return bool(manifest.get("planned")) and not any(rel.endswith(".safetensors") for rel in files)


class Terminated(BaseException):
    """SIGTERM arrived while an entry was being written (exit status 143 after cleanup)."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside the block (main thread only) SIGTERM raises `Terminated` and SIGINT `KeyboardInterrupt`, also
    when the signal lands inside a C extension's Python callback (safetensors' get_tensor), where the error
    would otherwise surface as another one (a ValueError): cleanup code runs and the CLI prints its one line.
    A SIGINT the process was started with ignored (`nohup`, `&`) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    signums = [signal.SIGTERM] + (
        [signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else []
    )
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    except (Terminated, KeyboardInterrupt):
        raise
    except BaseException as exc:
        if received:  # raised inside a C extension's callback: the first signal decides
            raise (Terminated() if received[0] == signal.SIGTERM else KeyboardInterrupt()) from exc
        raise
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)


def resolve_local_model(name_or_path: str | os.PathLike) -> Path:
    """A model folder to serve or generate from: a path, or a zoo entry name (`missing_model` otherwise)."""
    text = str(name_or_path)
    if Path(text).is_dir():
        return Path(text)
    if (zoo_root() / text).is_dir():
        return zoo_root() / text
    raise missing_model(text)


def looks_like_hub_id(text: str) -> bool:
    """ORG/NAME that is not meant as a local path: one slash, no leading `.`, `/` or `~`, and ORG is not a
    local folder (`zoo/nope` is a missing zoo entry, not a Hub repo)."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).parent.is_dir()


def missing_model(text: str) -> AscqError:
    """The one error for a model that is neither a folder nor a zoo entry (generate, serve, convert); a Hub
    id gets the command that fetches it."""
    hint = (
        f"; if it is a Hub repo, fetch it first: ascq zoo pull {text} (an ascq entry) or "
        f"`hf download {text} --local-dir DIR`"
        if looks_like_hub_id(text)
        else ""
    )
    return AscqError(
        f"model {text} does not exist: not a folder, and not an entry in the zoo at {zoo_root()}{hint}"
    )


@contextlib.contextmanager
def staged_entry(target: Path, overwrite: bool = True, sources: Sequence[Path] = ()) -> Iterator[Path]:
    """Yield a staging folder beside `target`; on success it replaces `target` atomically, on error (Ctrl-C
    and SIGTERM included) it is deleted. A staging folder that a killed process left behind is removed first.
    `target` passes `check_output` (with `sources` and `overwrite`) first, and again just before the rename.

    The caller writes every file, then calls `write_manifest` on the staging folder, inside the block.
    """
    target = Path(target)
    check_output(target, sources, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target.parent, target.name)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-{os.getpid()}-", dir=target.parent))
        # mkdtemp makes 0700; an entry gets normal folder permissions
        os.chmod(staging, 0o777 & ~_current_umask())
    except OSError as exc:
        raise AscqError(f"cannot write to {target.parent}: {exc.strerror or exc}") from None
    try:
        with signals_raise():
            yield staging
            if not (staging / MANIFEST_NAME).is_file():
                raise AssertionError("staged_entry: write_manifest was not called before the block ended")
            _normal_permissions(staging)
            check_output(target, sources, overwrite)  # a folder that appeared while this one was written
            _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def stale_staging(folder: Path, name: str | None = None) -> list[Path]:
    """Staging / replaced-entry folders in `folder` (for entry `name`, or any) whose writing process is
    gone."""
    found = []
    for tag in STAGING_TAGS:
        for path in sorted(Path(folder).glob(f".{name or '*'}.{tag}-*")):
            pid = path.name.rsplit(f".{tag}-", 1)[1].split("-", 1)[0]
            if path.is_dir() and not (pid.isdigit() and _alive(int(pid))):
                found.append(path)
    return found


def remove_stale_staging(folder: Path, name: str | None = None) -> list[Path]:
    """Delete what `stale_staging` finds, naming each on stderr; returns them."""
    removed = stale_staging(folder, name)
    for path in removed:
        log.warning("removing %s, left by an interrupted write", path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _current_umask() -> int:
    """The process's file mode mask, read without changing it (os.umask would, for every thread, for a
    moment): Linux reports it in /proc/self/status; elsewhere a probe file created with mode 0o777 shows
    it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory(prefix="ascq-umask-") as folder:
        probe = Path(folder) / "probe"
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o777))
        return 0o777 & ~probe.stat().st_mode


def _normal_permissions(folder: Path) -> None:
    """Files 0644 and folders 0755 (less the umask): some writers (safetensors, mkstemp) create 0600."""
    umask = _current_umask()
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing `target` is swapped out in one atomic exchange where the
    kernel offers it (Linux renameat2), else by two renames (the old entry stays intact until the new one is
    in place)."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old entry
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def group_size_fit_text(fit: dict[str, Any]) -> str:
    """What a config group's group size became and why, and why its zero points are floats if they are, from
    its manifest record (`GroupSizeFit.record`): the one text the convert log, the convert summary and the
    model card show."""
    texts = [zero_point_text(fit)] if fit.get("zp_dtype") else []
    if fit["group_size"] == fit["recipe_group_size"]:  # recorded for its zero points only
        return "; ".join(texts)
    if fit.get("source_block_size") and fit["group_size"] == fit["source_block_size"]:
        why = (
            f"the source checkpoint was quantized in GGUF blocks of {fit['source_block_size']} columns, "
            f"which "
            "4-bit groups spanning two blocks cannot represent"
        )
    else:
        why = f"it does not divide every input width ({', '.join(map(str, fit['in_features']))})"
    result = (
        f"group size {fit['group_size']}" if fit["group_size"] else "per-channel where it does not divide"
    )
    return "; ".join([f"{result} instead of the recipe's {fit['recipe_group_size']}: {why}", *texts])


def zero_point_text(fit: dict[str, Any]) -> str:
    """Why a config group's zero points are floats (`zp_dtype`) and who can load them, from its fit record."""
    why = (
        f"the source's GGUF blocks of {fit['source_block_size']} columns each have a float minimum, which an "
        "integer zero point cannot represent"
        if fit.get("zp_dtype_from") == "source"
        else "the recipe's zp_dtype"
    )
    return (
        f"{fit['zp_dtype']} zero points ({why}); stored unpacked (compressed-tensors naive-quantized, int8 "
        "weights): transformers and ascq load it, vLLM's int4 kernels cannot (set zp_dtype: int for a "
        "pack-quantized checkpoint they can)"
    )
