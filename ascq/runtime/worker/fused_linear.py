"""A prepared cpu-backend linear as the fused decode sees it (ascq_kernels.h's `ascq_fused_linear`): which
ones it takes (the native weight-only kernel, dense bf16 weights on the native bf16 kernel) and their C
view."""

from __future__ import annotations

import torch

from ascq.kernels import cpu, native
from ascq.runtime.layers.linear import LinearBase

Linear = native.structures()["ascq_fused_linear"]  # the C struct, read from ascq_kernels.h


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def prepared_reason(p: object) -> str | None:
    """Why the fused decode cannot run the prepared linear `p` (of the cpu backend), or None."""
    if not isinstance(p, cpu.CpuLinear):
        return "a linear is not on the cpu backend"
    if p.kernel == "dense" and p.weight.dtype == torch.bfloat16 and p.weight.shape[1] % 16 == 0:
        return None
    if p.kernel == "native":
        return None
    return (
        f"a linear runs on the {p.kernel!r} kernel (fused decode takes native weight-only and dense bf16 "
        f"linears)"
    )


def linear_reason(linear: LinearBase) -> str | None:
    """`prepared_reason` of a layer's linear, which must also be whole on this rank."""
    if linear.backend is not cpu:
        return "a linear is not on the cpu backend"
    if getattr(linear, "tp_size", 1) != 1 or getattr(linear, "global_token_scale", False):
        return "tensor parallel linears"
    return prepared_reason(linear.prepared)


def linear_struct(p: cpu.CpuLinear) -> tuple[Linear, int]:
    """The C view of a prepared linear, and the most rows its eager kernel serves."""
    bias = ptr(p.bias)
    if p.kernel == "dense":
        n, k = p.weight.shape
        return Linear(0, n, k, 0, 0, 0, 0, p.weight.data_ptr(), None, None, bias), cpu.DENSE_BF16_MAX_M - 1
    w = p.packed
    scales, scales_bf16, zeros, zeros_kind = native.qparam_args(w.scales, w.zeros)
    a8_min_rows = cpu.w4_a8_min_rows() if w.bits == 4 else 0
    struct = Linear(
        w.bits,
        w.n,
        w.k,
        w.group_size,
        scales_bf16,
        zeros_kind,
        a8_min_rows,
        w.data.data_ptr(),
        scales,
        zeros,
        bias,
    )
    return struct, cpu.native_max_m() - 1
