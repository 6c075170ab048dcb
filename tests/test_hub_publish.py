"""`ascq publish` / `ascq zoo pull` with huggingface_hub against HubDouble, the local TEST DOUBLE of the
Hub."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
from hub_double import HubDouble
from huggingface_hub import ModelCard
from zoo_builder import run, write_w4a16_entry

from ascq.formats.manifest import MANIFEST_NAME, list_entry_files, read_manifest, write_manifest

TOKEN = "hf_TESTDOUBLEsecretTOKEN0123456789"
REPO = "test/x"


@pytest.fixture(scope="module")
def built_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_w4a16_entry(tmp_path_factory.mktemp("built") / "tiny-test-llama-w4a16")


@pytest.fixture
def entry(built_entry: Path, tmp_path: Path) -> Path:
    """A writable copy (publish writes the card into the entry) of a small W4A16 compressed-tensors entry."""
    return Path(shutil.copytree(built_entry, tmp_path / "zoo" / built_entry.name))


@pytest.fixture
def converted(converted_entry, tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of `ascq convert zoo/tiny-llama --recipe w4a16-rtn` (the session's cached
    conversion)."""
    source = converted_entry(tiny_llama_dir, ("w4a16-rtn",))
    return Path(shutil.copytree(source, tmp_path / "zoo" / "tiny-llama-w4a16-rtn"))


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> HubDouble:
    from huggingface_hub import constants

    caplog.set_level(logging.DEBUG)
    with HubDouble(TOKEN) as double:
        monkeypatch.setenv("HF_ENDPOINT", double.endpoint)
        # as in a process started with HF_ENDPOINT set (the library derives these at import)
        monkeypatch.setattr(constants, "ENDPOINT", double.endpoint)
        monkeypatch.setattr(
            constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            double.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        )
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # Xet cannot be doubled: plain LFS path
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "stored_token"))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("ASCQ_ZOO", str(tmp_path / "zoo"))
        yield double


def local_bytes(entry: Path) -> dict[str, bytes]:
    return {rel: (entry / rel).read_bytes() for rel in [*list_entry_files(entry), MANIFEST_NAME]}


def published(hub: HubDouble, entry: Path, revision: str = "main") -> dict[str, bytes]:
    """The remote files, checked to be the entry's own plus the card and the manifest that records it (publish
    stages those two; the entry is never modified)."""
    remote = hub.files(REPO, revision)
    remote.pop(".gitattributes")
    staged = ("README.md", MANIFEST_NAME)
    assert {k: v for k, v in remote.items() if k not in staged} == {
        k: v for k, v in local_bytes(entry).items() if k not in staged
    }
    card = remote["README.md"]
    card_record = {"size": len(card), "sha256": hashlib.sha256(card).hexdigest()}
    assert json.loads(remote[MANIFEST_NAME])["files"] == dict(
        read_manifest(entry)["files"], **{"README.md": card_record}
    )
    return remote


