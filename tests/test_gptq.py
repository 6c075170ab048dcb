"""GPTQ against the unbatched textbook recursion (explicit inverse-Hessian downdates, float64) and against
RTN."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

from ascq.core import qmath
from ascq.quantize import observer
from ascq.quantize.gptq import CholeskyError, GPTQConfig, HessianAccumulator, gptq_quantize

ASYM = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)
SYM = QuantizationArgs(num_bits=4, type="int", strategy="channel", symmetric=True)


def qparams_for(args: QuantizationArgs):
    def qparams(
        w: torch.Tensor, importance: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, groups, len] -> [rows, groups]
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        return scale.float(), zero.float()

    return qparams


def quant_dequant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (torch.clamp(torch.round(w / scale) + zero, -8, 7) - zero) * scale


def correlated_inputs(num_tokens: int = 512, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5 + torch.eye(dim)
    return torch.randn(num_tokens, dim, generator=g) @ mix * (torch.rand(dim, generator=g) * 3 + 0.2)


def textbook_gptq(w: torch.Tensor, h: torch.Tensor, group: int, args: QuantizationArgs) -> torch.Tensor:
    """Column-by-column OBS update with the inverse Hessian downdated after every column (no Cholesky, no
    blocks)."""
    w = w.double().clone()
    h = h.double().clone()
    h.diagonal().add_(0.01 * h.diagonal().mean())
    h_inv = torch.linalg.inv(h)
    qparams = qparams_for(args)
    scale = zero = None
    for i in range(w.shape[1]):
        if i % group == 0:
            scale, zero = (t.double() for t in qparams(w[:, i : i + group].float()[:, None, :]))
        q = quant_dequant(w[:, i : i + 1], scale, zero)[:, 0]
        err = (w[:, i] - q) / h_inv[i, i]
        w[:, i:] -= err[:, None] * h_inv[i, i:][None, :]
        h_inv = h_inv - h_inv[:, i : i + 1] @ h_inv[i : i + 1, :] / h_inv[i, i]
    return w.float()


def output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return (x @ (w - q).t()).pow(2).mean().item()


def rtn(w: torch.Tensor, group: int, args: QuantizationArgs) -> torch.Tensor:
    qparams = qparams_for(args)
    chunks = [w[:, s : s + group] for s in range(0, w.shape[1], group)]
    return torch.cat([quant_dequant(c, *qparams(c[:, None, :])) for c in chunks], dim=1)


def test_hessian_accumulator_matches_batch_formula():
    x = correlated_inputs()
    acc = HessianAccumulator(64)
    for chunk in x.split(100):
        acc.add(chunk)
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-4)
    assert acc.num_tokens == 512


@pytest.mark.parametrize("block_size", [16, 128])
def test_gptq_matches_textbook_recursion(block_size):
    torch.manual_seed(0)
    x, w = correlated_inputs(), torch.randn(24, 64)
    h = 2 * x.t() @ x / x.shape[0]
    config = GPTQConfig(group_size=32, block_size=block_size)
    q, scale, zero = gptq_quantize(w, h, qparams_for(ASYM), (-8, 7), config)
    expected = textbook_gptq(w, h, 32, ASYM)
    close = torch.isclose(q, expected, rtol=1e-3, atol=1e-4).float().mean().item()
    assert close > 0.99, f"only {close:.3f} of the weights agree with the textbook recursion"
    assert scale.shape == (24, 2) and zero.shape == (24, 2)
    torch.testing.assert_close(
        quant_dequant(q, scale.repeat_interleave(32, 1), zero.repeat_interleave(32, 1)), q
    )


@pytest.mark.parametrize("actorder", [False, True])
@pytest.mark.parametrize("args,group", [(ASYM, 32), (SYM, None)])
def test_gptq_beats_round_to_nearest(actorder, args, group):
    torch.manual_seed(1)
    x, w = correlated_inputs(seed=1), torch.randn(32, 64)
    h = 2 * x.t() @ x / x.shape[0]
    config = GPTQConfig(group_size=group, actorder=actorder)
    q, _, _ = gptq_quantize(w, h, qparams_for(args), (-8, 7), config)
    assert output_error(x, w, q) < 0.8 * output_error(x, w, rtn(w, group or 64, args))


def test_gptq_dead_columns_and_cholesky_failure():
    torch.manual_seed(2)
    x, w = correlated_inputs(), torch.randn(8, 64)
    x[:, 5] = 0
    h = 2 * x.t() @ x / x.shape[0]
    q, _, _ = gptq_quantize(w, h, qparams_for(ASYM), (-8, 7), GPTQConfig(group_size=32))
    assert torch.isfinite(q).all() and (q[:, 5] == 0).all()
    with pytest.raises(CholeskyError):
        gptq_quantize(w, -torch.eye(64), qparams_for(ASYM), (-8, 7), GPTQConfig(group_size=32))


@pytest.mark.parametrize("actorder", [False, True])
def test_native_column_loop_matches_the_torch_loop(actorder, monkeypatch):
    from ascq.kernels import native
    from ascq.quantize import gptq

    if native.load() is None:
        pytest.skip(f"no native CPU kernels here: {native.unavailable_reason()}")
    torch.manual_seed(0)
    x = torch.randn(600, 256) * (torch.rand(256) * 4)
    w = torch.randn(72, 256)
    hessian = 2 * x.t() @ x / x.shape[0]
    config = GPTQConfig(group_size=64, block_size=96, actorder=actorder)  # groups straddle block edges

    def qparams(t: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return qmath.compute_qparams(t.amin(-1), t.amax(-1), 4, False, torch.float32, None)

    results = {}
    for use_native in (True, False):
        monkeypatch.setattr(gptq.native, "available", lambda use_native=use_native: use_native)
        results[use_native] = gptq_quantize(w, hessian, qparams, (0, 15), config)
    (q_native, s_native, z_native), (q_torch, s_torch, z_torch) = results[True], results[False]
    # the same operations, but torch's rank-1 update may round differently (FMA): a group's parameters can
    # move by an ulp and a rare code by one step
    assert ((q_native - q_torch).abs() > 1e-4).float().mean() < 0.002
    torch.testing.assert_close(q_native, q_torch, rtol=0, atol=float(s_torch.max()) * 1.01)
    torch.testing.assert_close(s_native, s_torch)
    torch.testing.assert_close(z_native, z_torch)


def test_symmetric_gram_is_the_full_product():
    from ascq.quantize.gptq import symmetric_gram

    torch.manual_seed(0)
    for d in (100, 300, 301):  # below the split, even and odd halves
        x = torch.randn(500, d)
        gram = symmetric_gram(x)
        torch.testing.assert_close(gram, x.t() @ x, rtol=1e-5, atol=1e-3)
        assert torch.equal(gram, gram.t())


def test_lower_triangular_inverse_is_the_inverse():
    from ascq.quantize.gptq import lower_triangular_inverse

    torch.manual_seed(0)
    for n in (1, 100, 257, 600):  # below the split, odd halves, two levels
        x = torch.randn(4 * n, n)
        lower = torch.linalg.cholesky(x.t() @ x / (4 * n) + 0.1 * torch.eye(n))
        inverse = lower_triangular_inverse(lower)
        exact = torch.linalg.inv(lower.double())
        torch.testing.assert_close(inverse.double(), exact, rtol=1e-4, atol=1e-5)
        assert torch.equal(inverse, inverse.tril())


def test_weighted_mse_ranges_minimise_the_weighted_error():
    """`weight_ranges` with importance picks, per group, the shrink step of least Σ importance·|q - w|^norm:
    checked against a plain loop over the steps (float64 errors), native kernel and torch path alike."""
    from ascq.kernels import native

    torch.manual_seed(0)
    args = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=32, symmetric=False, observer="mse"
    )
    w = torch.randn(16, 96) * 0.05
    w[:, 5] *= 30  # an outlier column: weighting it heavily keeps its range, weighting it lightly clips it
    grouped = qmath.to_groups(w, "group", 32)
    for importance in (torch.ones(96), torch.rand(96) + 0.01, torch.where(torch.arange(96) == 5, 1e-4, 1.0)):
        imp = importance.view(3, 32)
        shrinks = [1 - i / 100 for i in range(21)]
        errors = []
        for shrink in shrinks:
            lo, hi = grouped.amin(-1) * shrink, grouped.amax(-1) * shrink
            scale, zero = qmath.compute_qparams(lo, hi, 4, False)
            deq = qmath.fake_quantize(grouped, scale[..., None], zero[..., None], 4)
            errors.append(((deq - grouped).abs().double() ** 2.4 * imp.double()).sum(-1))
        best = torch.tensor(shrinks)[torch.stack(errors, -1).argmin(-1)]
        for use_native in (True, False):
            if use_native and not native.available():
                continue
            available = native.available
            native.available = (lambda: True) if use_native else (lambda: False)
            try:
                low, _ = observer.weight_ranges(grouped, args, torch.float32, imp)
            finally:
                native.available = available
            picked = low / grouped.amin(-1)
            assert (picked - best).abs().max() < 1e-6, (use_native, importance[:3])
