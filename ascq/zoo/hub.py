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
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.formats.manifest import (
    MANIFEST_NAME,
    read_manifest,
    resolve_entry,
    sha256_file,
    staged_entry,
    verify_files,
)
from ascq.paths import zoo_root
from ascq.zoo.card import CARD_NAME, HUB_REPO_ID, render_card, write_card
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


def _check_repo_id(repo_id: str) -> None:
    if not HUB_REPO_ID.match(repo_id):
        raise AscqError(f"'{repo_id}' is not a Hub repo id; expected ORG/NAME")


def git_blob_sha1(path: Path) -> str:
    from huggingface_hub.utils import sha

    return sha.git_hash(path.read_bytes())


def local_files(entry_dir: Path) -> dict[str, dict[str, Any]]:
    """Every file publish uploads with size and sha256: the manifest's records (verified just before) and the
    manifest itself."""
    records = dict(read_manifest(entry_dir).get("files") or {})
    path = entry_dir / MANIFEST_NAME
    records[MANIFEST_NAME] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def _same_content(remote: Any, path: Path, record: dict[str, Any]) -> bool:
    """An LFS file is compared by sha256, a regular (small) one by its git blob sha1, both after the size."""
    if remote is None or remote.size != record["size"]:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == record["sha256"]
    return remote.blob_id == git_blob_sha1(path)


def _remote_files(api: Any, repo_id: str, revision: str | None) -> dict[str, Any]:
    from huggingface_hub import RepoFile

    return {
        f.path: f
        for f in api.list_repo_tree(repo_id, recursive=True, revision=revision)
        if isinstance(f, RepoFile)
    }


def compare_remote(entry_dir: Path, remote: dict[str, Any]) -> list[str]:
    """Differences between the entry and the remote listing, one line each (empty: identical)."""
    local = local_files(entry_dir)
    problems = [
        f"{rel}: missing or different on the Hub"
        for rel, record in local.items()
        if not _same_content(remote.get(rel), entry_dir / rel, record)
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
    """Verify, card, upload what changed, compare; returns counts of uploaded / unchanged / deleted files."""
    _check_repo_id(repo_id)
    entry_dir = resolve_entry(entry)
    verify_entry(entry_dir)
    name = read_manifest(entry_dir)["name"]
    if dry_run:
        return _dry_run(entry_dir, repo_id, echo)
    token = _token()
    write_card(entry_dir, repo_id)
    verify_files(entry_dir)
    with _hub_errors(f"publish {name} to {repo_id}"):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

        api = HfApi(endpoint=hub_endpoint(), token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        remote = _remote_files(api, repo_id, revision)
        local = local_files(entry_dir)
        changed = [
            rel
            for rel, record in local.items()
            if not _same_content(remote.get(rel), entry_dir / rel, record)
        ]
        stale = [rel for rel in remote if rel not in local and rel not in KEEP_REMOTE]
        if changed or stale:
            operations = [CommitOperationAdd(rel, str(entry_dir / rel)) for rel in changed]
            operations += [CommitOperationDelete(rel) for rel in stale]
            api.create_commit(
                repo_id,
                operations,
                commit_message=commit_message or f"Upload {name} with ascq",
                revision=revision,
            )
        problems = compare_remote(entry_dir, _remote_files(api, repo_id, revision))
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


def _dry_run(entry_dir: Path, repo_id: str, echo: Callable[[str], None]) -> dict[str, Any]:
    """Print what publish would upload (the card as it would be written) without contacting the Hub."""
    card = render_card(entry_dir, repo_id)
    files = {rel: record["size"] for rel, record in local_files(entry_dir).items()}
    files[CARD_NAME] = len(card.encode())
    echo(
        f"dry run: would publish {entry_dir} to {hub_endpoint()}/{repo_id} (ascq.json's size is before the "
        f"card is "
        "recorded in it)"
    )
    for rel in sorted(files):
        echo(f"  {files[rel]:>14,d}  {rel}")
    echo(f"  {sum(files.values()):>14,d}  total ({len(files)} files)\n")
    echo(card)
    return {"uploaded": 0, "unchanged": 0, "deleted": 0, "files": files}


def pull(
    repo_id: str,
    revision: str | None = None,
    out: str | None = None,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> Path:
    """snapshot_download into the zoo (or `out`), then verify; the entry appears only once verified."""
    _check_repo_id(repo_id)
    target = Path(out) if out else zoo_root() / repo_id.split("/")[1]
    if target.exists() and not force:
        raise AscqError(f"{target} already exists; pass --force to replace it")
    with staged_entry(target) as staging, _hub_errors(f"pull {repo_id}"):
        from huggingface_hub import snapshot_download

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
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = ": check HF_TOKEN or `hf auth login`" if status in (401, 403) else ""
        raise AscqError(
            f"cannot {action}: the Hub answered {status}{hint} ({' '.join(str(exc).split())[:300]})"
        ) from None
