"""Emulated quantized matmuls: npu_quant_matmul (int8 x int8), npu_weight_quant_batchmatmul (float x
int8/int4).

Integer products are computed exactly (float64 holds every int8 x int8 sum here), dequantization in float32.
"""

from __future__ import annotations

import torch

from .contract import (
    ACL_FORMAT_FRACTAL_NZ,
    decode_int64_scale,
    npu_format,
    require,
    require_dtype,
    unpack_int4,
)

OUTPUT_DTYPES = (torch.int8, torch.float16, torch.bfloat16, torch.int32)

# Atlas A2/A3 dtype combinations for int8 inputs (docs table 1): output -> (scale, offset, bias,
# pertoken_scale) dtypes allowed; None in a tuple means "may be absent", a missing None means "required".
_A2_COMBINATIONS = {
    torch.float16: [
        ((torch.int64, torch.float32), (None,), (torch.int32, None), (None,)),
        ((torch.float32,), (None,), (torch.int32, torch.float16, torch.float32, None), (torch.float32,)),
    ],
    torch.int8: [((torch.int64, torch.float32), (torch.float32, None), (torch.int32, None), (None,))],
    torch.bfloat16: [
        (
            (torch.float32, torch.bfloat16),
            (None,),
            (torch.int32, torch.bfloat16, torch.float32, None),
            (torch.float32, None),
        )
    ],
    torch.int32: [((torch.float32, torch.bfloat16), (None,), (torch.int32, None), (None,))],
}


def _dtype_or_none(tensor):
    return None if tensor is None else tensor.dtype


