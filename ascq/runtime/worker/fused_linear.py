"""A prepared cpu-backend linear as the fused decode sees it (ascq_kernels.h's `ascq_fused_linear`): which
ones it takes (the native weight-only kernel, W8A8 / W4A8 on the native int8-activation kernel, dense bf16
weights on the native bf16 kernel) and their C view."""

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
    if p.kernel in ("native", "native_int8"):
        return None
    return (
        f"a linear runs on the {p.kernel!r} kernel (fused decode takes native weight-only, native int8 "
        f"activation and dense bf16 linears)"
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
        struct = Linear(kind=0, n=n, k=k, weight=p.weight.data_ptr(), bias=bias)
        return struct, cpu.DENSE_BF16_MAX_M - 1
    w = p.packed
    scales, scales_bf16, zeros, zeros_kind = native.qparam_args(w.scales, w.zeros)
    struct = Linear(
        kind=w.bits,
        n=w.n,
        k=w.k,
        group_size=w.group_size,
        scales_bf16=scales_bf16,
        zeros_kind=zeros_kind,
        weight=w.data.data_ptr(),
        scales=scales,
        zeros=zeros,
        bias=bias,
    )
    if p.kernel == "native_int8":
        struct.int8_activations = 1
        struct.input_scale = -1.0 if p.input_scale is None else p.input_scale
        struct.input_zero_point = p.input_zero_point
        return struct, cpu.NATIVE_INT8_MAX_M - 1
    struct.a8_min_rows = cpu.w4_a8_min_rows() if w.bits == 4 else 0
    return struct, cpu.native_max_m() - 1
