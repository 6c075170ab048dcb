"""ascq.core.qmath against compressed-tensors' own functions and plain-torch math; the writer's bytes."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp

from ascq.core import qmath
from ascq.formats import compressed_tensors as ct
from ascq.quantize import observer
from ascq.quantize.modifier import QuantizedLinear
from ascq.quantize.schemes import LinearTarget, RecipeScheme

WEIGHT_ARGS = [
    QuantizationArgs(num_bits=8, strategy="channel", symmetric=True),
    QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False),
    QuantizationArgs(num_bits=4, strategy="group", group_size=64, symmetric=True),
    QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True),
    QuantizationArgs(num_bits=4, strategy="channel", symmetric=False),
]


def _weight(seed: int = 0, shape=(48, 128)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier
    w[5] = w[5].abs()  # a row without negatives (asymmetric zero point at the bottom of the range)
    return w


@pytest.mark.parametrize("num_bits,symmetric", [(8, True), (4, True), (4, False), (8, False)])
def test_qparams_match_compressed_tensors(num_bits, symmetric):
    g = torch.Generator().manual_seed(1)
    lo, hi = -torch.rand(64, generator=g), torch.rand(64, generator=g)
    lo[0], hi[1] = 0.3, -0.2  # ranges that exclude zero get widened to include it
    args = QuantizationArgs(num_bits=num_bits, symmetric=symmetric, strategy="channel")
    ct_scale, ct_zp = calculate_qparams(lo, hi, args)
    scale, zp = qmath.compute_qparams(lo, hi, num_bits, symmetric)
    torch.testing.assert_close(scale, ct_scale, rtol=1e-6, atol=0)
    assert torch.equal(zp.to(torch.int32), ct_zp.to(torch.int32))


@pytest.mark.parametrize(
    "args", WEIGHT_ARGS, ids=lambda a: f"int{a.num_bits}-{a.strategy}-{'sym' if a.symmetric else 'asym'}"
)
def test_weight_quantize_dequantize_match_compressed_tensors(args):
    w = _weight()
    q, scale, zp = observer.quantize_weight(w, args)
    ct_q = quantize(w, scale, zp, args, dtype=torch.int8)
    assert torch.equal(q, ct_q)
    torch.testing.assert_close(
        qmath.dequantize_weight(q, scale, zp, args), dequantize(ct_q, scale, zp, args), rtol=0, atol=0
    )
    torch.testing.assert_close(
        observer.fake_quantize_weight(w, args), fake_quantize(w, scale, zp, args), rtol=0, atol=1e-7
    )


@pytest.mark.parametrize(
    "args", WEIGHT_ARGS, ids=lambda a: f"int{a.num_bits}-{a.strategy}-{'sym' if a.symmetric else 'asym'}"
)
def test_weight_quantization_plain_math(args):
    """Values in the signed range, max error half a step, the extremes hit the range ends."""
    w = _weight(2)
    q, scale, zp = observer.quantize_weight(w, args)
    qmin, qmax = qmath.int_range(args.num_bits)
    assert q.dtype == torch.int8 and q.min() >= qmin and q.max() <= qmax
    grouped = qmath.to_groups(w, args.strategy, args.group_size)
    step = scale.float().reshape(grouped.shape[0], -1, 1)
    error = (qmath.dequantize_weight(q, scale, zp, args) - w).abs()
    assert (qmath.to_groups(error, args.strategy, args.group_size) <= step / 2 + 1e-6).all()
    if args.symmetric:
        assert zp is None
        expected = grouped.abs().amax(-1, keepdim=True) / ((qmax - qmin) / 2)
        torch.testing.assert_close(step, expected)
    else:
        assert zp.dtype == torch.int8 and zp.min() >= qmin and zp.max() <= qmax
        assert q[5].min() == qmin  # an all-positive row: 0 maps to the lowest code


def test_scale_rounded_to_checkpoint_dtype_before_rounding_values():
    w = _weight(3)
    args = WEIGHT_ARGS[0]
    q, scale, _ = observer.quantize_weight(w, args, torch.bfloat16)
    assert scale.dtype == torch.bfloat16
    assert torch.equal(q, quantize(w, scale, None, args, dtype=torch.int8))


def test_per_token_quantizer_is_the_serving_rule():
    """vLLM's scaled_int8_quant / vllm-ascend's npu_dynamic_quant: scale = absmax / 127 (fp32), round half to
    even, saturate; not compressed-tensors' calibration-time absmax / 127.5."""
    x = torch.randn(2, 16, 64) * torch.linspace(0.1, 5, 64)
    x[0, 0] = 0.0  # a zero row: scale 0, q 0
    x[0, 1, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale exactly 1: ties round to even
    q, scale = qmath.quantize_per_token(x)
    absmax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(scale, absmax / 127) and scale.dtype == torch.float32
    assert torch.equal(q[0, 0], torch.zeros(64)) and q[0, 1, :4].tolist() == [127.0, 0.0, 2.0, -2.0]
    plain = (
        torch.where(absmax > 0, x / torch.where(absmax > 0, absmax / 127, 1.0), 0.0).round().clamp(-128, 127)
    )
    assert torch.equal(q, plain)
    assert torch.equal(qmath.per_token_fake_quantize(x), q * scale)
    args = QuantizationArgs(num_bits=8, strategy="token", symmetric=True, dynamic=True)
    ct_scale, _ = compute_dynamic_scales_and_zp(x[1:], args, module=None)
    torch.testing.assert_close(ct_scale, absmax[1:] / 127.5)  # the library's calibration rule differs


def test_static_and_fp8_scales_match_compressed_tensors():
    x = torch.randn(4, 32, 64) * 3
    absmax = x.abs().max()
    int_args = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True)
    ct_scale, _ = calculate_qparams(-absmax.reshape(1), absmax.reshape(1), int_args)
    torch.testing.assert_close(qmath.static_scale(absmax, 8, torch.float32), ct_scale)
    fp8_args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    ct_scale, ct_zp = calculate_qparams(-absmax.reshape(1), absmax.reshape(1), fp8_args)
    scale = qmath.fp8_scale(absmax, torch.float32)
    torch.testing.assert_close(scale, ct_scale)
    torch.testing.assert_close(
        qmath.fp8_fake_quantize(x, scale), fake_quantize(x, ct_scale, ct_zp, fp8_args), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "args,input_args",
    [
        (WEIGHT_ARGS[0], QuantizationArgs(num_bits=8, strategy="token", symmetric=True, dynamic=True)),
        (QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False), None),
        (QuantizationArgs(num_bits=8, strategy="channel", symmetric=True), None),
    ],
)
def test_written_tensors_unpack_to_the_chosen_values(args, input_args):
    """int-quantized / pack-quantized tensors (compressed-tensors' compressor) give back q, scale and zero
    point, through unpack_from_int32 and through ascq's decompress_linear; their names/dtypes/shapes are the
    specs'."""
    w = _weight(4)
    q, scale, zp = observer.quantize_weight(w, args, torch.bfloat16)
    owner = RecipeScheme("test", {}, [])
    target = LinearTarget(args, input_args, owner)
    out = ct.compress_linear(args, input_args, QuantizedLinear(q, scale, zp))
    stored = {k: (str(v.dtype), tuple(v.shape)) for k, v in out.items()}
    dtypes = {"I8": "torch.int8", "I32": "torch.int32", "I64": "torch.int64", "BF16": "torch.bfloat16"}
    specs = ct.linear_tensor_specs(args, input_args, *w.shape)
    assert stored == {k: (dtypes[d], shape) for k, (d, shape) in specs.items()}
    back = ct.decompress_linear(out, args.num_bits)
    assert torch.equal(back["weight"], q) and torch.equal(back["weight_scale"], scale)
    assert (zp is None and "zero_point" not in back) or torch.equal(back["zero_point"], zp)
    assert out["weight_scale"].dtype == torch.bfloat16 and torch.equal(out["weight_scale"], scale)
    if input_args is not None:  # W8A8: int8 weight as is
        assert out["weight"].dtype == torch.int8 and torch.equal(out["weight"], q)
        return
    assert out["weight_packed"].dtype == torch.int32 and out["weight_shape"].tolist() == list(w.shape)
    assert torch.equal(unpack_from_int32(out["weight_packed"], args.num_bits, w.shape), q)
    if zp is not None:
        unpacked_zp = unpack_from_int32(out["weight_zero_point"], args.num_bits, scale.shape, packed_dim=0)
        assert torch.equal(unpacked_zp, zp)
    else:
        assert "weight_zero_point" not in out
    assert QuantizationScheme(targets=["Linear"], weights=args) == target.scheme


