"""`ascq convert --format msmodelslim`: the folder vllm-ascend's `--quantization ascend` loader expects.

The expectations below are written from vllm-ascend's loader (quant_config / modelslim_config: every layer
prefix is looked up as `<prefix>.weight` in quant_model_description.json, "FLOAT" = unquantized, fused shards
(q/k/v, gate/up, experts.0.*) must share a label; AscendW8A8LinearMethod / AscendW8A8DynamicLinearMethod
parameter names, shapes and dtypes) and checked against the compressed-tensors export of the same recipe.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from ascq.cli import main
from ascq.formats.msmodelslim import deq_scale_tensor
from ascq.kernels import QuantLinearWeights, reference

HEADER_KEYS = {"model_quant_type", "version", "group_size", "kv_cache_type"}
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")


def expected_tensors(label: str, out_features: int, in_features: int) -> dict[str, tuple[tuple, tuple]]:
    """local name -> (allowed dtypes, shape) for one linear, as vllm-ascend creates its parameters (bf16
    model)."""
    floats = (torch.bfloat16, torch.float16, torch.float32)
    spec = {
        "weight": ((torch.int8,), (out_features, in_features)),
        "weight_scale": (floats, (out_features, 1)),
        "weight_offset": (floats, (out_features, 1)),
    }
    if label == "W8A8":
        spec |= {
            "input_scale": (floats, (1,)),
            "input_offset": (floats + (torch.int8,), (1,)),
            "deq_scale": ((torch.float32,), (out_features,)),
            "quant_bias": ((torch.int32,), (out_features,)),
        }
    return spec


def read_entry(entry):
    description = json.loads((entry / "quant_model_description.json").read_text())
    return description, load_file(entry / "quant_model_weights.safetensors")


def read_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def check_loader_expectations(entry, base_dir, label: str) -> list[str]:
    description, tensors = read_entry(entry)
    assert description["model_quant_type"] == label and description["version"] and "group_size" in description
    labels = {k: v for k, v in description.items() if k not in HEADER_KEYS}
    assert set(labels) == set(tensors), "every tensor has a label and every label a tensor"
    config = json.loads((entry / "config.json").read_text())
    source_config = json.loads((base_dir / "config.json").read_text())
    assert "quantization_config" not in config and config == source_config
    source = read_checkpoint(base_dir)
    linears = sorted({name.rsplit(".", 1)[0] for name in tensors if LINEAR.search(name.rsplit(".", 1)[0])})
    assert linears, "no quantized linears written"
    for prefix in linears:
        assert labels[f"{prefix}.weight"] == label
        out_features, in_features = source[f"{prefix}.weight"].shape
        spec = expected_tensors(label, out_features, in_features)
        present = {name.rsplit(".", 1)[1] for name in tensors if name.rsplit(".", 1)[0] == prefix}
        assert present == set(spec), f"{prefix}: {sorted(present)} != {sorted(spec)}"
        for local, (dtypes, shape) in spec.items():
            tensor = tensors[f"{prefix}.{local}"]
            assert tensor.dtype in dtypes and tuple(tensor.shape) == shape, f"{prefix}.{local}"
            assert labels[f"{prefix}.{local}"] == label
        assert not tensors[f"{prefix}.weight_offset"].any()
    for (
        name,
        tensor,
    ) in tensors.items():  # everything else: a source tensor (smoothing may fold into norms), FLOAT
        if name.rsplit(".", 1)[0] not in linears:
            assert labels[name] == "FLOAT" and tensor.dtype == source[name].dtype, name
            assert tensor.shape == source[name].shape, name
    assert {n for n in source if n.rsplit(".", 1)[0] not in linears} <= set(tensors)
    for a, b in (("q_proj", "k_proj"), ("q_proj", "v_proj"), ("gate_proj", "up_proj")):  # fused shards agree
        for key in labels:
            if f".{a}.weight" in key:
                assert labels[key.replace(a, b)] == labels[key]
    return linears


def check_same_quantization_as_compressed_tensors(ms_entry, ct_entry, linears) -> None:
    _, ms = read_entry(ms_entry)
    ct = read_checkpoint(ct_entry)
    for prefix in linears:
        assert torch.equal(ms[f"{prefix}.weight"], ct[f"{prefix}.weight"]), prefix
        assert torch.equal(ms[f"{prefix}.weight_scale"].float(), ct[f"{prefix}.weight_scale"].float()), prefix
    for name, tensor in ms.items():
        if name.rsplit(".", 1)[0] not in linears:
            assert torch.equal(tensor, ct[name]), name


def test_w8a8_dynamic_export_matches_vllm_ascend_loader(tiny_llama_dir, npu_converted):
    entry = npu_converted(tiny_llama_dir, "w8a8", "msmodelslim")
    linears = check_loader_expectations(entry, tiny_llama_dir, "W8A8_DYNAMIC")
    assert len(linears) == 4 * 7
    check_same_quantization_as_compressed_tensors(entry, npu_converted(tiny_llama_dir, "w8a8"), linears)


def test_w8a8_static_export_identities(tiny_llama_dir, npu_converted):
    entry = npu_converted(tiny_llama_dir, "w8a8-static", "msmodelslim")
    linears = check_loader_expectations(entry, tiny_llama_dir, "W8A8")
    ct_entry = npu_converted(tiny_llama_dir, "w8a8-static")
    check_same_quantization_as_compressed_tensors(entry, ct_entry, linears)
    _, ms = read_entry(entry)
    ct = read_checkpoint(ct_entry)
    x = torch.randn(5, 256).to(torch.bfloat16)
    for prefix in linears:
        t = {k.rsplit(".", 1)[1]: v for k, v in ms.items() if k.rsplit(".", 1)[0] == prefix}
        weight_sum = t["weight"].double().sum(dim=1)
        torch.testing.assert_close(
            t["deq_scale"], t["input_scale"].float() * t["weight_scale"].float().reshape(-1)
        )
        expected_bias = (-t["input_offset"].double() * weight_sum).round().to(torch.int32)  # no bias in Llama
        assert torch.equal(t["quant_bias"], expected_bias)
        assert torch.equal(t["input_scale"].float(), ct[f"{prefix}.input_scale"].float().reshape(1))
        # vllm-ascend's apply in plain torch == the reference linear
        if prefix.endswith(("q_proj", "gate_proj")):
            rows = x[:, : t["weight"].shape[1]]
            x_int8 = (
                (rows.float() / t["input_scale"].float() + t["input_offset"].float()).round().clamp(-128, 127)
            )
            y = (x_int8.double() @ t["weight"].double().T + t["quant_bias"].double()) * t[
                "deq_scale"
            ].double()
            w = QuantLinearWeights(
                "w8a8_static",
                ct[f"{prefix}.weight"],
                ct[f"{prefix}.weight_scale"],
                input_scale=ct[f"{prefix}.input_scale"],
            )
            expected = reference.linear(rows, reference.prepare_linear(w)).float()
            torch.testing.assert_close(
                y.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()
            )


def test_moe_export_keeps_per_expert_names(tiny_deepseek_moe_dir, npu_converted):
    entry = npu_converted(tiny_deepseek_moe_dir, "w8a8", "msmodelslim")
    linears = check_loader_expectations(entry, tiny_deepseek_moe_dir, "W8A8_DYNAMIC")
    description, _ = read_entry(entry)
    config = json.loads((tiny_deepseek_moe_dir / "config.json").read_text())
    for layer in range(1, config["num_hidden_layers"]):
        assert description[f"model.layers.{layer}.mlp.gate.weight"] == "FLOAT"  # the router stays float
        for expert in range(config["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{expert}.{proj}" in linears
        assert f"model.layers.{layer}.mlp.shared_experts.down_proj" in linears
    assert "model.layers.0.mlp.gate_proj" in linears  # dense first layer


def test_fp16_models_get_int64_deq_scale():
    deq = torch.tensor([1.5e-4, 3.25e-3, 0.02])
    encoded = deq_scale_tensor(deq, torch.float16)
    assert encoded.dtype == torch.int64 and bool((encoded >> 32 == 0).all())
    assert torch.equal((encoded & 0xFFFFFFFF).to(torch.int32).view(torch.float32), deq)
    assert deq_scale_tensor(deq, torch.bfloat16).dtype == torch.float32


@pytest.mark.parametrize(
    "recipes,fmt",
    [
        (["w4a16-rtn"], "msmodelslim"),  # no msModelSlim label for weight-only int4
        (["w8a8", "fp8-kv"], "msmodelslim"),  # no FP8 KV cache in msModelSlim
        (["w8a8", "kv-int8-c8"], "compressed-tensors"),  # C8 scales only exist in msModelSlim
    ],
)
def test_unsupported_combinations_give_one_line_error(tiny_llama_dir, tmp_path, capsys, recipes, fmt):
    out = tmp_path / "entry"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "convert",
                str(tiny_llama_dir),
                *[a for r in recipes for a in ("--recipe", r)],
                "--format",
                fmt,
                "--out",
                str(out),
                "--num-samples",
                "2",
                "--seq-len",
                "32",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and err.startswith("error: ") and "\n" not in err and "msmodelslim" in err
    assert not out.exists()


def test_kv_int8_c8_scales_are_per_channel_key_value_maxima(tiny_llama_dir, npu_converted):
    """Layer 0 sees the embeddings unquantized, so its scales can be recomputed with transformers' own
    Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from ascq.quantize.calibration import load_calibration

    entry = npu_converted(tiny_llama_dir, "w8a8+kv-int8-c8", "msmodelslim")
    description, tensors = read_entry(entry)
    assert description["kv_cache_type"] == "C8"
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    channels = config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"]
    for layer in range(config["num_hidden_layers"]):
        for name in (
            "k_proj.kv_cache_scale",
            "k_proj.kv_cache_offset",
            "v_proj.kv_cache_scale",
            "v_proj.kv_cache_offset",
        ):
            key = f"model.layers.{layer}.self_attn.{name}"
            assert description[key] == "C8" and tensors[key].shape == (channels,), key
            assert (tensors[key] > 0).all() if "scale" in name else not tensors[key].any()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = load_calibration(None, AutoTokenizer.from_pretrained(tiny_llama_dir), 8, 128).input_ids
    attn, norm = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    with torch.no_grad():
        x = norm(model.model.embed_tokens(ids))
        heads = (ids.shape[0], ids.shape[1], -1, attn.head_dim)
        k, v = attn.k_proj(x).view(heads).transpose(1, 2), attn.v_proj(x).view(heads).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    for kv, states in (("k", k), ("v", v)):
        expected = states.abs().amax(dim=(0, 2)).reshape(-1) / 127
        got = tensors[f"model.layers.0.self_attn.{kv}_proj.kv_cache_scale"].float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-6)