@pytest.mark.slow  # converts tiny-llama (cached for the session, shared with test_convert)
def test_publish_pull_round_trip_of_a_converted_fixture(
    hub: HubDouble,
    converted: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    assert run("publish", str(converted), "--repo", REPO) == 0
    remote = published(hub, converted)  # every file byte-identical, plus the card and its manifest record
    lfs_files = {p for p, f in hub.repos[REPO].files_at("main").items() if f.lfs}
    assert {p for p in remote if p.endswith(".safetensors")} <= lfs_files
    card = ModelCard(remote["README.md"].decode())
    assert card.data.base_model == read_manifest(converted)["base_model"] == "ascq/tiny-llama"
    assert card.data.to_dict()["base_model_relation"] == "quantized"
    assert "| model | perplexity | change vs base |" in card.text

    hub.requests.clear()
    assert run("publish", converted.name, "--repo", REPO) == 0  # by name, from $ASCQ_ZOO
    assert hub.uploads() == []
    assert "0 files uploaded" in capsys.readouterr().out

    fresh = tmp_path / "fresh-zoo"
    monkeypatch.setenv("ASCQ_ZOO", str(fresh))
    assert run("zoo", "pull", REPO) == 0
    assert sorted(p.name for p in fresh.iterdir()) == ["x"]
    assert local_bytes(fresh / "x") == remote
    assert run("zoo", "verify", "x") == 0  # the card is recorded in the manifest
    assert run("zoo", "pull", REPO) == 1  # exists: refused without --overwrite
    assert run("zoo", "pull", REPO, "--overwrite") == 0


def test_publish_uploads_every_file_byte_identical_through_lfs(hub: HubDouble, entry: Path) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    remote = published(hub, entry)
    shards = sorted(p for p in remote if p.endswith(".safetensors"))
    assert sorted(hub.lfs_objects.values(), key=len) == sorted((remote[p] for p in shards), key=len)
    assert ModelCard(remote["README.md"].decode()).data.base_model == "test-org/tiny-test-llama"


def test_second_publish_of_an_unchanged_entry_uploads_nothing(hub: HubDouble, entry: Path) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    hub.requests.clear()
    assert run("publish", str(entry), "--repo", REPO) == 0
    assert hub.uploads() == []
    (entry / "tokenizer.json").write_text((entry / "tokenizer.json").read_text() + " ")
    write_manifest(entry, read_manifest(entry))  # a legitimate change: only it and the manifest go up
    assert run("publish", str(entry), "--repo", REPO) == 0
    commit = [json.loads(line) for line in hub.last_commit_body.decode().splitlines()]
    assert sorted(op["value"]["path"] for op in commit if op["key"] != "header") == [
        "ascq.json",
        "tokenizer.json",
    ]


def test_tampered_entry_is_refused_before_any_request(
    hub: HubDouble, entry: Path, capsys: pytest.CaptureFixture
) -> None:
    shard = entry / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert run("publish", str(entry), "--repo", REPO) == 1
    assert "model-00001-of-00002.safetensors" in capsys.readouterr().err
    assert hub.requests == []


def test_republish_deletes_files_the_entry_no_longer_has(
    hub: HubDouble, entry: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    (entry / "tokenizer_config.json").unlink()
    write_manifest(entry, read_manifest(entry))
    assert run("publish", str(entry), "--repo", REPO) == 0
    assert "tokenizer_config.json" not in hub.files(REPO)
    assert "deleted from the Hub (no longer in the entry): tokenizer_config.json" in capsys.readouterr().out


def test_revision_publishes_to_a_branch_and_pulls_from_it(
    hub: HubDouble, entry: Path, tmp_path: Path
) -> None:
    assert (
        run(
            "publish",
            str(entry),
            "--repo",
            REPO,
            "--revision",
            "w4a16",
            "--private",
            "--commit-message",
            "first",
        )
        == 0
    )
    assert "config.json" in hub.files(REPO, "w4a16")
    assert "config.json" not in hub.files(REPO, "main")
    assert hub.repos[REPO].private
    assert run("zoo", "pull", REPO, "--revision", "w4a16", "--out", str(tmp_path / "from-branch")) == 0
    assert local_bytes(tmp_path / "from-branch") == published(hub, entry, "w4a16")


def test_dry_run_prints_files_sizes_and_card_without_contacting_the_hub(
    hub: HubDouble, entry: Path, capsys: pytest.CaptureFixture
) -> None:
    before = local_bytes(entry)
    assert run("publish", str(entry), "--repo", REPO, "--dry-run") == 0
    out = capsys.readouterr().out
    assert hub.requests == []
    assert local_bytes(entry) == before
    size = (entry / "model-00001-of-00002.safetensors").stat().st_size
    assert f"{size:,d}  model-00001-of-00002.safetensors" in out
    assert "base_model_relation: quantized" in out and "## Quality" in out


def test_token_never_appears_in_output_or_logs(
    hub: HubDouble,
    entry: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    monkeypatch.setenv("ASCQ_ZOO", str(tmp_path / "pulled"))
    assert run("zoo", "pull", REPO) == 0
    monkeypatch.delenv("HF_TOKEN")
    Path(tmp_path / "stored_token").write_text(TOKEN)  # huggingface_hub's stored login
    assert run("publish", str(entry), "--repo", "test/stored-login") == 0
    hub.token = "hf_the_hub_expects_another_token"
    assert run("publish", str(entry), "--repo", "test/rejected") == 1
    out, err = capfd.readouterr()
    assert "401" in err and "HF_TOKEN" in err
    assert "test/stored-login" in hub.repos
    for text in (out, err, caplog.text, *[r.getMessage() for r in caplog.records]):
        assert TOKEN not in text


def test_pull_errors_are_one_clear_line(
    hub: HubDouble, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert run("zoo", "pull", "test/missing") == 1
    assert "repository not found" in capsys.readouterr().err
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: offline
    assert run("zoo", "pull", REPO) == 1
    err = capsys.readouterr().err
    assert "unreachable" in err and err.count("\n") == 1
    assert run("zoo", "pull", "not-a-repo-id") == 1


def test_cli_process_honours_hf_endpoint_and_never_prints_the_token(
    hub: HubDouble, entry: Path, tmp_path: Path
) -> None:
    """A fresh `ascq` process: huggingface_hub reads HF_ENDPOINT / HF_HUB_DISABLE_XET / HF_TOKEN from the
    environment."""
    import os
    import subprocess
    import sys

    env = dict(
        os.environ,
        HF_ENDPOINT=hub.endpoint,
        HF_HUB_DISABLE_XET="1",
        HF_TOKEN=TOKEN,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_VERBOSITY="debug",
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "-m", "ascq.cli", "publish", str(entry), "--repo", "test/from-cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all 8 files match the Hub" in done.stdout
    recorded = json.loads(hub.files("test/from-cli")["ascq.json"])["files"]
    assert set(recorded) == {*read_manifest(entry)["files"], "README.md"}
    assert not (entry / "README.md").exists()  # staged for the upload, never written into the entry
    assert TOKEN not in done.stdout + done.stderr
