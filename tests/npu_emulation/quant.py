"""Emulated layout and activation-quantization ops: npu_format_cast, get_npu_format,
npu_convert_weight_to_int4pack, npu_quantize, npu_dynamic_quant."""

from __future__ import annotations

import torch

from ascq.core.qmath import quantize_per_token

from .contract import ACL_FORMAT_FRACTAL_NZ, ACL_FORMAT_ND, npu_format, require, require_dtype

INT8_MIN, INT8_MAX = -128, 127
FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def npu_format_cast(tensor: torch.Tensor, acl_format: int, customize_dtype: torch.dtype | None = None):
    """ND <-> FRACTAL_NZ. The emulator keeps the ND data and tags the returned tensor with the format."""
    require(acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ), "npu_format_cast", f"format {acl_format}")
    require(tensor.dim() >= 2, "npu_format_cast", "FRACTAL_NZ needs a tensor of at least 2 dims")
    out = tensor.contiguous().clone()
    out._emulated_npu_format = acl_format
    return out


def get_npu_format(tensor: torch.Tensor) -> int:
    return npu_format(tensor)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 values in [-8, 7], 2-D (k, n) or (n, k), last dim a multiple of 8 -> int32 (.., last // 8)."""
    op = "npu_convert_weight_to_int4pack"
    require_dtype(weight, (torch.int32,), op, "weight")
    require(weight.dim() == 2, op, f"weight must be 2-D, got {weight.dim()}-D")
    require(weight.is_contiguous(), op, "weight must be contiguous")
    require(weight.shape[-1] % 8 == 0, op, f"last dim {weight.shape[-1]} must be a multiple of 8")
    require(bool(((weight >= -8) & (weight <= 7)).all()), op, "values must lie in the int4 range [-8, 7]")
    nibbles = (weight & 0xF).reshape(weight.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int64).to(torch.int32).contiguous()


def _check_div_mode_false(x: torch.Tensor, scales: torch.Tensor, zero_points, axis: int) -> None:
    op = "npu_quantize(div_mode=False)"
    require(scales.dtype == x.dtype, op, f"scales dtype {scales.dtype} must equal input dtype {x.dtype}")
    quant_axis = x.dim() - 2 if axis == -2 else x.dim() - 1
    require(axis >= -2, op, f"axis {axis} must be >= -2")
    if scales.dim() == 1:
        require(
            scales.shape[0] in (1, x.shape[quant_axis]),
            op,
            f"1-D scales of size {scales.shape[0]} must be 1 or input dim {quant_axis} "
            f"({x.shape[quant_axis]})",
        )
    else:
        require(scales.dim() == x.dim(), op, "multi-dim scales need the input's number of dims")
    if zero_points is not None:
        require(
            zero_points.shape == scales.shape and zero_points.dtype == scales.dtype,
            op,
            "zero_points must have the shape and dtype of scales",
        )


def _check_div_mode_true(scales: torch.Tensor, zero_points) -> None:
    op = "npu_quantize(div_mode=True)"
    require_dtype(scales, (torch.float32, torch.bfloat16), op, "scales")
    if zero_points is not None:
        require_dtype(zero_points, (torch.int8, torch.uint8, torch.int32, torch.bfloat16), op, "zero_points")


def _broadcast(param: torch.Tensor, axis: int) -> torch.Tensor:
    """A 1-D scale/offset lies along the last axis, or along the rows when axis == -2."""
    param = param.float()
    return param.reshape(-1, 1) if param.dim() == 1 and axis == -2 else param


def npu_quantize(
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    dtype,
    axis: int = 1,
    div_mode: bool = True,
) -> torch.Tensor:
    """result = round(input / scales + zero_points) (div_mode) or round(input * scales + zero_points), to
    int8."""
    require_dtype(input, FLOAT_INPUTS, "npu_quantize", "input")
    if dtype != torch.qint8:
        raise NotImplementedError(f"npu_quantize emulator: only dtype torch.qint8, got {dtype}")
    if div_mode:
        _check_div_mode_true(scales, zero_points)
        y = input.float() / _broadcast(scales, axis)
    else:
        _check_div_mode_false(input, scales, zero_points, axis)
        y = input.float() * _broadcast(scales, axis)
    if zero_points is not None:
        y = y + _broadcast(zero_points, axis)
    return y.round().clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def npu_dynamic_quant(x: torch.Tensor, *, smooth_scales=None, group_index=None, dst_type=None):
    """Per-token symmetric int8: scale = rowMax(|x|) / 127 (float32, shape x.shape[:-1]), y = round(x /
    scale)."""
    op = "npu_dynamic_quant"
    require_dtype(x, (torch.float16, torch.bfloat16), op, "x")
    require(x.dim() > 1, op, "x must have more than one dim")
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError("npu_dynamic_quant emulator: smooth_scales / group_index are not modelled")
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"npu_dynamic_quant emulator: dst_type {dst_type} is not modelled")
    q, scale = quantize_per_token(x)  # the documented formula is the one ascq's converter and backends use
    return q.to(torch.int8), scale.squeeze(-1)