def _check_combination(output_dtype, scale, offset, bias, pertoken_scale) -> None:
    given = (scale.dtype, _dtype_or_none(offset), _dtype_or_none(bias), _dtype_or_none(pertoken_scale))
    for row in _A2_COMBINATIONS[output_dtype]:
        if all(dtype in allowed for dtype, allowed in zip(given, row, strict=True)):
            return
    require(
        False,
        "npu_quant_matmul",
        f"unsupported dtype combination scale/offset/bias/pertoken={given} for output {output_dtype}",
    )


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset=None,
    pertoken_scale=None,
    bias=None,
    output_dtype=None,
) -> torch.Tensor:
    """y = (x1 @ x2 + int32 bias) * scale [* pertoken_scale] (+ float bias), int8 inputs, 2-D x1 (m, k), x2
    (k, n)."""
    op = "npu_quant_matmul"
    if x1.dtype == torch.int32:
        raise NotImplementedError("npu_quant_matmul emulator: int4 (int32) inputs are not modelled")
    require_dtype(x1, (torch.int8,), op, "x1")
    require(x2.dtype == x1.dtype, op, f"x2 dtype {x2.dtype} must equal x1 dtype {x1.dtype}")
    require(x1.dim() == 2 and x2.dim() == 2, op, "emulator models 2-D x1 (m, k) and x2 (k, n)")
    m, k = x1.shape
    require(x2.shape[0] == k, op, f"x2 shape {tuple(x2.shape)} does not match x1's k={k}; x2 is (k, n)")
    n = x2.shape[1]
    require(k <= 65535 and n <= 65535, op, "k and n must not exceed 65535")
    output_dtype = torch.int8 if output_dtype is None else output_dtype
    require(output_dtype in OUTPUT_DTYPES, op, f"output_dtype {output_dtype}")
    require(
        scale.dim() == 1 and scale.shape[0] in (1, n),
        op,
        f"scale must be 1-D (1,) or (n,), got {tuple(scale.shape)}",
    )
    if offset is not None:
        require(offset.dim() == 1 and offset.shape[0] in (1, n), op, "offset must be 1-D (1,) or (n,)")
    if pertoken_scale is not None:
        require(tuple(pertoken_scale.shape) == (m,), op, f"pertoken_scale must be (m,)=({m},)")
    if bias is not None:
        require(
            tuple(bias.shape) in ((n,), (1, n)), op, f"bias must be (n,) or (1, n), got {tuple(bias.shape)}"
        )
    _check_combination(output_dtype, scale, offset, bias, pertoken_scale)

    acc = x1.double() @ x2.double()
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double().reshape(1, n)
    scale32 = decode_int64_scale(scale) if scale.dtype == torch.int64 else scale.float()
    y = acc.float() * scale32.reshape(1, -1)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().reshape(m, 1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float().reshape(1, n)
    if offset is not None:
        y = y + offset.float().reshape(1, -1)
    if output_dtype in (torch.int8, torch.int32):
        info = torch.iinfo(output_dtype)
        return y.round().clamp(info.min, info.max).to(output_dtype)
    return y.to(output_dtype)


def _check_antiquant_shape(param: torch.Tensor, k: int, n: int, group_size: int, name: str) -> None:
    op = "npu_weight_quant_batchmatmul"
    shape = tuple(param.shape)
    if group_size:
        groups = -(-k // group_size)
        require(
            shape == (groups, n),
            op,
            f"per-group {name} must be (ceil(k/group), n)=({groups}, {n}), got {shape}",
        )
    else:
        require(
            shape in ((1,), (1, 1), (1, n), (n,)), op, f"{name} shape {shape} is not per-tensor/per-channel"
        )


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset=None,
    quant_scale=None,
    quant_offset=None,
    bias=None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
) -> torch.Tensor:
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias, x (m, k) fp16/bf16, weight (k, n)."""
    op = "npu_weight_quant_batchmatmul"
    require_dtype(x, (torch.float16, torch.bfloat16), op, "x")
    require_dtype(weight, (torch.int8, torch.int32), op, "weight")
    require(
        npu_format(weight) != ACL_FORMAT_FRACTAL_NZ,
        op,
        "a FRACTAL_NZ weight is only supported in graph mode, not in a single-op (eager) call",
    )
    require(x.dim() == 2 and weight.dim() == 2, op, "x must be (m, k) and weight (k, n)")
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(
            "npu_weight_quant_batchmatmul emulator: output quantization is not modelled"
        )
    values = unpack_int4(weight) if weight.dtype == torch.int32 else weight.to(torch.int32)
    m, k = x.shape
    require(values.shape[0] == k, op, f"weight k={values.shape[0]} does not match x's k={k}")
    n = values.shape[1]
    require(1 <= k <= 65535 and 1 <= n <= 65535, op, "k and n must lie in [1, 65535]")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError(
            "npu_weight_quant_batchmatmul emulator: int64 antiquant_scale is not modelled"
        )
    require(
        antiquant_scale.dtype == x.dtype, op, f"antiquant_scale dtype {antiquant_scale.dtype} must equal x's"
    )
    if antiquant_group_size:
        require(
            antiquant_group_size % 32 == 0 and 32 <= antiquant_group_size <= k - 1,
            op,
            f"antiquant_group_size {antiquant_group_size} must be a multiple of 32 in [32, k-1={k - 1}]",
        )
    _check_antiquant_shape(antiquant_scale, k, n, antiquant_group_size, "antiquant_scale")
    if antiquant_offset is not None:
        require(
            antiquant_offset.shape == antiquant_scale.shape, op, "antiquant_offset shape must equal scale's"
        )
        require(
            antiquant_offset.dtype == antiquant_scale.dtype, op, "antiquant_offset dtype must equal scale's"
        )
    if bias is not None:
        require(bias.is_contiguous(), op, "bias must be contiguous")
        require(tuple(bias.shape) in ((n,), (1, n), (1,)), op, f"bias shape {tuple(bias.shape)}")
        wanted = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        require(bias.dtype == wanted, op, f"bias must be {wanted} when x is {x.dtype}")

    def per_row(param: torch.Tensor) -> torch.Tensor:
        param = param.float().reshape(-1, n) if param.numel() > 1 else param.float().reshape(1, 1)
        return param.repeat_interleave(antiquant_group_size, dim=0)[:k] if antiquant_group_size else param

    w = values.float()
    if antiquant_offset is not None:
        w = w + per_row(antiquant_offset)
    w = w * per_row(antiquant_scale)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float().reshape(1, -1)
    return y.to(x.dtype)
