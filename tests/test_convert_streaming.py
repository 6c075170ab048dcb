"""The streaming converter on synthetic checkpoints: bad input, atomicity under kill, group fallback, flat
RSS."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from ascq.cli import main
from ascq.core.errors import AscqError
from ascq.formats.manifest import read_manifest, verify_files
from ascq.quantize.convert import ConvertOptions, convert
from ascq.quantize.reference_forward import reference_logits
from ascq.quantize.synthetic import write_synthetic_checkpoint

LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=128,
    intermediate_size=200,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=256,
    eos_token_id=256,
)


def deepseek_config(num_layers: int, hidden: int = 256, experts: int = 16, expert_dim: int = 384) -> dict:
    return dict(
        model_type="deepseek",
        architectures=["DeepseekForCausalLM"],
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * expert_dim,
        moe_intermediate_size=expert_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=experts,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        norm_topk_prob=False,
        scoring_func="softmax",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=256,
        torch_dtype="bfloat16",
    )


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synthetic-llama")
    write_synthetic_checkpoint(path, LLAMA)
    return path


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


def _no_entry(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")] if parent.is_dir() else True


def test_group_size_fallback_is_recorded_and_loads(small_llama, tmp_path):
    """down_proj in_features 200 is not a multiple of 128: per-channel for that linear, own config group."""
    from transformers import AutoModelForCausalLM

    entry = convert(
        ConvertOptions(
            str(small_llama), ["w4a16-rtn"], out=tmp_path / "e", num_samples=2, seq_len=64, progress=False
        )
    )
    manifest = read_manifest(entry)
    verify_files(entry, manifest)
    fallbacks = manifest["conversion"]["group_size_fallbacks"]
    assert sorted(fallbacks) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    groups = json.loads((entry / "config.json").read_text())["quantization_config"]["config_groups"]
    assert (
        groups["group_1"]["targets"] == sorted(fallbacks)
        and groups["group_1"]["weights"]["strategy"] == "channel"
    )
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
    with torch.no_grad():
        hf = model(ids).logits
    ours = reference_logits(entry, ids)
    assert (hf - ours).abs().max() <= 1e-3 * (ours.max() - ours.min())


def test_bad_input_one_line_error_no_entry(small_llama, tmp_path, capsys):
    out = tmp_path / "zoo"
    out.mkdir()
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("quant_stage:\n  quant_modifiers: [oops\n")
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    truncated = tmp_path / "truncated"
    write_synthetic_checkpoint(truncated, LLAMA)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = {
        "missing": ([str(tmp_path / "nope"), "--recipe", "w8a8"], "does not exist"),
        "unknown recipe": ([str(small_llama), "--recipe", "w3a3"], "unknown recipe 'w3a3'"),
        "malformed": ([str(small_llama), "--recipe", str(bad_yaml)], "malformed YAML"),
        "unsupported": (
            [str(unsupported), "--recipe", "w8a8"],
            "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, deepseek",
        ),
        "truncated": ([str(truncated), "--recipe", "w8a8"], "model.safetensors is truncated or corrupted"),
        "bad device": ([str(small_llama), "--recipe", "w8a8", "--device", "tpu"], "--device 'tpu'"),
    }
    for name, (args, message) in cases.items():
        code, err = _run_cli(["convert", *args, "--out", str(out / name)], capsys)
        assert code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1, (
            name,
            err,
        )
        _no_entry(out, name)
    code, err = _run_cli(
        ["convert", str(small_llama), "--recipe", "w8a8", "--out", str(a_file / "x")], capsys
    )
    assert code == 1 and err.startswith("error: cannot write to") and err.count("\n") == 1
    assert list(out.iterdir()) == []


def _convert_cmd(model: Path, out: Path, *extra: str) -> list[str]:
    return [
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
        "2",
        "--seq-len",
        "32",
        *extra,
    ]


@pytest.mark.slow
def test_killed_convert_leaves_nothing_verifiable_and_rerun_succeeds(tmp_path):
    model = tmp_path / "model"
    write_synthetic_checkpoint(model, deepseek_config(8))
    zoo = tmp_path / "zoo"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        _convert_cmd(model, zoo / "entry", "--max-shard-size", "1MB"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(zoo.glob(".entry.staging-*/part-00003.safetensors")):
        assert proc.poll() is None, "convert finished before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (zoo / "entry").exists()
    for leftover in zoo.iterdir():
        with pytest.raises(AscqError):
            verify_files(leftover)
    subprocess.run(_convert_cmd(model, zoo / "entry"), env=env, check=True, capture_output=True)
    verify_files(zoo / "entry")


def _peak_rss(model: Path, out: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        _convert_cmd(model, out, "--max-shard-size", "16MB"), env=env, check=True, capture_output=True
    )
    return read_manifest(out)["conversion"]["peak_rss_bytes"]


@pytest.mark.slow
def test_peak_rss_does_not_grow_with_layers(tmp_path):
    """8 layers vs 2 layers of a deepseek-moe-shaped checkpoint (each layer ~35 MB bf16): peak RSS within
    25%."""
    sizes, rss = {}, {}
    for num_layers in (2, 8):
        model = tmp_path / f"m{num_layers}"
        sizes[num_layers] = write_synthetic_checkpoint(
            model, deepseek_config(num_layers, hidden=512, experts=32, expert_dim=384)
        )
        rss[num_layers] = _peak_rss(model, tmp_path / f"e{num_layers}")
    assert sizes[8] > 3 * sizes[2]
    assert rss[8] <= 1.25 * rss[2], (rss, sizes)


@pytest.mark.parametrize("calibration_dtype", ["float32", "bfloat16"])
def test_each_layer_is_freed_before_the_next_loads(tmp_path, monkeypatch, calibration_dtype):
    """Linears that a layer swaps out for quantized ones must die with it: a forward closing over its linear
    made a reference cycle that only the cyclic collector freed, whenever it ran; at deepseek-moe-16b's shape
    that kept GiBs of fp32 experts per layer alive (peak RSS 9.2 GiB by layer 3 of an awq-int4 convert). With
    automatic collection off, no earlier layer or weight may be alive when the next layer is built."""

    from ascq.quantize.architectures import Architecture

    model = tmp_path / "m"
    write_synthetic_checkpoint(model, deepseek_config(3))
    build_layer, layers, alive_at_build = Architecture.build_layer, [], []  # the layers and their weights

    def recording_build_layer(self, index, state):
        alive_at_build.append(sum(ref() is not None for ref in layers))
        layer = build_layer(self, index, state)
        layers.extend(weakref.ref(x) for x in [layer, *layer.parameters()])
        return layer

    monkeypatch.setattr(Architecture, "build_layer", recording_build_layer)
    options = ConvertOptions(
        str(model),
        ["awq-int4"],
        out=tmp_path / "entry",
        num_samples=2,
        seq_len=32,
        evaluate=False,
        progress=False,
        calibration_dtype=calibration_dtype,
    )
    gc.disable()
    try:
        convert(options)
    finally:
        gc.enable()
    assert alive_at_build == [0, 0, 0]
