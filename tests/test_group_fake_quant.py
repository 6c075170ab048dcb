"""group_fake_quant.c against the torch path of `observer.fake_quantize_weight` (compute_qparams, grid_values,
dequantize): the same values bit for bit."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from ascq.core import qmath
from ascq.kernels import native
from ascq.quantize import observer

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels on this host")


def torch_fake_quantize(w: torch.Tensor, args: QuantizationArgs, scale_dtype: torch.dtype) -> torch.Tensor:
    q, scale, zero_point = observer.quantize_weight(w, args, scale_dtype)
    return qmath.dequantize_weight(q, scale, zero_point, args).to(w.dtype)


def weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g).exp()
    w[0] = 0.0  # all-zero rows: scale 0 -> eps, zero point 0/0
    w[1, :128] = 0.0
    w[2] = w[2].abs()  # all positive: the range's minimum clamps to 0
    w[3] = -w[3].abs()
    w[4, :] = 1e-30  # a scale that rounds to 0 in bf16/fp16
    w[5, 7] = 1e4  # an outlier
    return w


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "args",
    [
        dict(num_bits=4, symmetric=False, strategy="group", group_size=64),
        dict(num_bits=4, symmetric=True, strategy="group", group_size=32),
        dict(num_bits=8, symmetric=False, strategy="channel"),
        dict(num_bits=8, symmetric=True, strategy="group", group_size=128),
    ],
)
def test_matches_torch_bit_for_bit(args: dict, scale_dtype: torch.dtype) -> None:
    quant_args = QuantizationArgs(**args)
    assert observer._native_fake_quant(weights(0), quant_args, scale_dtype)
    for seed in range(3):
        w = weights(seed)
        expected = torch_fake_quantize(w, quant_args, scale_dtype)
        got = observer.fake_quantize_weight(w, quant_args, scale_dtype)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_bf16_weights_keep_their_dtype() -> None:
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=64)
    w = weights(1).bfloat16()
    got = observer.fake_quantize_weight(w, args, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch_fake_quantize(w, args, torch.bfloat16))


def test_mse_observer_and_float_zero_points_stay_on_torch() -> None:
    w = weights(0)
    mse = QuantizationArgs(num_bits=4, strategy="group", group_size=64, observer="mse")
    float_zp = QuantizationArgs(
        num_bits=4, symmetric=False, strategy="group", group_size=64, zp_dtype="float32"
    )
    assert not observer._native_fake_quant(w, mse, torch.float32)
    assert not observer._native_fake_quant(w, float_zp, torch.float32)


@pytest.mark.parametrize("num_tokens", [200, 40])  # more tokens than the group (Gram matrices), and fewer
@pytest.mark.parametrize("symmetric", [False, True])
def test_native_clip_search_picks_what_the_torch_search_picks(num_tokens: int, symmetric: bool) -> None:
    """The native search sums the errors in its own order, so a step may differ only where two steps' errors
    tie to float rounding: every pick must be as good as torch's to 1e-5 (relative), and almost all equal."""
    from ascq.quantize import awq

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g).exp()
    x = torch.randn(num_tokens, 256, generator=g) * torch.rand(256, generator=g).mul(4).exp()
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=64)
    config = awq.AWQSearchConfig(group_size=64)
    fake = lambda t: observer.fake_quantize_weight(t, args, torch.bfloat16)  # noqa: E731
    grid = observer.minmax_grid(w, args, torch.bfloat16)
    assert grid is not None
    expected = awq.search_clip(w, x, fake, config, rows_independent=True)
    got = awq.search_clip(w, x, fake, config, rows_independent=True, minmax_grid=grid)
    assert got.shape == expected.shape
    assert (got == expected).float().mean() > 0.99

    def errors(max_val: torch.Tensor) -> torch.Tensor:  # each group's partial-output error at these bounds
        bound = max_val.repeat_interleave(64, dim=1)
        d = (fake(torch.maximum(torch.minimum(w, bound), -bound)) - w).view(48, 4, 64)
        return torch.einsum("ngs,ogs->nog", x.view(-1, 4, 64), d).pow(2).mean(0)

    torch.testing.assert_close(errors(got), errors(expected), rtol=1e-5, atol=0)


def test_alpha_grid_on_the_native_kernel_gives_torch_losses_bit_for_bit() -> None:
    from torch import nn

    from ascq.quantize import awq

    torch.manual_seed(0)
    linears = [nn.Linear(128, 96, bias=False), nn.Linear(128, 64, bias=False)]
    x = torch.randn(40, 128) * torch.rand(128).mul(3).exp()
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32)
    fake = lambda t: observer.fake_quantize_weight(t, args, torch.bfloat16)  # noqa: E731

    def block() -> torch.Tensor:
        return torch.cat([lin(x) for lin in linears], dim=1)

    config = awq.AWQSearchConfig(group_size=32)
    before = [lin.weight.clone() for lin in linears]
    expected = awq.search_scales(awq.activation_mean(x), linears, block, fake, config, rows_independent=True)
    grids = [observer.minmax_grid(lin.weight, args, torch.bfloat16) for lin in linears]
    got = awq.search_scales(
        awq.activation_mean(x), linears, block, fake, config, rows_independent=True, minmax_grids=grids
    )
    assert got[2] == expected[2] and got[1] == expected[1] and torch.equal(got[0], expected[0])
    assert all(torch.equal(lin.weight, w) for lin, w in zip(linears, before, strict=True))
