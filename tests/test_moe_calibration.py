"""MoE calibration coverage (tiny calibration sets, dense fallback, finite scales), GPTQ's RTN fallback, and
the outlier-stress transform (function-preserving, plants outlier channels)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.formats.manifest import read_manifest, verify_files
from ascq.formats.safetensors import CheckpointReader
from ascq.quantize.architectures import load_architecture
from ascq.quantize.gptq_modifier import GPTQModifier
from ascq.quantize.layer_context import LayerContext
from ascq.quantize.moe_coverage import ExpertCoverage, dense_mlp_inputs
from ascq.quantize.outlier_stress import write_outlier_stress
from ascq.quantize.schemes import RecipeError, resolve_target
from ascq.reference.decoder import MLP as DeepseekMLP
from ascq.reference.deepseek_moe import load_deepseek


def _tensors(entry) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(entry.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_expert_coverage_report_and_dense_inputs():
    coverage = ExpertCoverage(8, {"mlp.experts.0": 30, "mlp.experts.1": 0, "mlp.experts.2": 7})
    assert [coverage.needs_dense(f"mlp.experts.{e}") for e in range(3)] == [False, True, True]
    assert coverage.report() == {
        "mlp": {"min_tokens": 8, "tokens_per_expert": [30, 0, 7], "dense_fallback": [1, 2]}
    }
    assert ExpertCoverage(0, {"mlp.experts.0": 0}).needs_dense("mlp.experts.0"), (
        "no tokens is never calibrated on"
    )
    torch.manual_seed(0)
    expert, x = DeepseekMLP(32, 16), torch.randn(2, 5, 32)
    inputs = dense_mlp_inputs(expert, [x])
    flat = x.reshape(10, 32)
    torch.testing.assert_close(
        inputs["down_proj"][0],
        torch.nn.functional.silu(flat @ expert.gate_proj.weight.t()) * (flat @ expert.up_proj.weight.t()),
    )
    torch.testing.assert_close(expert.down_proj(inputs["down_proj"][0]), expert(flat))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["awq-int4", "w4a16-gptq"])
def test_four_sample_moe_calibration_is_finite(
    converted_entry, tiny_deepseek_moe_dir, eval_text_path, tmp_path_factory, recipe
):
    eval_text = tmp_path_factory.getbasetemp() / "eval-20k.txt"
    eval_text.write_text(eval_text_path.read_text()[:20000])
    entry = converted_entry(tiny_deepseek_moe_dir, (recipe,), num_samples=4, seq_len=16, eval_text=eval_text)
    manifest = read_manifest(entry)
    verify_files(entry, manifest)
    tensors = _tensors(entry)
    scales = {k: v for k, v in tensors.items() if k.endswith("weight_scale")}
    assert len(scales) == 7 + 3 * (4 + 16 * 3 + 3)  # every quantized linear: dense layer 0, then MoE layers
    for name, scale in scales.items():
        assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all(), name
    for name, tensor in tensors.items():
        assert torch.isfinite(tensor.float()).all(), name
    (modifier,) = manifest["conversion"]["modifiers"]
    coverage = modifier["expert_coverage"]
    assert sorted(coverage) == [f"model.layers.{i}.mlp" for i in (1, 2, 3)]
    num_fallback = 0
    for block in coverage.values():
        counts = block["tokens_per_expert"]
        assert len(counts) == 16 and sum(counts) == 4 * 16 * 4  # samples x seq_len x top-k
        assert block["dense_fallback"] == [e for e, c in enumerate(counts) if c < 8]
        num_fallback += len(block["dense_fallback"])
    assert num_fallback > 0, "the 4-sample calibration should leave some experts under 8 routed tokens"
    assert math.isfinite(manifest["metrics"]["perplexity"])
    assert manifest["metrics"]["perplexity"] < 1.5 * manifest["metrics"]["perplexity_base"]


def _layer_context(model_dir, index: int, modifier, inputs: list[torch.Tensor]) -> LayerContext:
    arch = load_architecture(model_dir)
    reader = CheckpointReader(model_dir)
    prefix = arch.layer_prefix(index)
    layer = arch.build_layer(index, reader.get_prefix(prefix, torch.float32))
    targets = {}
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear) and (
            target := resolve_target(prefix + name, module, [modifier.quant_scheme()])
        ):
            targets[name] = target
    return LayerContext(index, prefix, arch, layer, inputs, targets, torch.bfloat16)


def test_gptq_cholesky_failure_falls_back_to_rtn_with_warning(tiny_llama_dir):
    modifier = GPTQModifier.from_args({"scheme": "W4A16_ASYM"})
    x = torch.randn(1, 32, 256)
    x[0, 3, 7] = float("inf")  # an overflowed activation: H is not finite, its factorisation fails
    ctx = _layer_context(tiny_llama_dir, 0, modifier, [x])
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.0\.self_attn\.q_proj.*round-to-nearest"):
        modifier.process_layer(ctx)
    assert "self_attn.q_proj" in ctx.report["gptq_rtn_fallback"]
    assert "model.layers.0.self_attn.q_proj" in modifier.summary()["rtn_fallbacks"]
    for result in ctx.results.values():
        assert torch.isfinite(result.scale.float()).all()


def test_modifier_arguments_are_validated():
    with pytest.raises(RecipeError, match="actorder"):
        GPTQModifier.from_args({"scheme": "W4A16_ASYM", "actorder": "group"})
    with pytest.raises(RecipeError, match="needs a scheme"):
        GPTQModifier.from_args({"block_size": 64})
    with pytest.raises(RecipeError, match="weighted_mse weights the mse observer's error"):
        # the preset's observer is minmax
        GPTQModifier.from_args({"scheme": "W4A16_ASYM", "weighted_mse": True})
    mse_group = {
        "targets": ["Linear"],
        "weights": {
            "num_bits": 4,
            "type": "int",
            "symmetric": False,
            "strategy": "group",
            "group_size": 32,
            "observer": "mse",
        },
    }
    assert GPTQModifier.from_args({"config_groups": {"g": mse_group}, "weighted_mse": True}).weighted_mse
    from ascq.quantize.awq_modifier import AWQModifier

    with pytest.raises(RecipeError, match="unknown argument 'alpha'"):
        AWQModifier.from_args({"alpha": 0.5})
    with pytest.raises(RecipeError, match="max_shrink"):
        AWQModifier.from_args({"scheme": "W4A16_ASYM", "max_shrink": 1.5})


def _eval_batch(model_dir, num_windows: int = 2) -> torch.Tensor:
    return eval_windows(load_eval_token_ids(model_dir), 256)[:num_windows]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_moe_dir"])
def test_outlier_stress_preserves_logits_and_plants_outliers(request, fixture, tmp_path):
    base = request.getfixturevalue(fixture)
    stress = write_outlier_stress(base, tmp_path / f"{base.name}-outlier-stress", k=30.0, num_channels=4)
    manifest = read_manifest(stress)
    verify_files(stress, manifest)
    channels = manifest["stress_test"]["channels"]
    ids = _eval_batch(base)
    captured = {}
    if json.loads((base / "config.json").read_text())["model_type"] == "deepseek":
        before, after = load_deepseek(base), load_deepseek(stress)
    else:
        from transformers import AutoModelForCausalLM

        before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        after = AutoModelForCausalLM.from_pretrained(stress, dtype=torch.float32)
    norm = after.model.layers[1].post_attention_layernorm
    norm.register_forward_hook(lambda m, a, out: captured.setdefault("x", out.detach()))
    with torch.no_grad():
        logits_before = before(ids)
        logits_after = after(ids)
    logits_before = getattr(logits_before, "logits", logits_before)
    logits_after = getattr(logits_after, "logits", logits_after)
    logit_range = (logits_before.max() - logits_before.min()).item()
    assert (
        logits_after - logits_before
    ).abs().max().item() <= 2e-2 * logit_range  # bf16 rounding of W / k only
    assert (logits_after.argmax(-1) == logits_before.argmax(-1)).float().mean().item() >= 0.98
    channel_mean = captured["x"].abs().reshape(-1, captured["x"].shape[-1]).mean(0)
    others = torch.ones_like(channel_mean, dtype=torch.bool)
    others[channels] = False
    assert channel_mean[channels].min() > 10 * channel_mean[others].median()
