"""`ascq convert` on the fixtures: every shipped recipe, transformers interop, quality, bad input,
atomicity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers_check import assert_transformers_matches_reference

from ascq.evaluate import eval_windows, load_eval_token_ids, perplexity
from ascq.formats.manifest import read_manifest, verify_files
from ascq.quantize.reference_forward import reference_logits
from ascq.zoo.verify import verify_entry

RECIPES = [("w8a8",), ("w8a8-static",), ("w4a16-rtn",), ("w8a16",), ("w8a8", "fp8-kv")]
EXPECTED = {  # recipe -> (format, q_proj tensors and dtypes)
    "w8a8": ("int-quantized", {"weight": torch.int8, "weight_scale": torch.bfloat16}),
    "w8a8-static": (
        "int-quantized",
        {"weight": torch.int8, "weight_scale": torch.bfloat16, "input_scale": torch.bfloat16},
    ),
    "w4a16-rtn": (
        "pack-quantized",
        {
            "weight_packed": torch.int32,
            "weight_scale": torch.bfloat16,
            "weight_shape": torch.int64,
            "weight_zero_point": torch.int32,
        },
    ),
    "w8a16": (
        "pack-quantized",
        {"weight_packed": torch.int32, "weight_scale": torch.bfloat16, "weight_shape": torch.int64},
    ),
}


def _tensors(entry) -> dict[str, torch.Tensor]:
    index = entry / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for file in files:
        with safe_open(entry / file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipes", RECIPES, ids="+".join)
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_moe_dir"])
def test_each_recipe_converts_each_fixture(request, converted_entry, recipes, fixture):
    base = request.getfixturevalue(fixture)
    entry = converted_entry(base, recipes)
    manifest = read_manifest(entry)
    verify_files(entry, manifest)
    # `ascq zoo verify`
    assert any("tensor names match compressed-tensors" in line for line in verify_entry(entry))
    qconfig = json.loads((entry / "config.json").read_text())["quantization_config"]
    fmt, q_proj = EXPECTED[recipes[0]]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == fmt
    assert qconfig["quantization_status"] == "compressed" and "lm_head" in qconfig["ignore"]
    tensors = _tensors(entry)
    layer = "model.layers.1."
    assert {
        k[len(layer + "self_attn.q_proj.") :]: v.dtype
        for k, v in tensors.items()
        if k.startswith(layer + "self_attn.q_proj.")
    } == q_proj
    assert tensors["lm_head.weight"].dtype == tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    if fixture == "tiny_deepseek_moe_dir":  # router kept in bf16 and listed in ignore; experts quantized
        assert (
            tensors[layer + "mlp.gate.weight"].dtype == torch.bfloat16
            and layer + "mlp.gate" in qconfig["ignore"]
        )
        assert any(k.startswith(layer + "mlp.experts.15.down_proj.weight_") for k in tensors)
        assert any(k.startswith(layer + "mlp.shared_experts.up_proj.weight_") for k in tensors)
    if "fp8-kv" in recipes:
        assert qconfig["kv_cache_scheme"]["type"] == "float"
        assert (
            tensors[layer + "self_attn.k_scale"].shape == (1,)
            and tensors[layer + "self_attn.v_scale"].item() > 0
        )
    assert manifest["recipe"]["names"] == list(recipes) and manifest["calibration"]["num_samples"] > 0
    metrics = manifest["metrics"]
    assert metrics["perplexity"] < 1.2 * metrics["perplexity_base"]  # every recipe is a usable model


def _eval_ids(model_dir, num_windows: int):
    return eval_windows(load_eval_token_ids(model_dir), 256)[:num_windows]


@pytest.mark.slow
@pytest.mark.parametrize("recipes", [("w8a8",), ("w4a16-rtn",), ("w8a8", "fp8-kv")], ids="+".join)
def test_transformers_loads_and_matches_reference_forward(converted_entry, tiny_llama_dir, recipes):
    entry = converted_entry(tiny_llama_dir, recipes)
    assert_transformers_matches_reference(entry, tiny_llama_dir)  # 4 x 256 = 1024 positions


@pytest.mark.slow
def test_manifest_perplexity_is_the_checkpoints(converted_entry, tiny_deepseek_moe_dir):
    """The streamed perplexity-after equals the reference forward of what was written (MoE + fp8 KV)."""
    entry = converted_entry(tiny_deepseek_moe_dir, ("w8a8", "fp8-kv"))
    ids = load_eval_token_ids(tiny_deepseek_moe_dir)
    ppl = perplexity(lambda batch: reference_logits(entry, batch), ids, 256, batch_size=64)
    assert ppl == pytest.approx(read_manifest(entry)["metrics"]["perplexity"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_moe_dir"])
def test_w8a8_perplexity_within_2_percent(request, converted_entry, fixture):
    metrics = read_manifest(converted_entry(request.getfixturevalue(fixture), ("w8a8",)))["metrics"]
    assert metrics["perplexity"] <= 1.02 * metrics["perplexity_base"]


@pytest.mark.slow
def test_smoothing_beats_no_smoothing_on_outlier_stress(converted_entry, tiny_llama_dir, tmp_path):
    """On tiny-llama's outlier-stress variant (k=30 channels, function-preserving) SmoothQuant must help
    w8a8."""
    from ascq.quantize.outlier_stress import write_outlier_stress

    stress = write_outlier_stress(tiny_llama_dir, tmp_path / "tiny-llama-outlier-stress")
    recipe = tmp_path / "w8a8-nosmooth.yaml"
    recipe.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {targets: [Linear], scheme: W8A8}\n"
    )
    smoothed = read_manifest(converted_entry(stress, ("w8a8",)))["metrics"]
    plain = read_manifest(converted_entry(stress, (str(recipe),)))["metrics"]
    assert smoothed["perplexity_base"] == pytest.approx(plain["perplexity_base"])
    assert smoothed["perplexity"] < plain["perplexity"]
