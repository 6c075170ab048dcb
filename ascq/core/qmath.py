"""Integer and fp8 quantization math, as pure functions, in compressed-tensors' convention.

Signed integers (int4 in [-8, 7], int8 in [-128, 127]), `q = clamp(round(x / scale + zero_point))`, `x ≈ (q -
zero_point) * scale`. Scales are computed as compressed-tensors' `calculate_qparams` does (0 is always
representable; symmetric `scale = absmax / ((qmax - qmin) / 2)`, asymmetric `scale = (max - min) / (qmax -
qmin)`, `zero_point = round(qmin - min / scale)`), then rounded to the checkpoint's scale dtype before use, so
the values written are exactly the values the chosen scale produces.

Float zero points (compressed-tensors' `QuantizationArgs.zp_dtype` a float dtype, `float_zero_point`): the
same asymmetric min-max scale, rounded to the scale dtype first, then `zero_point = qmin - min / scale`
without rounding, stored in `zp_dtype`; q stays an integer and `x ≈ (q - zero_point) * scale`. That is a grid
with a float minimum, GGUF's Q4_1 / Q5_1 / K-quant form `d·k + m`, which an integer zero point can only
approximate (see `GGUF_FLOAT_MIN_TYPES`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from compressed_tensors.quantization import QuantizationArgs

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def int_range(num_bits: int) -> tuple[int, int]:
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def float_zero_point(args: QuantizationArgs) -> bool:
    """Whether an int scheme's zero points are floats (`zp_dtype` a float dtype; asymmetric only)."""
    return (
        args.type == "int"
        and not args.symmetric
        and args.zp_dtype is not None
        and args.zp_dtype.is_floating_point
    )


def zero_point_dtype(args: QuantizationArgs) -> torch.dtype | None:
    """The dtype `compute_qparams` gives zero points of `args`: its float `zp_dtype`, else None (int8,
    rounded)."""
    return args.zp_dtype if float_zero_point(args) else None


