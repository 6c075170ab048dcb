"""Float zero points (compressed-tensors `zp_dtype`) end to end: every kernel path against plain-PyTorch
dequant, the NPU backend through the torch_npu emulator, the engine against a plain transformers model holding
the dequantized weights, the recipe override and its validation, and integer zero points kept for other
sources. The converter side (a Q4_1-style source kept exactly by every int4 recipe) is in
tests/test_group_size_fit.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine
from test_group_size_fit import CONFIG, _convert, _gguf_blocked, _quantization_config
from test_kernels import independent_linear, rel_error
from test_runtime_models import reference_greedy_batch, run_greedy

from ascq.core import qmath
from ascq.core.errors import AscqError, UnsupportedError
from ascq.formats.manifest import read_manifest
from ascq.kernels import QuantLinearWeights, get_backend
from ascq.quantize.recipe import load_recipes
from ascq.quantize.synthetic import write_synthetic_checkpoint


def float_zero_weights(
    scheme: str,
    out_features: int,
    in_features: int,
    group_size: int | None,
    zp_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> QuantLinearWeights:
    gen = torch.Generator().manual_seed(seed)
    half = 8 if scheme == "w4a16" else 128
    groups = in_features // group_size if group_size else 1
    q = torch.randint(-half, half, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = (torch.rand(out_features, groups, generator=gen) * 0.01 + 0.002).to(torch.bfloat16)
    zero = ((torch.rand(out_features, groups, generator=gen) * 2 - 1) * (half - 1)).to(zp_dtype)
    assert not torch.equal(zero.float(), zero.float().round())
    return QuantLinearWeights(
        scheme, q, scale, zero, group_size, bias=torch.randn(out_features, generator=gen) * 0.1
    )


# (scheme, group size, dtype, the cpu kernel that must serve it)
CPU_CASES = [
    ("w4a16", 32, torch.bfloat16, "native"),
    ("w4a16", 64, torch.bfloat16, "native"),
    ("w4a16", None, torch.bfloat16, "native"),
    ("w8a16", 32, torch.bfloat16, "native"),
    ("w4a16", 32, torch.float32, "dequant"),
    ("w8a16", None, torch.float32, "dequant"),
]


@pytest.mark.parametrize(
    ("scheme", "group_size", "dtype", "kernel"),
    CPU_CASES,
    ids=[f"{c[0]}-g{c[1]}-{str(c[2])[6:]}-{c[3]}" for c in CPU_CASES],
)
def test_cpu_kernels_take_float_zero_points(scheme, group_size, dtype, kernel, monkeypatch):
    w = float_zero_weights(scheme, 64, 256, group_size)
    cpu = get_backend("cpu")
    prepared = cpu.prepare_linear(w, dtype)
    assert prepared.kernel == kernel
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for num_rows in (1, 5, 200):  # 200: large M dequantizes from the packed copy
        x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(num_rows))
        assert (
            rel_error(cpu.linear(x.to(dtype), prepared), independent_linear(x.to(dtype).float(), w))
            < tolerance
        )
    for backend in ("reference", "cuda"):  # cuda's CPU-runnable dequant path
        fast = get_backend(backend)
        x = torch.randn(5, 256).to(dtype)
        assert (
            rel_error(fast.linear(x, fast.prepare_linear(w, dtype)), independent_linear(x.float(), w))
            < tolerance
        )


def test_int4pack_takes_float_zero_points_without_the_native_kernel(monkeypatch):
    from ascq.kernels import native

    monkeypatch.setattr(native, "load", lambda: None)
    w = float_zero_weights("w4a16", 64, 256, 32)
    cpu = get_backend("cpu")
    prepared = cpu.prepare_linear(w, torch.bfloat16)
    assert prepared.kernel == "int4pack"
    for num_rows in (1, 260):
        x = torch.randn(num_rows, 256).bfloat16()
        assert rel_error(cpu.linear(x, prepared), independent_linear(x.float(), w)) < 2e-2


def test_integer_activation_schemes_refuse_float_zero_points():
    w = float_zero_weights("w4a16", 64, 256, None)
    with pytest.raises(
        UnsupportedError, match="float weight zero points are supported for w4a16 and w8a16 only"
    ):
        QuantLinearWeights("w4a8_dynamic", w.weight, w.weight_scale, w.zero_point)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, None])
def test_npu_weight_quant_matmul_takes_a_float_antiquant_offset(npu_backend, dtype, group_size):
    """npu_weight_quant_batchmatmul computes (w + antiquant_offset) * antiquant_scale with a float offset in
    the compute dtype: a float zero point is its native form (run on the EMULATOR, not on Ascend hardware)."""
    w = float_zero_weights("w4a16", 96, 128, group_size)
    prepared = npu_backend.prepare_linear(w, dtype)
    assert prepared.offset.dtype == dtype and not torch.equal(
        prepared.offset.float(), prepared.offset.float().round()
    )
    x = torch.randn(7, 128).to(dtype)
    got = npu_backend.linear(x, prepared)
    torch.testing.assert_close(got.float(), independent_linear(x.float(), w).float(), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-192")
    write_synthetic_checkpoint(path, CONFIG)
    return path


@pytest.fixture(scope="module")
def q4_1_rtn(synthetic: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(source, its w4a16-rtn entry in the source-grid mode, `zp_dtype: float`) of a Q4_1-style source."""
    root = tmp_path_factory.mktemp("fzp")
    _gguf_blocked(synthetic, root / "q4_1", "Q4_1")
    return root / "q4_1", _convert(root / "q4_1", _recipe(root, "      zp_dtype: float\n"), root / "rtn")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_equals_plain_pytorch_dequantized_model(q4_1_rtn, dtype):
    """The engine (cpu backend) on a float-zero-point entry vs transformers' plain model whose linears hold
    (q - zp) * scale computed in plain PyTorch from the tensors safetensors reads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source, entry = q4_1_rtn
    stored = load_file(entry / "model.safetensors")
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    num_replaced = 0
    for name, module in plain.named_modules():
        if f"{name}.weight_zero_point" in stored:
            q, scale = stored[f"{name}.weight"].float(), stored[f"{name}.weight_scale"].float()
            zero = stored[f"{name}.weight_zero_point"]
            assert zero.dtype == torch.bfloat16 and not torch.equal(zero.float(), zero.float().round())
            groups = q.reshape(q.shape[0], scale.shape[1], -1)
            module.weight.data = ((groups - zero.float()[..., None]) * scale[..., None]).reshape(q.shape)
            num_replaced += 1
    assert num_replaced == 14
    prompts = [
        torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 30)
    ]
    expected = reference_greedy_batch(lambda ids: plain(ids).logits, prompts, 8)
    engine = make_engine(entry, dtype=dtype)
    got = run_greedy(engine, prompts, 8)
    agreement = (
        sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)) / 24
    )
    assert agreement == 1.0 if dtype == "float32" else agreement >= 0.75, (got, expected)


def _recipe(tmp_path: Path, extra: str, scheme: str = "W4A16_ASYM") -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      targets: [Linear]\n"
        f"      ignore: [lm_head]\n      scheme: {scheme}\n{extra}"
    )
    return str(path)


def test_recipe_zp_dtype_int_keeps_integer_zero_points_on_a_float_min_source(q4_1_rtn, tmp_path):
    source, _ = q4_1_rtn
    entry = _convert(source, _recipe(tmp_path, "      zp_dtype: int\n"), tmp_path / "int")
    group = _quantization_config(entry)["config_groups"]["group_0"]
    assert group["format"] == "pack-quantized" and group["weights"]["zp_dtype"] == "torch.int8"
    [fit] = read_manifest(entry)["conversion"]["group_size_fits"]
    assert (fit["group_size"], fit["zp_dtype"]) == (64, None)  # the recipe's 128 fitted to the widths


def test_recipe_zp_dtype_float32_on_any_source(synthetic, tmp_path):
    entry = _convert(synthetic, _recipe(tmp_path, "      zp_dtype: float32\n"), tmp_path / "f32")
    group = _quantization_config(entry)["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["zp_dtype"]) == ("naive-quantized", "torch.float32")
    [fit] = read_manifest(entry)["conversion"]["group_size_fits"]
    assert (fit["zp_dtype"], fit["zp_dtype_from"]) == ("float32", "recipe")


@pytest.mark.parametrize(
    ("extra", "scheme", "message"),
    [
        (
            "      zp_dtype: float64\n",
            "W4A16_ASYM",
            "QuantizationModifier: zp_dtype 'float64' is not supported; use one of auto, float, int",
        ),
        ("      zp_dtype: bfloat16\n", "W4A16", "needs asymmetric weights"),
        ("      zp_dtype: bfloat16\n", "W8A8", "needs asymmetric weights"),
        ("      zp_dtype: float\n", "W4A16", "needs asymmetric weights"),
    ],
)
def test_bad_zp_dtype_is_refused_in_one_line(tmp_path, extra, scheme, message):
    with pytest.raises(AscqError, match=message) as info:
        load_recipes([_recipe(tmp_path, extra, scheme)])
    assert "\n" not in str(info.value)


def test_config_group_zp_dtype_is_validated(tmp_path):
    path = tmp_path / "groups.yaml"
    path.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      config_groups:\n"
        "        group_0:\n          targets: [Linear]\n          weights: {num_bits: 4, symmetric: false, "
        "strategy: group, group_size: 32, zp_dtype: int32}\n"
    )
    with pytest.raises(UnsupportedError, match="group_0: zp_dtype int32 is not supported"):
        load_recipes([str(path)])
    path.write_text(path.read_text().replace("int32", "bfloat16"))
    [scheme] = load_recipes([str(path)]).schemes()
    assert qmath.float_zero_point(scheme.config_groups["group_0"].weights)


def test_non_gguf_source_keeps_integer_zero_points(tiny_llama_dir, tmp_path):
    """tiny-llama (no GGUF provenance): w4a16-rtn stays pack-quantized with integer zero points, as before."""
    entry = _convert(tiny_llama_dir, "w4a16-rtn", tmp_path / "tiny")
    group = _quantization_config(entry)["config_groups"]["group_0"]
    assert group["format"] == "pack-quantized" and "zp_dtype" not in group["weights"]
    assert read_manifest(entry)["conversion"]["group_size_fits"] == []


def test_compute_qparams_float_zero_point_is_unrounded_from_the_written_scale():
    lo, hi = torch.tensor([-0.3, -1.0]), torch.tensor([0.9, 0.2])
    scale, zero = qmath.compute_qparams(lo, hi, 4, False, torch.bfloat16, torch.float32)
    assert zero.dtype == torch.float32 and scale.dtype == torch.bfloat16
    torch.testing.assert_close(zero, -8 - lo / scale.float())  # the minimum maps to q = -8 exactly
    _, int_zero = qmath.compute_qparams(lo, hi, 4, False, torch.bfloat16)
    assert int_zero.dtype == torch.int8 and (int_zero.float() - zero).abs().max() <= 0.5 + 1e-3
