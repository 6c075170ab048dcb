"""Hostile files and folders (issue 45): GGUF and safetensors headers that lie about their sizes, manifests
whose paths leave the entry or whose records are malformed, Hub names the Hub refuses, a publish to an
endpoint without Xet, output folders holding a user's files (every folder-writing command), publish leaving
its source entry untouched, the kernel cache's permissions, and the process umask. Real gguf / safetensors /
huggingface_hub libraries; the Hub is HubDouble on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_double import HubDouble
from hub_double_store import Repo, StoredFile
from safetensors.torch import save_file
from test_hub_publish import REPO, local_bytes
from test_hub_publish import hub as hub  # noqa: F401  (the fixture)
from zoo_builder import run, write_dense_entry

from ascq.core.errors import AscqError
from ascq.formats import manifest as manifest_module
from ascq.formats.manifest import MANIFEST_NAME, read_manifest, staged_entry, write_manifest
from ascq.formats.safetensors import CheckpointReader
from ascq.zoo.gguf_header import check_gguf_header

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_entry(tmp_path_factory.mktemp("built") / "tiny-test-llama")


@pytest.fixture
def entry(dense: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dense, tmp_path / "zoo" / dense.name))


def one_line_error(capsys: pytest.CaptureFixture, code: int) -> str:
    """The command's one `error: ` line, its last on stderr (huggingface_hub's progress bars may come
    before it), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line.rsplit("\r", 1)[-1] for line in err.splitlines()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


# ---- GGUF ------------------------------------------------------------------------------------------------


