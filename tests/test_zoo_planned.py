"""The planned deepseek-moe-16b entry: sizes and memory computed from the architecture, checked against
independent references (ascq's reference DeepSeek model, transformers' Llama, compressed-tensors' own
compressors, the fixture checkpoints); `require_weights` names the command that produces the weights."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from zoo_builder import write_dense_entry

from ascq.cli import main
from ascq.core.errors import AscqError
from ascq.formats.manifest import read_manifest
from ascq.paths import PROJECT_DIR
from ascq.zoo import deepseek_moe_16b
from ascq.zoo.planned import (
    checkpoint_bytes,
    checkpoint_tensors,
    kv_cache_bytes_per_token,
    require_weights,
    shipped_recipe_scheme,
)
from ascq.zoo.verify import read_tensor_infos

ENTRY = PROJECT_DIR / "zoo" / deepseek_moe_16b.NAME
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "F8_E4M3": 1}


def payload_bytes(entry: Path) -> int:
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] for dtype, shape in read_tensor_infos(entry).values())


def test_deepseek_moe_16b_tensors_and_parameter_count_match_the_reference_model() -> None:
    from ascq.reference.deepseek_moe import DeepseekConfig, DeepseekDecoderLayer, DeepseekForCausalLM

    # layer 0 dense, layer 1 MoE, as in all 28
    two_layers = dict(deepseek_moe_16b.CONFIG, num_hidden_layers=2)
    config = DeepseekConfig.from_dict(two_layers)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config)
        moe_layer = DeepseekDecoderLayer(config, 1)
    assert dict(checkpoint_tensors(two_layers)) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    num_params = sum(p.numel() for p in model.parameters()) + 26 * sum(
        p.numel() for p in moe_layer.parameters()
    )
    planned = read_manifest(ENTRY)["planned"]
    assert planned["num_parameters"] == num_params
    assert planned["recipes"]["bf16"]["checkpoint_bytes"] == 2 * num_params
    assert 16.3e9 < num_params < 16.5e9  # "16.4B" as published


def test_dense_size_matches_a_transformers_checkpoint(tmp_path: Path) -> None:
    entry = write_dense_entry(tmp_path / "dense")
    config = json.loads((entry / "config.json").read_text())  # transformers' own config.json of LLAMA
    assert checkpoint_bytes(config, None) == payload_bytes(entry)


@pytest.mark.slow  # converts tiny-llama (cached for the session, shared with test_convert)
def test_planned_sizes_match_the_fixture_checkpoints(
    tiny_llama_dir: Path, tiny_deepseek_moe_dir: Path, converted_entry
) -> None:
    for entry in (tiny_llama_dir, tiny_deepseek_moe_dir):
        config = json.loads((entry / "config.json").read_text())
        assert checkpoint_bytes(config, None) == payload_bytes(entry), entry.name
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert checkpoint_bytes(config, "w4a16-rtn") == payload_bytes(
        converted_entry(tiny_llama_dir, ("w4a16-rtn",))
    )


@pytest.mark.parametrize(
    "recipe", ["awq-int4", "w4a16-gptq", "w4a16-rtn", "w4a8-dynamic", "w8a16", "w8a8", "w8a8-static"]
)
@pytest.mark.parametrize("shape", [(72, 256), (2816, 2048)])
def test_linear_bytes_match_compressed_tensors_compressors(recipe: str, shape: tuple[int, int]) -> None:
    """The library picks the format (as the converters do) and compresses; the bytes must match the plan."""
    spec = shipped_recipe_scheme(recipe)
    activations = None
    if spec.scheme.startswith(("w8a8", "w4a8")):
        static = spec.static_input_scale
        activations = QuantizationArgs(
            num_bits=8, strategy="tensor" if static else "token", dynamic=not static
        )
    scheme = QuantizationScheme(
        targets=["Linear"],
        input_activations=activations,
        weights=QuantizationArgs(
            num_bits=spec.num_bits,
            group_size=spec.group_size,
            strategy="group" if spec.group_size else "channel",
            symmetric=spec.symmetric,
        ),
    )
    num_groups = shape[1] // spec.group_size if spec.group_size else 1
    state = {
        "weight": torch.randn(shape, dtype=torch.bfloat16),
        "weight_scale": torch.full((shape[0], num_groups), 0.01, dtype=torch.bfloat16),
        "weight_zero_point": torch.zeros((shape[0], num_groups), dtype=torch.int8),
    }
    compressor = BaseCompressor.load_from_registry(infer_module_format(torch.nn.Linear, scheme).value)
    stored = compressor.compress(state, scheme)
    input_scale = 2 if spec.static_input_scale else 0  # one bf16 value per linear, written by the converter
    assert spec.linear_bytes(*shape) == sum(t.nbytes for t in stored.values()) + input_scale


def test_entry_on_disk_is_what_the_module_writes(tmp_path: Path) -> None:
    fresh = deepseek_moe_16b.write_entry(tmp_path / deepseek_moe_16b.NAME)
    committed = read_manifest(ENTRY)
    assert {k: v for k, v in committed.items() if k != "created"} == {
        k: v for k, v in fresh.items() if k != "created"
    }
    assert json.loads((ENTRY / "config.json").read_text()) == deepseek_moe_16b.CONFIG
    assert committed["source"]["model"] == "deepseek-ai/deepseek-moe-16b-base"
    assert kv_cache_bytes_per_token(deepseek_moe_16b.CONFIG) == 2 * 28 * 16 * 128 * 2
    assert set(committed["planned"]["recipes"]) == {"bf16", *deepseek_moe_16b.RECIPES}


def test_entry_without_weights_names_the_command_that_produces_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    command = "ascq convert deepseek-ai/deepseek-moe-16b-base --recipe awq-int4 --out zoo/deepseek-moe-16b"
    with pytest.raises(
        AscqError, match="no weights yet: produce them with `" + command.replace("-", r"\-") + "`"
    ):
        require_weights(ENTRY)
    monkeypatch.setenv("ASCQ_ZOO", str(tmp_path))
    shutil.copytree(ENTRY, tmp_path / deepseek_moe_16b.NAME)
    with pytest.raises(SystemExit) as exit_info:
        main(["zoo", "verify", deepseek_moe_16b.NAME])
    assert exit_info.value.code == 1
    assert command in capsys.readouterr().err
    for argv in (["generate", str(ENTRY), "--prompt", "hello"], ["serve", str(ENTRY), "--port", "0"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert command in capsys.readouterr().err
    main(["zoo", "show", deepseek_moe_16b.NAME])
    out = capsys.readouterr().out
    assert "ascq serve zoo/deepseek-moe-16b" in out and "awq-int4" in out and "16.38 B" in out


def test_card_of_the_planned_entry_shows_the_plan() -> None:
    from huggingface_hub import ModelCard

    from ascq.zoo.card import render_card

    card = ModelCard(render_card(ENTRY))
    assert card.data.license_name == "deepseek" and card.data.base_model == deepseek_moe_16b.SOURCE
    assert "| `awq-int4` | `w4a16` | 8.8 GiB | 9.7 GiB | 22.8 GiB |" in card.text
    assert deepseek_moe_16b.COMMANDS["convert"] in card.text and "scheme: W4A16_ASYM" in card.text


def test_zoo_list_shows_a_plan_as_a_plan() -> None:
    from ascq.zoo.listing import format_table, list_entries

    rows = [
        line for line in format_table(list_entries(ENTRY.parent)).splitlines() if line.startswith(ENTRY.name)
    ]
    assert len(rows) == 1 and "plan (no weights)" in rows[0]