def compute_qparams(
    min_vals: torch.Tensor,
    max_vals: torch.Tensor,
    num_bits: int,
    symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
    zp_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale in `scale_dtype`, zero_point) of the same shape as `min_vals`; zero_point is int8 (rounded), or,
    with a float `zp_dtype` (asymmetric), `qmin - min / scale` of the rounded scale, unrounded, in
    `zp_dtype`."""
    qmin, qmax = int_range(num_bits)
    min_vals = torch.clamp(min_vals.float(), max=0.0)
    max_vals = torch.clamp(max_vals.float(), min=0.0)
    if symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals) / ((qmax - qmin) / 2)
        zero_point = torch.zeros_like(scale)
    else:
        scale = (max_vals - min_vals) / (qmax - qmin)
        zero_point = torch.clamp(qmin - min_vals / scale, qmin, qmax)
    scale = scale.to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    if zp_dtype is not None and not symmetric:  # from the scale as written: the grid's minimum maps exactly
        zero_point = torch.clamp(qmin - min_vals / scale.float(), qmin, qmax)
        return scale, torch.nan_to_num(zero_point).to(zp_dtype)
    zero_point = torch.round(torch.nan_to_num(zero_point)).to(torch.int8)
    return scale, zero_point


def quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, num_bits: int
) -> torch.Tensor:
    """int8 tensor of signed `num_bits` values; scale/zero_point broadcast against `x` (fp32 math)."""
    return grid_values(x, scale, zero_point, num_bits).to(torch.int8)


def grid_values(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantize`'s values as fp32, round(clamp(x / scale (+ zero_point))), into `out` when given."""
    qmin, qmax = int_range(num_bits)
    scaled = torch.div(x.float(), scale.float(), out=out)
    if zero_point is not None:
        scaled.add_(zero_point.float())
    return scaled.clamp_(qmin, qmax).round_()


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `(q - zero_point) * scale`."""
    return dequantize_into(q.to(torch.float32, copy=True), scale, zero_point)


def dequantize_into(
    values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
) -> torch.Tensor:
    """`dequantize` in place on fp32 `values`."""
    if zero_point is not None:
        values.sub_(zero_point.float())
    return values.mul_(scale.float())


def fake_quantize(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, num_bits: int
) -> torch.Tensor:
    return dequantize(quantize(x, scale, zero_point, num_bits), scale, zero_point).to(x.dtype)


MIN_FITTED_GROUP_SIZE = 32  # vLLM's int4 kernels (Marlin) take group sizes 32, 64, 128 or per-channel


def fitted_group_size(group_size: int, in_features: Iterable[int]) -> int | None:
    """The one group size a checkpoint uses for a recipe's `group_size` (an upper bound) over the input widths
    of the linears it quantizes: `group_size` when it divides every width, else the largest power of two in
    [MIN_FITTED_GROUP_SIZE, group_size] that does (SmolLM2's 576 = 9 · 64: 64 instead of 128); None when there
    is none, and then each linear whose width `group_size` does not divide is quantized per channel
    (`linear_group_size`). One value per config group keeps compressed-tensors' single `group_size` valid."""
    widths = set(in_features)
    if all(w % group_size == 0 for w in widths):
        return group_size
    size = 1 << (group_size.bit_length() - 1)  # largest power of two <= group_size
    while size >= MIN_FITTED_GROUP_SIZE:
        if all(w % size == 0 for w in widths):
            return size
        size //= 2
    return None


# ggml's block-quantized types: every block of 32 input columns has its own scale (and min) on one
# 16/32/256-level grid. A checkpoint imported from one (the GGUF importer records
# `source.gguf.quantization_type` in ascq.json) holds those dequantized values; int4 groups spanning two
# blocks (SmolLM2's fitted 64) mix two grids, so it is re-quantized with groups on the source blocks. Measured
# on SmolLM2 (Q4_1): docs/benchmarks.md "Int4 grids on a GGUF source".
GGUF_BLOCK_SIZES = {
    "Q4_0": 32,
    "Q4_1": 32,
    "Q5_0": 32,
    "Q5_1": 32,
    "Q8_0": 32,
    "Q2_K": 16,
    "Q3_K": 16,
    "Q4_K": 32,
    "Q5_K": 32,
    "Q6_K": 16,
}
# ... of which these give every block a float minimum besides its scale (ggml's `d·k + m`: Q4_1 / Q5_1 `m`,
# the K-quants' `dmin·min`); Q4_0 / Q5_0 / Q8_0 / Q3_K / Q6_K are `d·(k - 2^(b-1))`, which an integer zero
# point holds.
GGUF_FLOAT_MIN_TYPES = frozenset({"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"})


def _gguf_type(source_manifest: dict | None) -> str:
    gguf = ((source_manifest or {}).get("source") or {}).get("gguf") or {}
    return str(gguf.get("quantization_type", "")).upper()


def source_block_size(source_manifest: dict | None) -> int | None:
    """The quantization block length of the checkpoint a source zoo entry was imported from (None: not
    blocked)."""
    return GGUF_BLOCK_SIZES.get(_gguf_type(source_manifest))


def source_has_float_min(source_manifest: dict | None) -> bool:
    """Whether the checkpoint a source zoo entry was imported from has a float minimum per block (Q4_1,
    ...)."""
    return _gguf_type(source_manifest) in GGUF_FLOAT_MIN_TYPES


def keeps_source_grid(args: QuantizationArgs, block_size: int | None, float_min: bool) -> bool:
    """Whether quantizing with `args` reproduces the grid of a source quantized in blocks of `block_size`
    columns with a float minimum each (`source_has_float_min`): float zero points, one group per source block.
    Round-to-nearest then gives back the source's values (up to the scale dtype's rounding)."""
    return float_min and float_zero_point(args) and args.strategy == "group" and args.group_size == block_size


def block_aligned_group_size(
    group_size: int, in_features: Iterable[int], block_size: int | None
) -> int | None:
    """`fitted_group_size`, then, for a source quantized in blocks of `block_size` columns that is smaller and
    divides every width, that block size (never coarser than the recipe's, never below
    MIN_FITTED_GROUP_SIZE)."""
    widths = set(in_features)
    fitted = fitted_group_size(group_size, widths)
    if block_size is None or block_size < MIN_FITTED_GROUP_SIZE or any(w % block_size for w in widths):
        return fitted
    return block_size if fitted is None or block_size < fitted else fitted


def linear_group_size(group_size: int | None, in_features: int) -> int | None:
    """A linear's group size under a checkpoint group size (None: per channel, also when it does not
    divide)."""
    return group_size if group_size and in_features % group_size == 0 else None


def to_groups(w: torch.Tensor, strategy: str, group_size: int | None) -> torch.Tensor:
    """View `w [out, in]` as `[out, num_groups, group_len]` for the strategy (tensor: one group, channel:
    one per row)."""
    out_features, in_features = w.shape
    if strategy == "tensor":
        return w.reshape(1, 1, -1)
    if strategy == "channel":
        return w.reshape(out_features, 1, in_features)
    if strategy == "group":
        if not group_size or in_features % group_size:
            raise ValueError(f"in_features {in_features} is not divisible by group_size {group_size}")
        return w.reshape(out_features, in_features // group_size, group_size)
    raise ValueError(f"unsupported weight strategy {strategy!r} (tensor, channel, group)")


def from_groups(grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return grouped.reshape(shape)


def quantize_with_qparams(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs
) -> torch.Tensor:
    """int8 `[out, in]` values of `w` for per-tensor/channel/group `scale`/`zero_point`."""
    grouped = to_groups(w, str(args.strategy), args.group_size)
    zp = None if zero_point is None else zero_point.reshape(*scale.reshape(grouped.shape[0], -1).shape, 1)
    q = quantize(grouped, scale.reshape(grouped.shape[0], -1, 1), zp, args.num_bits)
    return from_groups(q, w.shape)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantizationArgs
) -> torch.Tensor:
    grouped = to_groups(q, str(args.strategy), args.group_size)
    scale = scale.reshape(grouped.shape[0], -1, 1)
    zp = None if zero_point is None else zero_point.reshape(scale.shape)
    return from_groups(dequantize(grouped, scale, zp), q.shape)


def quantize_per_token(x: torch.Tensor, num_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token quantization over the last dim, as served: the one rule of the converter,
    every backend and the NPU emulator.

    vllm-ascend's `npu_dynamic_quant` (scale = rowMax(|x|) / 127, y = round(x / scale)) and vLLM's
    `scaled_int8_quant` (scale = absmax / 127 in fp32, round half to even, saturate): `scale = absmax / qmax`
    in fp32, `q = clamp(round_half_even(x / scale), qmin, qmax)`; a zero row gets scale 0 and q 0. vLLM's CUDA
    kernel multiplies by 127 / absmax instead of dividing (it can differ at an exact tie). compressed-tensors'
    own calibration-time fake quantization divides by 127.5 instead; serving does not. Returns (q as fp32
    integer values, scale fp32 [..., 1]).
    """
    qmin, qmax = int_range(num_bits)
    x32 = x.float()
    # max |x|, no |x| temporary
    scale = torch.linalg.vector_norm(x32, float("inf"), dim=-1, keepdim=True) / qmax
    q = x32 / torch.where(scale > 0, scale, torch.ones_like(scale))
    return q.round_().clamp_(qmin, qmax), scale


def per_token_fake_quantize(x: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """`quantize_per_token`, dequantized, in x.dtype: the activation a dynamic W8A8/W4A8 linear multiplies."""
    q, scale = quantize_per_token(x, num_bits)
    return q.mul_(scale).to(x.dtype)


def quantize_static_input(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None, num_bits: int = 8
) -> torch.Tensor:
    """Static per-tensor activation quantization as served (vLLM's static_scaled_int8(_azp)_quant, torch_npu's
    npu_quantize): `q = clamp(round_half_even(x / scale) + zero_point)`, q as fp32 integer values."""
    qmin, qmax = int_range(num_bits)
    q = torch.round(x.float() / scale.float())
    if zero_point is not None:
        q = q + zero_point.float()
    return q.clamp(qmin, qmax)


def static_fake_quantize(x: torch.Tensor, scale: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """`quantize_static_input` (symmetric), dequantized, in x.dtype."""
    return (quantize_static_input(x, scale, None, num_bits) * scale.float()).to(x.dtype)


def static_scale(absmax: float | torch.Tensor, num_bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Symmetric per-tensor scale `[1]` for a calibrated absolute maximum."""
    absmax = torch.as_tensor(absmax, dtype=torch.float32).reshape(1)
    return compute_qparams(-absmax, absmax, num_bits, symmetric=True, scale_dtype=scale_dtype)[0]


def fp8_scale(absmax: float | torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor e4m3 scale `[1]` mapping `absmax` to 448 (compressed-tensors' float8 symmetric
    convention)."""
    absmax = torch.as_tensor(absmax, dtype=torch.float32).reshape(1)
    scale = (absmax / FP8_E4M3_MAX).to(scale_dtype)
    return torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)


def fp8_fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round `x / scale` to float8 e4m3 (saturating) and back."""
    scaled = torch.clamp(x.float() / scale.float(), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return (scaled.to(torch.float8_e4m3fn).float() * scale.float()).to(x.dtype)
