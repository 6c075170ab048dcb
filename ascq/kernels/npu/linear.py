"""Quantized linear on Ascend through torch_npu, laid out as vllm-ascend does.

- dense: at load the weight [out, in] in the compute dtype; per call `F.linear`.
- w8a8_dynamic: at load an int8 weight (K, N), `npu_format_cast(.., 29)` (FRACTAL_NZ), weight_scale fp32 (N,);
  per call `npu_dynamic_quant` -> `npu_quant_matmul(pertoken_scale=..., output_dtype=dtype)`.
- w8a8_static: at load as above, deq_scale = input_scale * weight_scale fp32 (N,), quant_bias int32 =
  round(bias / deq_scale - offset * Σ_k W); per call `npu_quantize(x, input_scale, input_offset)` ->
  `npu_quant_matmul(bias=quant_bias)`.
- w8a16 / w4a16: at load an int8 weight (K, N) ND (NZ is graph-mode only for this op), int4 through
  `npu_convert_weight_to_int4pack` -> int32 (K, N // 8), antiquant_scale (groups, N), antiquant_offset =
  -zero_point; per call `npu_weight_quant_batchmatmul(x, w, scale, offset, antiquant_group_size=...)`.

The op computes (w + antiquant_offset) * antiquant_scale, hence the negated zero point. W8A8 needs symmetric
weights (the converters write them so); w4a8_dynamic has no documented int8 x int4 matmul in torch_npu.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascq.core.errors import UnsupportedError
from ascq.formats.msmodelslim import static_dequant_params
from ascq.kernels import QuantLinearWeights
from ascq.kernels.npu.runtime import ACL_FORMAT_FRACTAL_NZ, check_compute_dtype, to_device, torch_npu


@dataclass
class NpuLinear:
    scheme: str
    dtype: torch.dtype
    weight: torch.Tensor
    scale: torch.Tensor | None = None  # weight_scale (dynamic), deq_scale (static) or antiquant_scale
    offset: torch.Tensor | None = None  # antiquant_offset (weight-only)
    bias: torch.Tensor | None = None  # float bias, or int32 quant_bias (static)
    input_scale: torch.Tensor | None = None
    input_offset: torch.Tensor | None = None
    group_size: int = 0


def _weight_kn(w: QuantLinearWeights) -> torch.Tensor:
    return w.weight.t().contiguous()


def _require_symmetric(w: QuantLinearWeights) -> None:
    if w.zero_point is not None and bool(w.zero_point.any()):
        raise UnsupportedError(
            f"--device npu runs {w.scheme} with symmetric weights only (found weight zero points)"
        )


def _prepare_w8a8(w: QuantLinearWeights, dtype: torch.dtype) -> NpuLinear:
    _require_symmetric(w)
    npu = torch_npu()
    weight = npu.npu_format_cast(to_device(_weight_kn(w)), ACL_FORMAT_FRACTAL_NZ)
    weight_scale = w.weight_scale.float().reshape(-1)
    if w.scheme == "w8a8_dynamic":
        bias = None if w.bias is None else to_device(w.bias, torch.float32)
        return NpuLinear(w.scheme, dtype, weight, scale=to_device(weight_scale), bias=bias)
    input_scale = w.input_scale.float().reshape(1)
    input_offset = torch.zeros(1) if w.input_zero_point is None else w.input_zero_point.float().reshape(1)
    deq_scale, quant_bias = static_dequant_params(w.weight, weight_scale, input_scale, input_offset, w.bias)
    return NpuLinear(
        w.scheme,
        dtype,
        weight,
        scale=to_device(deq_scale),
        bias=to_device(quant_bias),
        input_scale=to_device(input_scale),
        input_offset=to_device(input_offset.to(torch.int8)),
    )


def _prepare_weight_only(w: QuantLinearWeights, dtype: torch.dtype) -> NpuLinear:
    in_features = w.in_features
    group_size = w.group_size if w.group_size and w.group_size < in_features else 0
    if group_size and (group_size % 32 or group_size > in_features - 1):
        raise UnsupportedError(
            f"npu_weight_quant_batchmatmul needs a group size that is a multiple of 32 in [32, "
            f"{in_features - 1}], "
            f"got {group_size}"
        )
    weight = to_device(_weight_kn(w))
    if w.num_bits == 4:
        weight = torch_npu().npu_convert_weight_to_int4pack(weight.to(torch.int32))
    scale = to_device(w.weight_scale.t(), dtype)  # (groups, N); per channel (1, N)
    offset = None if w.zero_point is None else to_device(-w.zero_point.float().t(), dtype)
    bias_dtype = torch.float32 if dtype == torch.bfloat16 else torch.float16
    bias = None if w.bias is None else to_device(w.bias, bias_dtype)
    return NpuLinear(w.scheme, dtype, weight, scale=scale, offset=offset, bias=bias, group_size=group_size)


def prepare_linear(w: QuantLinearWeights, dtype: torch.dtype = torch.bfloat16) -> NpuLinear:
    """Transpose to (K, N), pack and cast once at load, on the backend's device."""
    check_compute_dtype(dtype)
    if w.scheme == "dense":
        bias = None if w.bias is None else to_device(w.bias, dtype)
        return NpuLinear(w.scheme, dtype, to_device(w.weight, dtype), bias=bias)
    if w.scheme in ("w8a8_dynamic", "w8a8_static"):
        return _prepare_w8a8(w, dtype)
    if w.scheme in ("w4a16", "w8a16"):
        return _prepare_weight_only(w, dtype)
    raise UnsupportedError(
        f"--device npu does not run {w.scheme}: torch_npu documents no int8-activation x int4-weight matmul; "
        "export it with `--format msmodelslim` for vllm-ascend, or serve it with --device cpu"
    )


def _matmul(x: torch.Tensor, p: NpuLinear) -> torch.Tensor:
    npu = torch_npu()
    if p.scheme == "dense":
        return F.linear(x, p.weight, p.bias)
    if p.scheme == "w8a8_dynamic":
        x_int8, pertoken_scale = npu.npu_dynamic_quant(x)
        return npu.npu_quant_matmul(
            x_int8, p.weight, p.scale, pertoken_scale=pertoken_scale, bias=p.bias, output_dtype=p.dtype
        )
    if p.scheme == "w8a8_static":
        x_int8 = npu.npu_quantize(x, p.input_scale, p.input_offset, torch.qint8, -1, True)
        return npu.npu_quant_matmul(x_int8, p.weight, p.scale, bias=p.bias, output_dtype=p.dtype)
    return npu.npu_weight_quant_batchmatmul(
        x, p.weight, p.scale, p.offset, bias=p.bias, antiquant_group_size=p.group_size
    )


def linear(x: torch.Tensor, prepared: NpuLinear) -> torch.Tensor:
    """y = x W^T (+ bias) in x.dtype; the kernels see 2-D (tokens, in) activations in the compute dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(prepared.dtype)
    y = _matmul(rows, prepared)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