def gguf_array_bomb(path: Path) -> Path:
    """100 bytes: a GGUF v3 header with one key whose uint8 array declares 2^62 items."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    data += struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 1 << 62)
    path.write_bytes(data.ljust(100, b"\0"))
    return path


def test_gguf_array_count_of_2_pow_62_is_refused_in_one_line_within_1_s_and_200_mib(tmp_path: Path) -> None:
    """In a fresh process (capped at 2 GiB more address space than it had, so a regression cannot take the
    host's memory): import-gguf of the 100-byte file raises the one-line error; the time and the growth of
    the peak RSS over the call are measured there."""
    bomb = gguf_array_bomb(tmp_path / "bomb.gguf")
    script = f"""
import resource, time
from ascq.core.errors import AscqError
from ascq.zoo.gguf_import import import_gguf
import gguf  # what the call uses, imported before the measurement starts
def vm_bytes():
    return int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (2 << 30), resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    import_gguf({str(bomb)!r}, zoo={str(tmp_path / "zoo")!r})
    print("ACCEPTED")
except AscqError as exc:
    print("ERROR", str(exc))
print("SECONDS", time.perf_counter() - start)
print("GROWTH_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert "declared" in lines["ERROR"] and "bomb.gguf is not a readable GGUF file" in lines["ERROR"]
    assert "\n" not in lines["ERROR"]
    assert float(lines["SECONDS"]) < 1.0
    assert int(lines["GROWTH_KIB"]) * 1024 < 200 * MIB
    assert not (tmp_path / "zoo").exists()


def test_gguf_bomb_through_the_cli_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bomb = gguf_array_bomb(tmp_path / "bomb.gguf")
    err = one_line_error(capsys, run("zoo", "import-gguf", str(bomb), "--zoo", str(tmp_path / "zoo")))
    assert "bomb.gguf is not a readable GGUF file" in err


def write_real_gguf(path: Path) -> Path:
    """A GGUF written by gguf's own writer: scalars, a string, string and int arrays, an alignment, and
    tensors of a float and a block-quantized type."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_string("general.name", "hostile-test")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", ""])
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5, 3.5])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    q8 = np.zeros((2, 34), dtype=np.uint8)  # two Q8_0 blocks of 32 values, 34 bytes each
    writer.add_tensor("q", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header_check_accepts_what_gguf_writes_and_refuses_every_truncation(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = write_real_gguf(tmp_path / "real.gguf")
    check_gguf_header(path)
    reader = GGUFReader(path)  # the library reads it too: the check is no stricter than the format
    assert [t.name for t in reader.tensors] == ["w", "q"]
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)  # then padding
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in [*range(0, data_end, 7), data_end - 1]:
        cut.write_bytes(data[:size])
        with pytest.raises(AscqError, match="cut.gguf is not a readable GGUF file"):
            check_gguf_header(cut)
    cut.write_bytes(data[:data_end])
    check_gguf_header(cut)


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "version 1"),
        (lambda d: d[:8] + struct.pack("<Q", 1 << 40) + d[16:], "tensor"),
        (lambda d: d[:16] + struct.pack("<Q", 1 << 40) + d[24:], "key/value"),
        (lambda d: b"GGUG" + d[4:], "does not start with GGUF"),
    ],
)
def test_gguf_header_fields_that_lie_are_refused(tmp_path: Path, patch, message: str) -> None:
    data = write_real_gguf(tmp_path / "real.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch(data))
    with pytest.raises(AscqError, match=message):
        check_gguf_header(bad)


def test_gguf_tensor_data_past_the_end_is_refused(tmp_path: Path) -> None:
    data = write_real_gguf(tmp_path / "real.gguf").read_bytes()
    bad = tmp_path / "short.gguf"
    bad.write_bytes(data[: 512 + 68 - 1])  # the header is whole; the last tensor's data (68 bytes at 512) not
    with pytest.raises(AscqError, match="tensor q's data .* lies outside the file"):
        check_gguf_header(bad)


# ---- safetensors -----------------------------------------------------------------------------------------


def write_shard(folder: Path, header: dict | bytes, data: bytes = b"") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return folder


def test_safetensors_header_claiming_more_bytes_than_the_file_is_one_line_fast(tmp_path: Path) -> None:
    import resource
    import time

    folder = write_shard(
        tmp_path / "big",
        {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 1 << 42]}},
        b"\0" * 16,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(AscqError, match="model.safetensors is truncated or corrupted") as info:
        CheckpointReader(folder)
    assert time.perf_counter() - start < 1.0
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 200 * MIB
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "header, data, message",
    [
        (b"[" * 200_000 + b"]" * 200_000, b"", "nested too deeply"),
        (struct.pack("<Q", 1) * 0 + b"\xff\xfe", b"", "not a valid safetensors file"),
        (b"[1, 2]", b"", "not a JSON object"),
        ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "do not span"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "invalid data offsets"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": "x"}}, b"\0" * 4, "invalid data offsets"),
        ({"w": "x"}, b"", "no known dtype"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlap or leave gaps",
        ),
    ],
)
def test_malformed_safetensors_headers_are_one_line(
    tmp_path: Path, header: dict | bytes, data: bytes, message: str
) -> None:
    folder = write_shard(tmp_path / "bad", header, data)
    with pytest.raises(AscqError, match=message) as info:
        CheckpointReader(folder)
    assert "\n" not in str(info.value)


def test_an_entry_with_a_lying_shard_header_is_one_line_in_every_command(
    entry: Path, capsys: pytest.CaptureFixture
) -> None:
    shard = entry / "model.safetensors"
    data = bytearray(shard.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [1 << 40, 1 << 20]
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data[8 + header_len :]))
    write_manifest(entry, read_manifest(entry))  # the manifest matches: only the header lies
    for argv in (["zoo", "verify", str(entry)], ["zoo", "card", str(entry)], ["zoo", "show", str(entry)]):
        code = run(*argv)
        if argv[1] == "show":  # show reads only the manifest
            assert code == 0
            continue
        assert "model.safetensors is not a valid safetensors file" in one_line_error(capsys, code), argv


def test_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "len"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(AscqError, match="header length .* exceeds the file"):
        CheckpointReader(folder)


def test_headers_the_library_writes_still_read(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.zeros(0, 4),
        "c": torch.ones(7, dtype=torch.bfloat16),
        "d": torch.ones(2, dtype=torch.int8),
    }
    tmp_path.joinpath("ok").mkdir()
    save_file(tensors, tmp_path / "ok" / "model.safetensors", metadata={"format": "pt"})
    reader = CheckpointReader(tmp_path / "ok")
    assert sorted(reader) == ["a", "b", "c", "d"]
    assert torch.equal(reader.get("a"), tensors["a"])


# ---- manifests -------------------------------------------------------------------------------------------


def rewrite_manifest(entry: Path, edit) -> None:
    manifest = json.loads((entry / MANIFEST_NAME).read_text())
    edit(manifest)
    (entry / MANIFEST_NAME).write_text(json.dumps(manifest))


def escape_to(entry: Path, rel: str, outside: Path) -> None:
    """List `rel` (outside the entry) in the manifest with the real size and sha256 of `outside`."""
    from ascq.formats.manifest import sha256_file

    record = {"size": outside.stat().st_size, "sha256": sha256_file(outside)}
    rewrite_manifest(entry, lambda m: m["files"].__setitem__(rel, record))


@pytest.mark.parametrize("rel", ["../secret.txt", "/etc/passwd", "a/../../secret.txt", "./config.json", ""])
def test_manifest_paths_outside_the_entry_are_refused_by_verify(
    entry: Path, rel: str, capsys: pytest.CaptureFixture
) -> None:
    (entry.parent / "secret.txt").write_text("not part of the entry\n")
    escape_to(entry, rel, entry / "config.json")
    err = one_line_error(capsys, run("zoo", "verify", str(entry)))
    assert f"file path {rel!r} is not a normalised path relative to the entry" in err


def test_a_symbolic_link_out_of_the_entry_is_refused(entry: Path, capsys: pytest.CaptureFixture) -> None:
    outside = entry.parent / "outside.json"
    shutil.move(entry / "config.json", outside)
    (entry / "config.json").symlink_to(outside)
    err = one_line_error(capsys, run("zoo", "verify", str(entry)))
    assert "file config.json leads outside the entry" in err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["files"]["config.json"].pop("size"), "file config.json has no valid size"),
        (lambda m: m["files"]["config.json"].__setitem__("size", "12"), "has no valid size"),
        (lambda m: m["files"]["config.json"].pop("sha256"), "has no valid sha256"),
        (lambda m: m.__setitem__("files", sorted(m["files"])), "files is not an object"),
        (lambda m: m["files"].__setitem__("config.json", 5), "record of file config.json is not an object"),
        (lambda m: m.__setitem__("name", ["x"]), "name is missing or not a string"),
        (lambda m: m.pop("name"), "name is missing or not a string"),
        (lambda m: m.__setitem__("metrics", {"perplexity": "low"}), "metrics.perplexity is not a number"),
        (lambda m: m.__setitem__("planned", ["x"]), "planned is not an object"),
    ],
)
def test_malformed_manifests_are_one_line_in_every_command(
    entry: Path, edit, message: str, capsys: pytest.CaptureFixture
) -> None:
    rewrite_manifest(entry, edit)
    for argv in (
        ["zoo", "verify", str(entry)],
        ["zoo", "show", str(entry)],
        ["zoo", "card", str(entry)],
        ["publish", str(entry), "--repo", "org/x", "--dry-run"],
    ):
        assert message in one_line_error(capsys, run(*argv)), argv
    run("zoo", "list", "--zoo", str(entry.parent))  # lists the entry as invalid, not a traceback
    assert "invalid ascq.json" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["[1, 2]", "{" * 100_000 + "}" * 100_000, "\xff"])
def test_a_manifest_that_is_not_a_json_object_is_one_line(entry: Path, text: str) -> None:
    (entry / MANIFEST_NAME).write_bytes(text.encode("latin-1"))
    with pytest.raises(AscqError) as info:
        read_manifest(entry)
    assert "\n" not in str(info.value)


def test_publish_refuses_a_manifest_path_outside_the_entry_before_any_request(
    hub: HubDouble, entry: Path, capsys: pytest.CaptureFixture
) -> None:
    secret = entry.parent / "secret.txt"
    secret.write_text("never uploaded\n")
    escape_to(entry, "../secret.txt", secret)
    one_line_error(capsys, run("publish", str(entry), "--repo", REPO))
    assert hub.requests == []


def test_pull_refuses_a_remote_manifest_path_outside_the_entry(
    hub: HubDouble, entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from ascq.formats.manifest import sha256_file

    assert run("publish", str(entry), "--repo", REPO) == 0
    files = dict(hub.repos[REPO].files_at("main"))
    manifest = json.loads(files[MANIFEST_NAME].data)
    for rel in ("../escaped.txt", "/etc/passwd"):
        manifest["files"][rel] = {"size": 5, "sha256": sha256_file(entry / "config.json")}
        files[MANIFEST_NAME] = StoredFile(json.dumps(manifest).encode(), lfs=False)
        hub.repos[REPO].add_commit("main", files, f"hostile {rel}")
        err = one_line_error(capsys, run("zoo", "pull", REPO, "--out", str(tmp_path / "pulled")))
        assert "is not a normalised path relative to the entry" in err
        manifest["files"].pop(rel)
    assert not (tmp_path / "pulled").exists() and not (tmp_path / "escaped.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pulled")] == []


@pytest.mark.parametrize("repo", ["org/a--b", "org/..", "org/x y", "a/b/c", "org/-x", "org/" + "x" * 200])
def test_hub_names_the_hub_refuses_are_one_line(
    hub: HubDouble, entry: Path, repo: str, capsys: pytest.CaptureFixture
) -> None:
    assert "is not a Hub repo id" in one_line_error(capsys, run("zoo", "pull", repo))
    assert "is not a Hub repo id" in one_line_error(capsys, run("publish", str(entry), "--repo", repo))
    assert hub.requests == []


def test_publish_to_an_endpoint_without_xet_is_one_line(
    hub: HubDouble, entry: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """hf_xet is installed (a dependency of huggingface_hub): without the switch the library asks the endpoint
    for a Xet token, which the double (like a Hub mirror without Xet) does not serve."""
    from huggingface_hub import constants

    pytest.importorskip("hf_xet")
    big = entry / "model.safetensors"
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    assert big.stat().st_size > 0
    err = one_line_error(capsys, run("publish", str(entry), "--repo", REPO))
    assert f"cannot publish tiny-test-llama to {REPO}" in err
    assert "HF_HUB_DISABLE_XET=1" in err


# ---- publish never modifies its source -------------------------------------------------------------------


def test_publish_leaves_the_source_entry_byte_identical(hub: HubDouble, entry: Path) -> None:
    from huggingface_hub import ModelCard

    before = {p.relative_to(entry): p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    mtimes = {p: os.stat(entry / p).st_mtime_ns for p in before}
    assert run("publish", str(entry), "--repo", REPO) == 0
    after = {p.relative_to(entry): p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    assert after == before and {p: os.stat(entry / p).st_mtime_ns for p in before} == mtimes
    assert not (entry / "README.md").exists()
    remote = hub.files(REPO)
    card = ModelCard(remote["README.md"].decode())
    assert card.data.pipeline_tag == "text-generation"
    recorded = json.loads(remote[MANIFEST_NAME])["files"]
    assert set(recorded) == {*read_manifest(entry)["files"], "README.md"}
    hub.requests.clear()
    assert run("publish", str(entry), "--repo", REPO) == 0  # the staged card is the same: nothing to upload
    assert hub.uploads() == []


# ---- output folders --------------------------------------------------------------------------------------


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.txt").write_text("years of work\n")
    return folder


def assert_untouched(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["thesis.txt"]
    assert (folder / "thesis.txt").read_text() == "years of work\n"
    assert [p for p in folder.parent.iterdir() if ".staging-" in p.name] == []


def test_pull_onto_a_user_folder_is_refused_with_and_without_overwrite(
    hub: HubDouble, entry: Path, user_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    hub.requests.clear()
    for flags in ([], ["--overwrite"], ["--force"]):
        err = one_line_error(capsys, run("zoo", "pull", REPO, "--out", str(user_folder), *flags))
        assert "is not a zoo entry (no ascq.json); refusing to replace it, even with --overwrite" in err
        assert_untouched(user_folder)
    assert hub.requests == []  # refused before any download


def test_pull_overwrite_replaces_an_entry_and_force_warns(
    hub: HubDouble, entry: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert run("publish", str(entry), "--repo", REPO) == 0
    out = tmp_path / "pulled"
    assert run("zoo", "pull", REPO, "--out", str(out)) == 0
    err = one_line_error(capsys, run("zoo", "pull", REPO, "--out", str(out)))
    assert "already exists; pass --overwrite to replace it" in err
    assert run("zoo", "pull", REPO, "--out", str(out), "--overwrite") == 0
    assert run("zoo", "pull", REPO, "--out", str(out), "--force") == 0
    assert "warning: --force is deprecated; use --overwrite" in capsys.readouterr().err
    remote = hub.files(REPO)
    remote.pop(".gitattributes")
    assert local_bytes(out) == remote
    assert run("zoo", "verify", str(out)) == 0


def test_import_gguf_onto_a_user_folder_is_refused(
    tmp_path: Path, user_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("gguf")
    gguf_file = write_real_gguf(tmp_path / "real.gguf")
    for flags in ([], ["--overwrite"]):
        argv = ["zoo", "import-gguf", str(gguf_file), "--zoo", str(tmp_path), "--name", "mine", *flags]
        assert "is not a zoo entry" in one_line_error(capsys, run(*argv))
        assert_untouched(user_folder)


def test_zoo_dummy_onto_a_user_folder_or_its_source_is_refused(
    entry: Path, user_folder: Path, capsys: pytest.CaptureFixture
) -> None:
    for flags in ([], ["--overwrite"]):
        argv = ["zoo", "dummy", str(entry), "--out", str(user_folder), *flags]
        assert "is not a zoo entry" in one_line_error(capsys, run(*argv))
        assert_untouched(user_folder)
        err = one_line_error(capsys, run("zoo", "dummy", str(entry), "--out", str(entry), *flags))
        assert "is the source model folder" in err


def test_convert_onto_a_user_folder_is_refused_before_any_download(
    entry: Path, user_folder: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a download would fail differently
    for model in (str(entry), "some-org/some-model"):
        for flags in ([], ["--overwrite"]):
            argv = ["convert", model, "--recipe", "w8a8", "--out", str(user_folder), *flags]
            assert "is not a zoo entry" in one_line_error(capsys, run(*argv))
            assert_untouched(user_folder)
    err = one_line_error(capsys, run("convert", "some-org/some-model", "--recipe", "w3a3"))
    assert "unknown recipe 'w3a3'" in err


def test_convert_names_a_hub_models_output_after_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from ascq.paths import zoo_root
    from ascq.quantize.convert import default_output

    assert default_output("deepseek-ai/deepseek-moe-16b-base", ["awq-int4"], "compressed-tensors") == (
        zoo_root() / "deepseek-moe-16b-base-awq-int4-compressed-tensors"
    )


def test_a_missing_model_has_one_wording_in_generate_serve_and_convert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zoo").mkdir()
    monkeypatch.setenv("ASCQ_ZOO", str(tmp_path / "zoo"))
    for argv in (
        ["generate", "zoo/nope", "--prompt", "x"],
        ["serve", "zoo/nope", "--port", "0"],
        ["convert", "zoo/nope", "--recipe", "w8a8"],
    ):
        err = one_line_error(capsys, run(*argv))
        assert "model zoo/nope does not exist: not a folder, and not an entry in the zoo at" in err, argv
        assert "Hub" not in err


def test_zoo_list_labels_perplexities_measured_on_different_tokens(
    entry: Path, capsys: pytest.CaptureFixture
) -> None:
    other = Path(shutil.copytree(entry, entry.parent / "other"))
    for folder, tokens in ((entry, 4096), (other, 512)):
        metrics = {
            "perplexity": 12.5,
            "perplexity_base": 12.0,
            "eval_text": "eval.txt",
            "num_eval_tokens": tokens,
        }
        manifest = read_manifest(folder)
        write_manifest(folder, dict(manifest, metrics=metrics))
    assert run("zoo", "list", "--zoo", str(entry.parent)) == 0
    out = capsys.readouterr().out
    assert "4,096 tokens of eval.txt" in out and "512 tokens of eval.txt" in out
    assert "perplexities compare only between rows measured on the same tokens" in out


# ---- umask and the kernel cache --------------------------------------------------------------------------


def test_the_umask_is_read_without_changing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(mask: int) -> int:
        raise AssertionError("os.umask changes the mask of every thread of the process")

    previous = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", forbidden)
        assert manifest_module._current_umask() == 0o027
        with staged_entry(tmp_path / "e") as staging:
            (staging / "a.txt").write_text("x")
            write_manifest(staging, {"name": "e"})
        assert stat.S_IMODE((tmp_path / "e" / "a.txt").stat().st_mode) == 0o640
        assert stat.S_IMODE((tmp_path / "e").stat().st_mode) == 0o750
    finally:
        monkeypatch.undo()
        os.umask(previous)


def test_kernel_cache_is_private_and_untrusted_libraries_are_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ascq.kernels import native

    cache = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("ASCQ_CACHE_DIR", str(cache))
    assert native._cache_dir() == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    os.chmod(cache, 0o777)
    native._cache_dir()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755
    library = cache / "lib.so"
    library.write_bytes(b"\x7fELF")
    os.chmod(library, 0o700)
    assert native._trusted(library)
    for mode in (0o720, 0o702, 0o766):
        os.chmod(library, mode)
        assert not native._trusted(library)
    library.unlink()
    library.symlink_to(tmp_path / "elsewhere.so")
    (tmp_path / "elsewhere.so").write_bytes(b"")
    assert not native._trusted(library)


def test_kernel_cache_owned_by_another_user_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ascq.kernels import native

    other_uid = 65534 if os.geteuid() != 65534 else 65533
    folder, library = tmp_path / "kernels", tmp_path / "theirs.so"
    folder.mkdir(mode=0o700)
    library.write_bytes(b"\x7fELF")
    os.chmod(library, 0o700)
    if os.geteuid() == 0:  # root can hand files to another user; others find one that is not theirs: /
        os.chown(folder, other_uid, -1)
        os.chown(library, other_uid, -1)
        assert not native._trusted(library)
    else:
        folder = Path("/")
    monkeypatch.setenv("ASCQ_CACHE_DIR", str(folder))
    with pytest.raises(OSError, match="belongs to another user"):
        native._cache_dir()


@pytest.mark.slow  # compiles the kernels
def test_a_group_writable_cached_library_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ascq.kernels import native

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("ASCQ_CACHE_DIR", str(tmp_path / "kernels"))
    built = native._compile(compiler, "avx2")
    good = built.read_bytes()
    built.write_bytes(b"planted by someone else")
    os.chmod(built, 0o666)
    assert native._compile(compiler, "avx2") == built
    assert built.read_bytes() == good and stat.S_IMODE(built.stat().st_mode) == 0o700


# ---- printed commands run as typed -----------------------------------------------------------------------


def test_a_planned_entry_is_a_target_its_convert_command_replaces(tmp_path: Path, entry: Path) -> None:
    from ascq.formats.manifest import check_output
    from ascq.zoo import deepseek_moe_16b

    planned = tmp_path / deepseek_moe_16b.NAME
    deepseek_moe_16b.write_entry(planned)
    check_output(planned, [], overwrite=False)  # its printed command has no --overwrite
    with pytest.raises(AscqError, match="already exists; pass --overwrite"):
        check_output(entry, [], overwrite=False)  # an entry with weights is not replaced without it
    assert deepseek_moe_16b.COMMANDS["convert"] in (ROOT / "README.md").read_text()


def commands_in(text: str) -> list[str]:
    """Every `ascq ...` command a text prints, in the order printed: in backticks, or as lines of a ```bash
    block."""
    import re

    found = [(m.start(), m.group(1)) for m in re.finditer(r"(?<!`)`(ascq [^`]+)`", text)]
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        offset = block.start(1)
        for line in block.group(1).splitlines(keepends=True):
            if line.startswith("ascq "):
                found.append((offset, line.strip()))
            offset += len(line)
    return list(dict.fromkeys(command for _, command in sorted(found)))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_as_typed(command: str, cwd: Path, env: dict[str, str]) -> dict:
    """Start `command` (an `ascq serve ...` line, plus a free --port), wait for /health, complete two tokens,
    stop it with SIGTERM; its whole process group is killed on every path."""
    import signal
    import time
    import urllib.request

    port = free_port()
    argv = [sys.executable, "-m", "ascq.cli", *shlex.split(command)[1:], "--port", str(port)]
    process = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{command} did not become healthy"
            time.sleep(1)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "def f(", "max_tokens": 2, "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            result = json.loads(response.read())
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        return result
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stderr.close()


@pytest.mark.slow  # converts the tiny DeepSeek-MoE with awq-int4 and starts two servers
def test_every_command_the_deepseek_plan_prints_runs_as_typed(
    hub: HubDouble,
    tiny_deepseek_moe_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The plan of zoo/deepseek-moe-16b with the tiny DeepSeek-MoE standing in for the 16B (its config in the
    plan; its files on the Hub double under deepseek-ai/deepseek-moe-16b-base): the no-weights error's
    commands, `zoo show`'s and the card's, each run exactly as printed (servers get a free --port)."""
    from huggingface_hub import constants

    from ascq.zoo import deepseek_moe_16b
    from ascq.zoo.card import render_card
    from ascq.zoo.planned import write_planned_entry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    config = json.loads((tiny_deepseek_moe_dir / "config.json").read_text())
    entry = tmp_path / "zoo" / deepseek_moe_16b.NAME
    write_planned_entry(
        entry, config, deepseek_moe_16b.COMMANDS, ["awq-int4"], source={"model": deepseek_moe_16b.SOURCE}
    )
    files = {
        p.name: StoredFile(p.read_bytes(), lfs=p.suffix == ".safetensors")
        for p in tiny_deepseek_moe_dir.iterdir()
        if p.name not in (MANIFEST_NAME, "README.md")
    }
    hub.repos[deepseek_moe_16b.SOURCE] = Repo(private=False)
    hub.repos[deepseek_moe_16b.SOURCE].add_commit("main", files, "the tiny stand-in")

    assert run("serve", "zoo/deepseek-moe-16b") == 1
    error = capsys.readouterr().err
    assert "--load-format dummy" in error
    assert run("zoo", "show", deepseek_moe_16b.NAME) == 0
    shown = [
        line.split("produce them with: ", 1)[-1].removeprefix("serve with").strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("weights ", "serve with "))
    ]
    printed = list(dict.fromkeys([*commands_in(error), *shown, *commands_in(render_card(entry))]))
    convert = deepseek_moe_16b.COMMANDS["convert"]
    assert convert in printed and deepseek_moe_16b.COMMANDS["serve"] in printed
    dummy = [command for command in printed if "--load-format dummy" in command]
    assert dummy == ["ascq serve zoo/deepseek-moe-16b --load-format dummy"]
    env = dict(os.environ, ASCQ_ZOO=str(tmp_path / "zoo"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")

    for command in dummy:  # before the weights exist
        assert serve_as_typed(command, tmp_path, env)["usage"]["completion_tokens"] == 2
    assert run(*shlex.split(convert)[1:]) == 0  # the planned folder is its target
    for command in [c for c in printed if c not in dummy and c != convert]:
        if command.startswith("ascq serve "):
            assert serve_as_typed(command, tmp_path, env)["usage"]["completion_tokens"] == 2
        else:
            assert run(*shlex.split(command)[1:]) == 0, command


@pytest.mark.parametrize("name", ["../escaped.txt", "/abs.txt", "a/../../escaped.txt", "a\\b"])
def test_pull_refuses_remote_file_names_outside_the_entry_before_downloading(
    hub: HubDouble, tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    """A hostile endpoint lists a file whose name leaves the folder: refused by name, nothing fetched."""
    hub.repos["org/hostile"] = Repo(private=False)
    files = {name: StoredFile(b"x", lfs=False), MANIFEST_NAME: StoredFile(b"{}", lfs=False)}
    hub.repos["org/hostile"].add_commit("main", files, "hostile names")
    err = one_line_error(capsys, run("zoo", "pull", "org/hostile", "--out", str(tmp_path / "out")))
    assert f"org/hostile on the Hub: file path {name!r} is not a normalised path" in err
    assert not any("/resolve/" in path for _, path in hub.requests)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("escaped.txt"))


@pytest.mark.slow  # starts a server
def test_every_ascq_command_a_published_card_prints_runs_as_typed(
    hub: HubDouble, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny-llama published to the Hub double; its card's commands (pull, serve, verify) run in a fresh zoo,
    in the order printed (the server gets a free --port)."""
    entry = Path(shutil.copytree(tiny_llama_dir, tmp_path / "zoo" / tiny_llama_dir.name))
    assert run("publish", str(entry), "--repo", REPO) == 0
    printed = commands_in(hub.files(REPO)["README.md"].decode())
    assert printed[:2] == [f"ascq zoo pull {REPO}", f"ascq serve {REPO.split('/')[1]}"], printed
    fresh = tmp_path / "fresh-zoo"
    monkeypatch.setenv("ASCQ_ZOO", str(fresh))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    for command in printed:
        if command.startswith("ascq serve "):
            assert serve_as_typed(command, tmp_path, env)["usage"]["completion_tokens"] == 2
        else:
            assert run(*shlex.split(command)[1:]) == 0, command
