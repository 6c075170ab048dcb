"""Nothing a user owns is lost: --out checks, atomic --overwrite, Ctrl-C / SIGTERM cleanup, stale staging."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascq.cli import main
from ascq.formats.manifest import Terminated, read_manifest, signals_raise, verify_files
from ascq.quantize.convert import ConvertOptions, convert, default_output
from ascq.quantize.synthetic import write_synthetic_checkpoint

LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    bos_token_id=256,
    eos_token_id=256,
)
FAST = ["--num-samples", "2", "--seq-len", "32"]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in-process."""
    try:
        main(argv)
    except SystemExit as exc:
        return exc.code or 0, capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zoo") / "small"
    write_synthetic_checkpoint(path, LLAMA)
    return path


def test_out_onto_the_source_is_refused_and_source_untouched(tiny_llama_dir, capsys) -> None:
    before = _tree_digest(tiny_llama_dir)
    for extra in ([], ["--overwrite"]):
        code, err = _run_cli(
            ["convert", str(tiny_llama_dir), "--recipe", "w8a8", "--out", str(tiny_llama_dir), *extra], capsys
        )
        assert code == 1 and "is the source model folder or contains it" in err and err.count("\n") == 1
    code, err = _run_cli(
        [
            "convert",
            str(tiny_llama_dir),
            "--recipe",
            "w8a8",
            "--out",
            str(tiny_llama_dir.parent),
            "--overwrite",
        ],
        capsys,
    )
    assert code == 1 and "contains it" in err
    code, err = _run_cli(
        ["convert", str(tiny_llama_dir), "--recipe", "w8a8", "--out", str(tiny_llama_dir / "sub")], capsys
    )
    assert code == 1 and "inside the source model folder" in err
    assert _tree_digest(tiny_llama_dir) == before
    assert not [p for p in tiny_llama_dir.parent.iterdir() if p.name.startswith(".tiny-llama.")]


def test_existing_out_needs_overwrite_and_is_replaced_atomically(model, tmp_path, capsys) -> None:
    out = tmp_path / "entry"
    args = ["convert", str(model), "--recipe", "w4a16-rtn", "--out", str(out), *FAST]
    assert _run_cli(args, capsys)[0] == 0
    first = _tree_digest(out)
    code, err = _run_cli(args, capsys)
    assert code == 1 and f"{out} already exists; pass --overwrite" in err and err.count("\n") == 1
    assert _tree_digest(out) == first
    code, _ = _run_cli([*args[:3], "w8a8", *args[4:], "--overwrite"], capsys)
    assert code == 0
    verify_files(out)
    assert read_manifest(out)["recipe"]["names"] == ["w8a8"]
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no staging or old copy left behind


def test_overwrite_never_replaces_a_file_or_a_folder_that_is_not_an_entry(model, tmp_path, capsys) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "data.bin").write_bytes(b"precious")
    for target, message in ((a_file, "exists and is not a folder"), (folder, "is not a zoo entry")):
        code, err = _run_cli(
            ["convert", str(model), "--recipe", "w8a8", "--out", str(target), "--overwrite", *FAST], capsys
        )
        assert code == 1 and message in err and err.count("\n") == 1
    assert a_file.read_text() == "mine" and (folder / "data.bin").read_bytes() == b"precious"


def test_default_output_name_includes_the_format(model, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ASCQ_ZOO", str(tmp_path))
    assert default_output(model, ["w8a8"], "msmodelslim") == tmp_path / "small-w8a8-msmodelslim"
    assert default_output(model, ["w8a8"], "compressed-tensors") == tmp_path / "small-w8a8-compressed-tensors"
    entry = convert(ConvertOptions(str(model), ["w8a8"], num_samples=2, seq_len=32, progress=False))
    assert entry == tmp_path / "small-w8a8-compressed-tensors"
    text = (entry / "ascq.json").read_text()
    assert str(model.parent) not in text and str(tmp_path) not in text  # no absolute local paths


def test_stale_staging_is_named_and_removed_by_convert_and_gc(model, tmp_path, capsys, caplog) -> None:
    dead = "999999999"  # above any pid_max: never a live process
    stale = tmp_path / f".entry.staging-{dead}-x1"
    stale.mkdir()
    (stale / "part-00001.safetensors").write_bytes(b"partial")
    live = tmp_path / f".entry.staging-{os.getpid()}-x2"  # a writer that is still running: left alone
    live.mkdir()
    code, err = _run_cli(
        ["convert", str(model), "--recipe", "w8a8", "--out", str(tmp_path / "entry"), *FAST], capsys
    )
    assert code == 0 and f"removing {stale}, left by an interrupted write" in caplog.text
    assert not stale.exists() and live.exists()
    other = tmp_path / f".other.old-{dead}-x3"
    other.mkdir()
    assert _run_cli(["zoo", "gc", "--zoo", str(tmp_path)], capsys)[0] == 0
    assert not other.exists() and live.exists()
    shutil.rmtree(live)


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_signal_during_convert_removes_staging(sig, code, word, tmp_path) -> None:
    model = tmp_path / "model"
    write_synthetic_checkpoint(
        model, dict(LLAMA, num_hidden_layers=24, hidden_size=256, intermediate_size=512)
    )
    out = tmp_path / "zoo" / "entry"
    cmd = [
        sys.executable,
        "-m",
        "ascq.cli",
        "convert",
        str(model),
        "--recipe",
        "w8a8",
        "--out",
        str(out),
        "--num-samples",
        "32",
        "--seq-len",
        "128",
        "--max-shard-size",
        "1MB",
    ]
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (`nohup ... &`) has SIGINT ignored, and a child inherits that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(out.parent.glob(".entry.staging-*/part-00001.safetensors")):
            assert proc.poll() is None, "convert finished before it could be interrupted"
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    # splitlines also cuts tqdm's \r
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {word}") and "Traceback" not in err, err
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("sig", "expected"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)]
)
def test_a_signal_that_surfaces_as_another_exception_is_still_that_signal(sig, expected) -> None:
    """A signal inside a C extension's Python callback (safetensors' get_tensor, seen in CI) can reach us as a
    ValueError; inside `signals_raise` it is still `Terminated` / `KeyboardInterrupt`, so convert exits 143 /
    130 with its one line."""
    # Python's own SIGINT handler, as in a foreground run (a suite started with `&` has SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(expected) as info, signals_raise():
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler raises here
            except expected:
                raise ValueError(
                    "could not determine the shape of object type 'torch.storage.UntypedStorage'"
                ) from None
    finally:
        signal.signal(signal.SIGINT, before)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(ValueError):  # no signal: other errors pass through unchanged
        with signals_raise():
            raise ValueError("plain")
