"""The native bf16-weight kernel (bf16_mm.c) against float64 math, and its batch invariance: a row's result is
the same bits whatever else is in the batch (speculative verification rows must equal the same token decoded
alone)."""

from __future__ import annotations

import pytest
import torch
from native_support import needs_native

from ascq.kernels import QuantLinearWeights, cpu, native

LIB = native.load()
pytestmark = needs_native


@pytest.mark.parametrize("shape", [(96, 64), (130, 576), (7, 1536)])
def test_bf16_mm_matches_float64_and_is_batch_invariant(shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g).to(torch.bfloat16)
    x = torch.randn(31, shape[1], generator=g)  # the kernel serves any M (the threshold is the caller's)
    y = native.bf16_mm(LIB, x, weight)
    exact = x.double() @ weight.double().T
    assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    for rows in (slice(0, 1), slice(2, 5), slice(3, 4)):
        assert torch.equal(native.bf16_mm(LIB, x[rows], weight), y[rows])


def test_small_m_linear_applies_only_where_the_kernel_runs():
    weight = torch.randn(32, 64).to(torch.bfloat16)
    assert cpu.bf16_small_m_linear(torch.randn(2, 64), weight) is not None
    assert cpu.bf16_small_m_linear(torch.randn(cpu.DENSE_BF16_MAX_M, 64), weight) is None  # fp32 GEMM path
    assert cpu.bf16_small_m_linear(torch.randn(2, 64), weight.float()) is None
    # K % 16
    assert cpu.bf16_small_m_linear(torch.randn(2, 40), torch.randn(32, 40).to(torch.bfloat16)) is None
    with pytest.raises(ValueError, match="rejected"):
        native.bf16_mm(LIB, torch.randn(2, 40), torch.randn(32, 40).to(torch.bfloat16))


@pytest.mark.parametrize("checkpoint_dtype", [torch.bfloat16, torch.float32])
def test_fp32_engine_keeps_a_bf16_exact_weight_in_bf16_and_its_results_in_fp32(checkpoint_dtype):
    """A bf16 checkpoint served in fp32 (`--dtype auto` on the CPU): the same weight values at half the
    bytes, fp32 results on both sides of the small-M threshold; weights bf16 cannot hold stay fp32."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(40, 64, generator=g) * 0.05).bfloat16()
    bias = torch.randn(40, generator=g)
    prepared = cpu.prepare_linear(QuantLinearWeights("dense", weight.to(checkpoint_dtype), bias=bias))
    assert prepared.weight.dtype == torch.bfloat16
    for rows in (1, 5, cpu.DENSE_BF16_MAX_M + 3):
        x = torch.randn(rows, 64, generator=g)
        y = cpu.linear(x, prepared)
        assert y.dtype == torch.float32
        exact = x.double() @ weight.double().T + bias.double()
        assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), rows
        if rows < cpu.DENSE_BF16_MAX_M:  # the native kernel's own rows, unrounded
            assert torch.equal(y, native.bf16_mm(LIB, x, weight) + bias)
    fp32_values = torch.randn(40, 64, generator=g)
    assert cpu.prepare_linear(QuantLinearWeights("dense", fp32_values)).weight.dtype == torch.float32
