"""Publishing zoo entries to the Hugging Face Hub and pulling them back, through huggingface_hub.

`publish` verifies first and refuses a failing entry before any request, writes the card, uploads only the
files whose content differs from the remote (`create_commit`; large files through the library's own LFS/Xet
mechanism), deletes remote files the entry no longer has, then lists the remote and compares every size and
hash. With hf_xet installed (the default) huggingface_hub uploads large files through Xet;
HF_HUB_DISABLE_XET=1 (the library's own switch) makes it use plain LFS, which is what the tests' local Hub
double implements. The token comes from HF_TOKEN or huggingface_hub's stored login and is only ever handed to
the library; the endpoint is HF_ENDPOINT's, read at call time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.formats.manifest import (
    MANIFEST_NAME,
    check_entry_path,
    check_output,
    entry_file,
    read_manifest,
    resolve_entry,
    sha256_file,
    staged_entry,
    verify_files,
)
from ascq.paths import zoo_root
from ascq.zoo.card import CARD_NAME, HUB_REPO_ID, carded_manifest, manifest_bytes, render_card
from ascq.zoo.verify import verify_entry

KEEP_REMOTE = (".gitattributes",)


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise AscqError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    return token


def check_repo_id(repo_id: str) -> None:
    """ORG/NAME as the Hub accepts it (huggingface_hub's own validation), else one line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        if not HUB_REPO_ID.match(repo_id):
            raise HFValidationError("expected ORG/NAME")
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise AscqError(f"'{repo_id}' is not a Hub repo id ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def git_blob_sha1(path: Path) -> str:
    from huggingface_hub.utils import sha

    return sha.git_hash(path.read_bytes())


@dataclasses.dataclass(frozen=True)
class UploadFile:
    """One file publish uploads: where its bytes are, and its manifest record (size, sha256)."""

    path: Path
    record: dict[str, Any]


def upload_files(entry_dir: Path, repo_id: str, staging: Path) -> dict[str, UploadFile]:
    """Every file publish uploads: the entry's verified files, and the card and the manifest recording it
    written into `staging` (the entry itself is never modified)."""
    card = render_card(entry_dir, repo_id).encode()
    manifest = carded_manifest(entry_dir, card)
    (staging / CARD_NAME).write_bytes(card)
    (staging / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    files = {
        rel: UploadFile(staging / CARD_NAME if rel == CARD_NAME else entry_file(entry_dir, rel), record)
        for rel, record in manifest["files"].items()
    }
    path = staging / MANIFEST_NAME
    files[MANIFEST_NAME] = UploadFile(path, {"size": path.stat().st_size, "sha256": sha256_file(path)})
    return files


def _same_content(remote: Any, file: UploadFile) -> bool:
    """An LFS file is compared by sha256, a regular (small) one by its git blob sha1, both after the size."""
    if remote is None or remote.size != file.record["size"]:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == file.record["sha256"]
    return remote.blob_id == git_blob_sha1(file.path)


def _remote_files(api: Any, repo_id: str, revision: str | None) -> dict[str, Any]:
    from huggingface_hub import RepoFile

    return {
        f.path: f
        for f in api.list_repo_tree(repo_id, recursive=True, revision=revision)
        if isinstance(f, RepoFile)
    }


def compare_remote(local: dict[str, UploadFile], remote: dict[str, Any]) -> list[str]:
    """Differences between the files published and the remote listing, one line each (empty: identical)."""
    problems = [
        f"{rel}: missing or different on the Hub"
        for rel, file in local.items()
        if not _same_content(remote.get(rel), file)
    ]
    problems += [
        f"{rel}: on the Hub but not in the entry"
        for rel in remote
        if rel not in local and rel not in KEEP_REMOTE
    ]
    return problems


def publish(
    entry: str,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    commit_message: str | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Verify, card, upload what changed, compare; returns counts of uploaded / unchanged / deleted files.
    The card and the manifest that records it are staged in a temporary folder: the entry is never
    modified."""
    check_repo_id(repo_id)
    entry_dir = resolve_entry(entry)
    verify_entry(entry_dir)
    name = read_manifest(entry_dir).get("name") or entry_dir.name
    with tempfile.TemporaryDirectory(prefix="ascq-publish-") as staging:
        local = upload_files(entry_dir, repo_id, Path(staging))
        if dry_run:
            return _dry_run(entry_dir, repo_id, local, echo)
        token = _token()
        verify_files(entry_dir)  # unchanged since verify_entry, as the upload reads it
        with _hub_errors(f"publish {name} to {repo_id}"):
            from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

            api = HfApi(endpoint=hub_endpoint(), token=token)
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            if revision and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            remote = _remote_files(api, repo_id, revision)
            changed = [rel for rel, file in local.items() if not _same_content(remote.get(rel), file)]
            stale = [rel for rel in remote if rel not in local and rel not in KEEP_REMOTE]
            if changed or stale:
                operations = [CommitOperationAdd(rel, str(local[rel].path)) for rel in changed]
                operations += [CommitOperationDelete(rel) for rel in stale]
                api.create_commit(
                    repo_id,
                    operations,
                    commit_message=commit_message or f"Upload {name} with ascq",
                    revision=revision,
                )
            problems = compare_remote(local, _remote_files(api, repo_id, revision))
    if problems:
        raise AscqError(f"after upload the Hub copy of {name} differs: {problems[0]}")
    result = {"uploaded": len(changed), "unchanged": len(local) - len(changed), "deleted": len(stale)}
    for rel in stale:
        echo(f"deleted from the Hub (no longer in the entry): {rel}")
    echo(
        f"published {name} to {hub_endpoint()}/{repo_id} (revision {revision or 'main'}): "
        f"{result['uploaded']} files "
        f"uploaded, {result['unchanged']} unchanged, {result['deleted']} deleted; all {len(local)} files "
        f"match the Hub"
    )
    return result


def _dry_run(
    entry_dir: Path, repo_id: str, local: dict[str, UploadFile], echo: Callable[[str], None]
) -> dict[str, Any]:
    """Print what publish would upload (the card as it would be written) without contacting the Hub."""
    files = {rel: file.record["size"] for rel, file in local.items()}
    echo(f"dry run: would publish {entry_dir} to {hub_endpoint()}/{repo_id}")
    for rel in sorted(files):
        echo(f"  {files[rel]:>14,d}  {rel}")
    echo(f"  {sum(files.values()):>14,d}  total ({len(files)} files)\n")
    echo(local[CARD_NAME].path.read_text())
    return {"uploaded": 0, "unchanged": 0, "deleted": 0, "files": files}


def pull(
    repo_id: str,
    revision: str | None = None,
    out: str | None = None,
    overwrite: bool = False,
    echo: Callable[[str], None] = print,
) -> Path:
    """snapshot_download into the zoo (or `out`), then verify; the entry appears only once verified. `out`
    passes the output check of every folder-writing command (`check_output`) before any download."""
    check_repo_id(repo_id)
    target = Path(out) if out else zoo_root() / repo_id.split("/")[1]
    check_output(target, overwrite=overwrite)
    with staged_entry(target, overwrite=overwrite) as staging, _hub_errors(f"pull {repo_id}"):
        from huggingface_hub import HfApi, snapshot_download

        for rel in HfApi(endpoint=hub_endpoint()).list_repo_files(repo_id, revision=revision):
            if rel not in (MANIFEST_NAME, *KEEP_REMOTE):  # a hostile endpoint's names, before any download
                check_entry_path(rel, f"{repo_id} on the Hub")
        snapshot_download(
            repo_id,
            revision=revision,
            local_dir=staging,
            endpoint=hub_endpoint(),
            ignore_patterns=list(KEEP_REMOTE),
        )
        shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping
        if not (staging / MANIFEST_NAME).is_file():
            raise AscqError(f"{repo_id} is not an ascq zoo entry: it has no {MANIFEST_NAME}")
        try:
            checks = verify_entry(staging)
        except AscqError as exc:
            raise AscqError(f"pulled {repo_id} does not verify: {exc}") from None
    echo(f"pulled {repo_id} into {target}; verified: " + "; ".join(checks))
    return target


@contextlib.contextmanager
def _hub_errors(action: str) -> Iterator[None]:
    """Turn huggingface_hub/httpx failures into one-line AscqErrors (no token is ever part of them)."""
    import httpx
    from huggingface_hub import errors

    endpoint = hub_endpoint()
    try:
        yield
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, httpx.TransportError):
        raise AscqError(f"cannot {action}: the Hub at {endpoint} is unreachable (offline?)") from None
    except errors.RevisionNotFoundError:
        raise AscqError(f"cannot {action}: revision not found") from None
    except errors.RepositoryNotFoundError:
        raise AscqError(
            f"cannot {action}: repository not found at {endpoint}, or the token has no access"
        ) from None
    except (errors.HFValidationError, errors.EntryNotFoundError) as exc:
        raise AscqError(f"cannot {action}: {_first_line(exc)}") from None
    except ConnectionError as exc:  # hf_xet's transfers (Rust) raise the builtin one
        hint = (
            "; the endpoint does not offer Xet storage: HF_HUB_DISABLE_XET=1 uploads through plain LFS"
            if "xet" in str(exc).lower()
            else ""
        )
        raise AscqError(f"cannot {action}: {_first_line(exc)}{hint}") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = ": check HF_TOKEN or `hf auth login`" if status in (401, 403) else ""
        raise AscqError(
            f"cannot {action}: the Hub answered {status}{hint} ({' '.join(str(exc).split())[:300]})"
        ) from None
