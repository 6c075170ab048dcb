"""CUDA backend: torch ops that run on a GPU. Also runs on CPU tensors (GPU-only kernels then fall back),
which is how the CPU test suite covers it; `benchmarks/cuda_check.py` runs the same comparisons on a GPU.

- `dense`: F.linear in the activation dtype.
- `tinygemm` (w4a16 on a CUDA device, bf16 activations, group 32/64/128/256 or per channel via replicated
  group scales, in % 32 == 0, out % 8 == 0): aten._weight_int4pack_mm.
- `int_mm` (w8a8 / w4a8, per channel, symmetric weights and inputs, in % 8 == 0, out % 8 == 0): int8
  activations x int8 weights with torch._int_mm (exact int32), then per-token x per-channel scales. _int_mm
  needs more than 16 rows, so smaller batches are zero-padded.
- `dequant`: everything else: dequantize the weight (fp32) per call and multiply the fake-quantized
  activation.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascq.kernels import QuantLinearWeights, linear_over_rows, moe
from ascq.kernels.paged_sdpa import paged_attention, write_kv_cache
from ascq.kernels.reference import dequantize_weight, fake_quantize_input, integer_activations, select_experts

__all__ = ["linear", "moe_experts", "paged_attention", "prepare_experts", "prepare_linear", "select_experts"]
__all__ += ["write_kv_cache"]

TINYGEMM_GROUP_SIZES = (256, 128, 64, 32)
INT_MM_MIN_ROWS = 17


@dataclass
class CudaLinear:
    kernel: str  # dense | tinygemm | int_mm | dequant
    weights: QuantLinearWeights
    weight: torch.Tensor
    out_features: int
    scale: torch.Tensor | None = None  # int_mm: fp32 [out]; tinygemm: scales_and_zeros [in/group, out, 2]
    group_size: int = 0
    bias: torch.Tensor | None = None


def _tinygemm_group_size(w: QuantLinearWeights) -> int | None:
    if w.out_features % 8 or w.in_features % 32:
        return None
    if w.group_size is not None and w.group_size != w.in_features:
        return w.group_size if w.group_size in TINYGEMM_GROUP_SIZES else None
    return next(g for g in TINYGEMM_GROUP_SIZES if w.in_features % g == 0)


def _inner_k_tiles(in_features: int) -> int:
    """tinygemm packs K in tiles of 16 x inner_k_tiles; the largest that divides K."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0)


def _choose_kernel(w: QuantLinearWeights, dtype: torch.dtype) -> str:
    on_gpu = w.weight.device.type == "cuda"
    if w.scheme == "dense":
        return "dense"
    if w.scheme == "w4a16" and on_gpu and dtype == torch.bfloat16 and _tinygemm_group_size(w) is not None:
        return "tinygemm"
    per_channel = w.group_size is None or w.group_size == w.in_features
    symmetric = w.zero_point is None and w.input_zero_point is None
    aligned = w.in_features % 8 == 0 and w.out_features % 8 == 0
    if w.scheme in ("w8a8_dynamic", "w8a8_static", "w4a8_dynamic") and per_channel and symmetric and aligned:
        return "int_mm"
    return "dequant"


def _prepare_tinygemm(w: QuantLinearWeights) -> tuple[torch.Tensor, torch.Tensor, int]:
    group_size = _tinygemm_group_size(w)
    num_groups = w.in_features // group_size
    scale = w.weight_scale.float().repeat_interleave(num_groups // w.weight_scale.shape[1], dim=1)
    zero = w.zero_point
    zero = (
        torch.zeros_like(scale)
        if zero is None
        else zero.float().repeat_interleave(num_groups // zero.shape[1], 1)
    )
    unsigned = (w.weight.to(torch.int32) + 8).to(torch.uint8)
    nibbles = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, _inner_k_tiles(w.in_features))
    # tinygemm computes (u - 8) * scale + offset; ours is (q - zero) * scale with q = u - 8
    scales_and_zeros = torch.stack([scale.T, (-zero * scale).T], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros, group_size


def prepare_linear(w: QuantLinearWeights, dtype: torch.dtype = torch.float32) -> CudaLinear:
    kernel = _choose_kernel(w, dtype)
    bias = None if w.bias is None else w.bias.float()
    p = CudaLinear(kernel, w, w.weight, w.out_features, bias=bias)
    if kernel == "dense":
        p.weight = w.weight.to(dtype)
    elif kernel == "tinygemm":
        p.weight, p.scale, p.group_size = _prepare_tinygemm(w)
    elif kernel == "int_mm":
        p.weight = w.weight.contiguous()  # passed as .T: a column-major [in, out] operand, as torchao does
        p.scale = w.weight_scale.float().flatten()
    if kernel != "dequant":  # keep the scheme and input qparams, not a second copy of the weight
        p.weights = dataclasses.replace(w, weight=w.weight.to("meta"))
    return p


def _int_mm_linear(x: torch.Tensor, p: CudaLinear) -> torch.Tensor:
    q, row_scale = integer_activations(x, p.weights)
    num_rows = q.shape[0]
    padded = F.pad(q, (0, 0, 0, max(0, INT_MM_MIN_ROWS - num_rows))).to(torch.int8)
    y = torch._int_mm(padded, p.weight.T)[:num_rows].float()
    return y * row_scale * p.scale


def _linear_rows(x: torch.Tensor, p: CudaLinear) -> torch.Tensor:
    y = _kernel_rows(x, p)
    return y if p.bias is None else y + p.bias


def _kernel_rows(x: torch.Tensor, p: CudaLinear) -> torch.Tensor:
    if p.kernel == "dense":
        return F.linear(x.to(p.weight.dtype), p.weight)
    if p.kernel == "tinygemm":
        return torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16).contiguous(), p.weight, p.group_size, p.scale
        )
    if p.kernel == "int_mm":
        return _int_mm_linear(x.float(), p)
    return F.linear(fake_quantize_input(x.float(), p.weights), dequantize_weight(p.weights))


def linear(x: torch.Tensor, prepared: CudaLinear) -> torch.Tensor:
    return linear_over_rows(_linear_rows, x, prepared)


# MoE experts: moe.py's grouped experts over this backend's linear
prepare_experts = functools.partial(moe.prepare_experts, prepare_linear)
moe_experts = functools.partial(moe.moe_experts, linear)