def test_mse_observer_shrinks_ranges_to_lower_the_weight_error_and_unknown_observers_are_refused():
    from compressed_tensors.quantization import QuantizationArgs

    from ascq.core import qmath
    from ascq.quantize.schemes import UnsupportedError, parse_recipe_scheme

    torch.manual_seed(0)
    w = torch.randn(64, 256)
    w[3, 5] = 8.0  # one outlier: its group's range is worth shrinking
    errors = {}
    for name in ("minmax", "mse"):
        args = QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=64, symmetric=False, observer=name
        )
        low, high = observer.weight_ranges(qmath.to_groups(w, "group", 64), args, torch.float32)
        errors[name] = (observer.fake_quantize_weight(w, args) - w).pow(2).mean()
        assert (high <= w.view(64, 4, 64).amax(-1)).all() and (low >= w.view(64, 4, 64).amin(-1)).all()
    assert errors["mse"] < errors["minmax"]
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}
    for bad in ({"observer": "histogram"}, {"observer": "mse", "observer_kwargs": {"patience": 3}}):
        with pytest.raises(UnsupportedError, match="observer"):
            parse_recipe_scheme(
                "GPTQModifier",
                {"config_groups": {"g": {"targets": ["Linear"], "weights": {**weights, **bad}}}},
            )


def test_mse_observer_matches_a_per_group_loop_across_chunks(monkeypatch):
    """The chunked in-place search picks, per group, the shrink a plain loop over groups and steps picks."""
    from compressed_tensors.quantization import QuantizationArgs

    from ascq.core import qmath

    # chunk edges inside the weight, a ragged last one
    monkeypatch.setattr(observer, "MSE_CHUNK_ELEMENTS", 3 * 64 + 5)
    torch.manual_seed(1)
    w = torch.randn(10, 4, 64) * torch.rand(10, 4, 1)
    w[2, 1, 7] = 9.0
    args = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=64, symmetric=False, observer="mse"
    )
    low, high = observer.weight_ranges(w, args, torch.float32)
    for r in range(10):
        for g in range(4):
            x = w[r, g]
            errors = []
            for step in range(21):
                shrink = 1 - step / 100
                scale, zero = qmath.compute_qparams(x.min() * shrink, x.max() * shrink, 4, False)
                q = qmath.fake_quantize(x, scale, zero, 4)
                errors.append(((q - x).abs() ** 2.4).sum().item())
            shrink = 1 - errors.index(min(errors)) / 100
            assert high[r, g].item() == pytest.approx(x.max().item() * shrink, rel=1e-6)
            assert low[r, g].item() == pytest.approx(x.min().item() * shrink, rel=1e-6)
