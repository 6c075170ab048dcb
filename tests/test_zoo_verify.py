"""`ascq zoo verify` / `zoo show`: sha256 against the manifest, config + tokenizer load, tensor names per
format; the first mismatch is named; entries are given by name or by path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from zoo_builder import run

from ascq.core.errors import AscqError
from ascq.formats.manifest import read_manifest, write_manifest
from ascq.zoo.verify import verify_entry


def rewrite_shard(entry: Path, shard: str, edit) -> None:
    """Change a shard's tensors and re-record the manifest, so only the format check can catch it."""
    tensors = load_file(entry / shard)
    edit(tensors)
    save_file(tensors, entry / shard, metadata={"format": "pt"})
    write_manifest(entry, read_manifest(entry))


def test_verify_passes_by_name_and_by_path(zoo: Path, capsys: pytest.CaptureFixture) -> None:
    assert run("zoo", "verify", "tiny-test-llama-w4a16") == 0
    out = capsys.readouterr().out
    assert "tensor names match compressed-tensors (14 quantized linears" in out and "tokenizer loads" in out
    assert run("zoo", "verify", str(zoo / "tiny-test-llama")) == 0
    assert "plain float weights (format hf)" in capsys.readouterr().out
    assert run("zoo", "verify", "no-such-entry") == 1
    assert "no zoo entry 'no-such-entry'" in capsys.readouterr().err


def test_one_changed_byte_is_named(zoo: Path, capsys: pytest.CaptureFixture) -> None:
    path = zoo / "tiny-test-llama-w4a16" / "model-00002-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    assert run("zoo", "verify", "tiny-test-llama-w4a16") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model-00002-of-00002.safetensors has a different sha256" in err


def test_extra_and_missing_files_are_named(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama"
    (entry / "notes.txt").write_text("x")
    with pytest.raises(AscqError, match="notes.txt is not listed"):
        verify_entry(entry)
    (entry / "notes.txt").unlink()
    (entry / "tokenizer.json").unlink()
    with pytest.raises(AscqError, match="tokenizer.json is listed in the manifest but missing"):
        verify_entry(entry)


def test_missing_compressed_tensors_parameter_is_named(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama-w4a16"
    shard = json.loads((entry / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.0.self_attn.k_proj.weight_zero_point"
    ]
    rewrite_shard(entry, shard, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_zero_point"))
    with pytest.raises(AscqError, match="index.json maps model.layers.0.self_attn.k_proj.weight_zero_point"):
        verify_entry(entry)
    index = json.loads((entry / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_proj.weight_zero_point"]
    (entry / "model.safetensors.index.json").write_text(json.dumps(index))
    write_manifest(entry, read_manifest(entry))
    with pytest.raises(
        AscqError,
        match=r"model.layers.0.self_attn.k_proj lacks weight_zero_point required by format pack-quantized",
    ):
        verify_entry(entry)


def test_quantized_module_in_the_ignore_list_is_named(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama-w4a16"
    config = json.loads((entry / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*layers.1.mlp.down_proj$"]
    (entry / "config.json").write_text(json.dumps(config))
    write_manifest(entry, read_manifest(entry))
    with pytest.raises(
        AscqError, match="model.layers.1.mlp.down_proj is in the ignore list but is stored quantized"
    ):
        verify_entry(entry)


def test_dense_entry_with_a_quantized_tensor_is_refused(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama"
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_shard(entry, "model.safetensors", lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(AscqError, match=r"model.layers.0.mlp.up_proj.weight \(I8\) is quantized"):
        verify_entry(entry)


def test_broken_config_and_tokenizer_are_named(zoo: Path) -> None:
    entry = zoo / "tiny-test-llama"
    (entry / "tokenizer.json").write_text("{not json")
    write_manifest(entry, read_manifest(entry))
    with pytest.raises(AscqError, match="tokenizer does not load"):
        verify_entry(entry)
    (entry / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"')
    write_manifest(entry, read_manifest(entry))
    with pytest.raises(AscqError, match="config.json does not load"):
        verify_entry(entry)


def test_show_prints_provenance_metrics_and_files(zoo: Path, capsys: pytest.CaptureFixture) -> None:
    assert run("zoo", "show", "tiny-test-llama-w4a16") == 0
    out = capsys.readouterr().out
    for text in (
        "test-org/tiny-test-llama",
        "w4a16-rtn",
        "compressed-tensors",
        "perplexity 310.75",
        "model-00001-of-00002.safetensors",
    ):
        assert text in out


@pytest.mark.slow  # converts both fixtures (cached for the session, shared with test_convert)
def test_fixtures_and_converted_fixtures_verify(
    tiny_llama_dir: Path, tiny_deepseek_moe_dir: Path, converted_entry
) -> None:
    assert verify_entry(tiny_llama_dir)[-1].endswith("(format hf)")
    assert verify_entry(tiny_deepseek_moe_dir)[-1].endswith("(format hf)")
    assert "format pack-quantized" in verify_entry(converted_entry(tiny_llama_dir, ("w4a16-rtn",)))[-1]
    # router ignored, k/v scales
    moe = verify_entry(converted_entry(tiny_deepseek_moe_dir, ("w8a8", "fp8-kv")))
    assert "format int-quantized" in moe[-1] and "model_type deepseek" in moe[1]
