"""GPTQ (Frantar et al., ICLR 2023): quantize a weight column by column, correcting the remaining columns.

H = 2/n · Σ x xᵀ over the calibration inputs of the linear. With damping λ = 0.01 · mean diag(H), the upper
Cholesky factor U of (H + λI)⁻¹ gives each column's error feedback: quantize column i, spread its error
(w_i - q_i) / U_ii · U_i,i+1: over the not-yet-quantized columns, lazily in blocks of 128 columns.

Group parameters (scale, zero point) come from `qparams(groups, importance) -> (scale, zero)` of the recipe's
scheme (`QParams`), computed when the first column of a group is reached (on the already-updated weights).
With `actorder` ("static" in llm-compressor/compressed-tensors terms, a.k.a. "weight"), columns are visited in
decreasing diag(H) order while the groups stay the contiguous original ones, so their parameters are computed
up front from the original weights and the checkpoint format needs no g_idx.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from ascq.kernels import native

# (groups [rows, n, len], importance [n, len]: each column's diag(H)) -> (scale, zero) [rows, n]
QParams = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class CholeskyError(RuntimeError):
    """H + λI was not positive definite: the caller falls back to round-to-nearest."""


@dataclasses.dataclass
class GPTQConfig:
    num_bits: int = 4
    group_size: int | None = 128  # None: one group per row (per-channel)
    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: bool = False
    float_zero_point: bool = (
        False  # zeros are unrounded floats: q = round(w / scale + zero), as qmath.quantize
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("GPTQ: block_size must be >= 1")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError("GPTQ: group_size must be >= 1 or None")
        if not 0.0 < self.dampening_frac < 1.0:
            raise ValueError("GPTQ: dampening_frac must be in (0, 1)")


class GramCache:
    """The last scaled Gram matrix a `HessianAccumulator` computed, keyed on its input's storage: linears that
    read the same tensor (q/k/v, gate/up; hooks see detached views of it) share one x xᵀ product."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.input: torch.Tensor | None = None  # kept alive, so that its storage address is not reused
        self.gram: torch.Tensor | None = None

    def get(self, x: torch.Tensor, total: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (x.data_ptr(), x.dtype, tuple(x.shape), x.stride(), x._version, total)
        if key != self.key:
            self.key, self.input, self.gram = key, x, compute()
        return self.gram


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over batches of a linear's inputs, in float32.

    Its products stay float32 whatever the converter's `--calibration-dtype`: bf16 GEMMs (faster here) round
    their output, an indefinite error that GPTQ's damping does not cover where a few channels dominate H
    (SmolLM2's o_proj in layers 0 and 1 was not positive definite with chunked bf16 products, and fell back to
    RTN)."""

    def __init__(self, in_features: int, cache: GramCache | None = None) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.num_tokens = 0
        self.cache = cache

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n == 0:
            return
        total = self.num_tokens + n
        self.hessian *= self.num_tokens / total

        def gram() -> torch.Tensor:
            return symmetric_gram(rows.float()).mul_(2.0 / total)

        self.hessian += self.cache.get(x, total, gram) if self.cache is not None else gram()
        self.num_tokens = total


def symmetric_gram(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """xᵀx [d, d] of x [n, d] (into `out` when given), by halves: the two diagonal blocks recursively, one
    off-diagonal block by a GEMM and the other as its transpose (faster than the full product, and than one
    split joined by cat, on SmolLM2's down_proj inputs)."""
    out = torch.empty(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device) if out is None else out
    half = x.shape[1] // 2
    if half < 128:
        return torch.mm(x.t(), x, out=out)
    left, right = x[:, :half], x[:, half:]
    symmetric_gram(left, out[:half, :half])
    symmetric_gram(right, out[half:, half:])
    torch.mm(left.t(), right, out=out[:half, half:])
    out[half:, :half] = out[:half, half:].t()
    return out


def lower_triangular_inverse(lower: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """L⁻¹ of a lower-triangular L (into `out` when given), by halves: [[A, 0], [C, B]]⁻¹ = [[A⁻¹, 0], [-B⁻¹ C
    A⁻¹, B⁻¹]], the two diagonal blocks recursively, the corner by two GEMMs (faster than solve_triangular
    against the identity on SmolLM2's Hessians, with the same accuracy against a float64 inverse)."""
    n = lower.shape[0]
    out = torch.zeros_like(lower) if out is None else out
    if n <= 128:
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device)
        return out.copy_(torch.linalg.solve_triangular(lower, eye, upper=False))
    half = n // 2
    lower_triangular_inverse(lower[:half, :half], out[:half, :half])
    lower_triangular_inverse(lower[half:, half:], out[half:, half:])
    torch.mm(out[half:, half:], lower[half:, :half] @ out[:half, :half], out=out[half:, :half]).neg_()
    return out


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch ops on one thread. GPTQ's column loop runs small ones (one column at a time), and two
    OpenMP threads meeting at a barrier after each cost more than they save: 2-10x slower on a loaded 2-core
    machine, bit-identical results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float) -> torch.Tensor:
    """The upper Cholesky factor U of (H + λI)⁻¹ (so (H + λI)⁻¹ = Uᵀ U), from one factorisation: with J the
    index reversal and J (H + λI) J = L Lᵀ, U = J L⁻¹ J (an upper triangle with a positive diagonal). Same U
    as cholesky(cholesky_inverse(cholesky(H + λI)), upper) up to rounding, at 2/5 of the flops."""
    h = hessian.flip(0, 1)
    h.diagonal().add_(dampening_frac * torch.mean(torch.diag(hessian)))
    factor, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        raise CholeskyError("H + damping is not positive definite")
    upper = lower_triangular_inverse(factor).flip(0, 1)
    if not torch.isfinite(upper).all():
        raise CholeskyError("inverse Hessian is not positive definite")
    return upper


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    qparams: QParams,
    q_range: tuple[int, int],
    config: GPTQConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-quantize `weight` [out, in]; returns (dequantized weight, scale [out, groups], zero [out,
    groups]).

    `q_range` is the integer range (e.g. (-8, 7)). Raises CholeskyError when H cannot be factorised.
    """
    w = weight.float().clone()
    out_dim, in_dim = w.shape
    group = config.group_size or in_dim
    if in_dim % group:
        raise ValueError(f"GPTQ: in_features {in_dim} is not a multiple of group_size {group}")
    num_groups = in_dim // group
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    scales = torch.zeros(out_dim, num_groups)
    zeros = torch.zeros(out_dim, num_groups)
    perm = torch.arange(in_dim)
    if config.actorder:
        importance = torch.diag(h).view(num_groups, group)
        # static: original weights
        scales, zeros = (t.float() for t in qparams(w.view(out_dim, num_groups, group), importance))
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_hessian_factor(h, config.dampening_frac)
    _solve(
        w,
        u,
        torch.diag(h),
        scales,
        zeros,
        qparams,
        [p // group for p in perm.tolist()],
        group,
        q_range,
        config,
    )
    if config.actorder:
        w = w[:, torch.argsort(perm)]
    return w, scales, zeros


def _solve(
    w: torch.Tensor,
    u: torch.Tensor,
    importance: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    qparams: QParams,
    group_of: list[int],
    group: int,
    q_range: tuple[int, int],
    config: GPTQConfig,
) -> None:
    """The column loop, in place on `w` (and on `scales`/`zeros` without act-order; `importance`: diag(H) in
    visiting order, for `qparams`). It works on wᵀ, where a column of w is a contiguous row. Its cost is
    per-column dispatch, not arithmetic, so where the native kernels load the columns between two group starts
    run as one call (`native.gptq_columns`, the same float operations); else as in-place torch kernels, one
    column at a time."""
    wt = w.t().contiguous()  # [in, out]
    u = u.contiguous()  # row-major (solve_triangular may return column-major)
    in_dim = wt.shape[0]
    scales_t, zeros_t = scales.t().contiguous(), zeros.t().contiguous()  # [groups, out]
    columns = _native_columns if native.available() else _torch_columns
    groups = torch.tensor(group_of, dtype=torch.int32)
    for start in range(0, in_dim, config.block_size):
        end = min(start + config.block_size, in_dim)
        w_block = wt[start:end]  # updated in place; its rows are replaced by their quantized values below
        err_block = torch.empty_like(w_block)
        u_block = u[start:end, start:end]
        first = 0
        while first < end - start:
            col = start + first
            last = end - start
            # the group's columns as updated so far; the segment stops at the next group
            if not config.actorder:
                g = group_of[col]
                if col % group == 0:
                    scale, zero = qparams(
                        wt[col : col + group].t()[:, None, :], importance[None, col : col + group]
                    )
                    scales_t[g], zeros_t[g] = scale[:, 0], zero[:, 0]
                last = min(last, first + group - col % group)
            columns(
                w_block,
                u_block,
                err_block,
                scales_t,
                zeros_t,
                groups[start:end],
                first,
                last,
                q_range,
                config,
            )
            first = last
        wt[end:].sub_(u[start:end, end:].t() @ err_block)
    w.copy_(wt.t())
    if not config.actorder:
        scales.copy_(scales_t.t())
        zeros.copy_(zeros_t.t())


def _native_columns(
    w_block: torch.Tensor,
    u_block: torch.Tensor,
    err_block: torch.Tensor,
    scales_t: torch.Tensor,
    zeros_t: torch.Tensor,
    groups: torch.Tensor,
    first: int,
    last: int,
    q_range: tuple[int, int],
    config: GPTQConfig,
) -> None:
    native.gptq_columns(
        w_block, u_block, err_block, scales_t, zeros_t, groups, first, last, config.float_zero_point, q_range
    )


def _torch_columns(
    w_block: torch.Tensor,
    u_block: torch.Tensor,
    err_block: torch.Tensor,
    scales_t: torch.Tensor,
    zeros_t: torch.Tensor,
    groups: torch.Tensor,
    first: int,
    last: int,
    q_range: tuple[int, int],
    config: GPTQConfig,
) -> None:
    q_min, q_max = q_range
    q = torch.empty(w_block.shape[1])
    with single_thread():
        for i in range(first, last):
            g = int(groups[i])
            row, scale, zero = w_block[i], scales_t[g], zeros_t[g]
            torch.div(row, scale, out=q)
            # as qmath.quantize: round(w / scale + zero) or round(w / scale) + zero
            if config.float_zero_point:
                q.add_(zero).round_()
            else:
                q.round_().add_(zero)
            q.clamp_(q_min, q_max).sub_(zero).mul_(scale)
            err = torch.sub(row, q, out=err_block[i]).div_(u_block[i, i])
            w_block[i + 1 :].addr_(u_block[i, i + 1 :], err, alpha=-1)
            row.copy_(q)
