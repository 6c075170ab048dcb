"""Calibration data through `datasets`: local text/json/jsonl/parquet files and folders, Hub ids offline,
packing."""

from __future__ import annotations

import json

import pytest
import torch

from ascq.core.errors import AscqError
from ascq.paths import CALIB_TEXT
from ascq.quantize.calibration import load_calibration, load_texts, pack_tokens


class CharTokenizer:
    """A transformers-style callable tokenizer: one id per character (ord % 250), eos 255."""

    eos_token_id = 255

    def __call__(self, text, add_special_tokens=False, verbose=True):
        return {"input_ids": [ord(c) % 250 for c in text]}


DOCS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.getcwd())\n"]


def test_pack_tokens_concatenates_with_eos_and_cuts_blocks():
    blocks = pack_tokens([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_id=0, seq_len=4, num_samples=2)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]
    assert pack_tokens([[1, 2, 3]], None, 2, 5).tolist() == [[1, 2]]  # fewer blocks than asked: what exists
    with pytest.raises(AscqError, match="fewer than one block"):
        pack_tokens([[1]], 0, 8, 1)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "parquet", "folder"])
def test_local_formats(tmp_path, kind):
    if kind == "txt":
        path = tmp_path / "calib.txt"
        path.write_text("".join(DOCS))
    elif kind in ("jsonl", "folder"):
        folder = tmp_path / "data"
        folder.mkdir()
        for i, doc in enumerate(DOCS):
            (folder / f"part{i}.jsonl").write_text(json.dumps({"text": doc, "id": i}) + "\n")
        path = folder if kind == "folder" else folder / "part0.jsonl"
    elif kind == "json":
        path = tmp_path / "calib.json"
        path.write_text(json.dumps([{"content": d} for d in DOCS]))
    else:
        import pandas as pd

        path = tmp_path / "calib.parquet"
        pd.DataFrame({"text": DOCS}).to_parquet(path)
    label, texts = load_texts(path)
    assert label == path.name  # ascq.json names calibration files without local paths
    expected = ["".join(DOCS)] if kind == "txt" else [DOCS[0]] if kind == "jsonl" else DOCS
    assert sorted(texts) == sorted(expected)
    calib = load_calibration(path, CharTokenizer(), num_samples=2, seq_len=8)
    assert calib.input_ids.shape == (2, 8) and calib.input_ids.dtype == torch.long


def test_default_is_the_bundled_calibration_slice():
    calib = load_calibration(None, CharTokenizer(), num_samples=3, seq_len=64)
    assert calib.dataset == "ascq/data/calib.txt" and calib.input_ids.shape == (3, 64)
    text = CALIB_TEXT.read_text()
    assert calib.input_ids[0].tolist() == [ord(c) % 250 for c in text[:64]]


def test_bad_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AscqError, match="Hugging Face Hub is unreachable"):
        load_texts("someorg/some-dataset")
    with pytest.raises(AscqError, match="does not exist"):
        load_texts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "weird.csv").write_text("a,b\n")
    with pytest.raises(AscqError, match="expected .txt, .json, .jsonl or .parquet"):
        load_texts(tmp_path / "weird.csv")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"x": 1}\n')
    with pytest.raises(AscqError, match="no text column"):
        load_texts(numbers)


def test_no_eval_skips_the_perplexity_and_rejects_an_eval_text(tiny_llama_dir, tmp_path, capsys) -> None:
    from ascq.cli import main
    from ascq.formats.manifest import read_manifest

    fast = ["--num-samples", "2", "--seq-len", "32"]
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "convert",
                str(tiny_llama_dir),
                "--recipe",
                "w8a16",
                "--out",
                str(tmp_path / "a"),
                "--no-eval",
                "--eval-text",
                str(tiny_llama_dir / "config.json"),
                *fast,
            ]
        )
    assert exc.value.code == 1 and "contradict" in capsys.readouterr().err and not (tmp_path / "a").exists()
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "convert",
                str(tiny_llama_dir),
                "--recipe",
                "w8a16",
                "--out",
                str(tmp_path / "a"),
                "--no-eval",
                "--max-eval-tokens",
                "512",
                *fast,
            ]
        )
    assert exc.value.code == 1 and "contradict" in capsys.readouterr().err and not (tmp_path / "a").exists()
    for flag, has_perplexity in (("--no-eval", False), ("--eval", True)):
        entry = tmp_path / flag
        main(["convert", str(tiny_llama_dir), "--recipe", "w8a16", "--out", str(entry), flag, *fast])
        assert ("perplexity" in read_manifest(entry).get("metrics", {})) == has_perplexity
