"""CPU backend: the fastest measured path per scheme and batch size M (AVX2 + FMA hosts; AMX hosts: see the
end).

Paths (thresholds from `python benchmarks/kernel_speed.py`; measurements in docs/benchmarks.md):
- `dense`: fp32 F.linear. bf16 F.linear runs as M GEMVs (no bf16 GEMM on AVX2): below DENSE_BF16_MAX_M rows
  ascq's native bf16 kernel (bf16_mm.c: each weight row read once for all rows, several times torch at small
  M), from there the bf16 weight is copied into an fp32 workspace and multiplied in fp32 (the crossover
  measured on SmolLM2's layers). An fp32 engine's weight whose values bf16 holds exactly (a bf16 checkpoint
  served in fp32, `--dtype auto` on the CPU) is kept in bf16 and takes the same two paths with fp32
  activations: the same values at half the bytes per decode step (torch's fp32 GEMV also streams its weight
  far below the memory bound); only the fp32 summation order differs from F.linear's. The LM head (vocab x
  hidden, so the per-call copy is large) uses the native kernel below LM_HEAD_BF16_MAX_M rows, where it beats
  both the copy + fp32 GEMM and torch's bf16 GEMVs.
- `native` (w4a16 / w8a16 with bf16 activations, in % 32 == 0, groups a multiple of 32 or per channel via
  replicated scales, any zero points): ascq's AVX2 kernel (weight_only_mm.c via native.py; activations as
  per-token 16-bit fixed point, 16 weights per madd) below NATIVE_MAX_M, faster than torch's int4pack at M=1;
  from there dequantize + fp32 GEMM from the packed copy (the only copy kept). 4-bit weights from
  W4_A8_MIN_M rows run with 8-bit activations per row and group instead (`native.weight_only_mm`'s
  activation_bits=8: half the multiplies, about 1.5x the 16-bit kernel and past the fp32 GEMM at every M
  measured; vLLM's CPU AWQ/GPTQ path through IPEX quantizes activations to int8 per input block too), unless
  ASCQ_W4_ACTIVATION_BITS=16. Used when the kernel builds here (a C compiler, x86-64 with AVX2/FMA), else
  int4pack / int8pack:
- `int4pack` (w4a16, out % 16 == 0, group 32/64/128/256, or per channel with in % 32 == 0 via replicated
  scales): aten._weight_int4pack_mm_for_cpu with bf16 activations below INT4PACK_MAX_M; from there dequantize
  + fp32 GEMM is faster, unpacking the int4pack copy itself (its layout is checked per layer at load; only if
  it differs are the int8 values kept as well).
- `int8pack` (w8a16 per-channel symmetric): aten._weight_int8pack_mm with bf16 activations below
  INT8PACK_MAX_M.
- `native_int8` (w8a8 static/dynamic, w4a8 dynamic, per channel, in % 32 == 0, a 4-bit weight's input
  symmetric): below NATIVE_INT8_MAX_M rows ascq's native kernel on the weight-only layout, the activations
  rounded to int8 inside it as the scheme defines (`native.int8_activation_mm`: per token or per tensor, the
  same bits as `integer_activations`), exact int32 products of the integers (fbgemm's), the scales applied
  after; at M = 1 fbgemm runs its GEMM machinery for one row (twice for int8 weights, see below) and streams
  the weights far below the memory bound. From there the `fbgemm` path on its own prepacked copy (no int8
  copy is kept besides the two; large M dequantizes from the native copy).
- `fbgemm` (w8a8 static/dynamic, w4a8 dynamic, per channel): fbgemm's int8 GEMM with explicit input qparams,
  exact. AVX2 multiplies u8 x s8 pairs into saturating int16, so activations must stay within 7 bits: for int8
  weights the integer activation v (|v| <= 255) is split as v = 4*h + l (h in [-64, 63], l in [0, 3]) and run
  as two GEMMs; int4 weights need no split (and win at every M); split int8 runs below FBGEMM_SPLIT_MAX_M.
  Per-token scales are applied after the GEMM, so a token's result never depends on the rest of the batch.
- `dequant`: everything else (fp32 activations for weight-only schemes, group sizes the kernels lack) and
  large M: dequantize into an fp32 workspace and run an fp32 GEMM on the (fake-quantized) activations.
On hosts with AMX or AVX-512 BF16 (`BF16_GEMM_FAST`) torch's bf16 GEMM is several times its fp32 GEMM, so
large products run in bf16 instead: dense bf16 from DENSE_BF16_MAX_M rows, weight-only from
BF16_GEMM_NATIVE_MAX_M rows (dequantized into bf16; from BF16_GEMM_UNCACHED_NATIVE_MAX_M rows for a linear
whose bf16 copy is not kept), the LM head from BF16_GEMM_LM_HEAD_MIN_M rows; activations of these schemes are
bf16 already, the weights' dequantized values are rounded to bf16 (relative error 2^-9). The workspaces are
module-level buffers (one per dtype) grown to the largest layer: the backend is single-threaded. Attention:
cpu_attention.py (paged_sdpa's, with decode rows read in place by the native kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ascq import envs
from ascq.kernels import QuantLinearWeights, linear_over_rows, moe, native
from ascq.kernels.cpu_attention import paged_attention
from ascq.kernels.paged_sdpa import write_kv_cache
from ascq.kernels.reference import fake_quantize_input, integer_activations, select_experts

__all__ = ["linear", "moe_experts", "paged_attention", "prepare_experts", "prepare_linear", "select_experts"]
__all__ += ["streamed_bytes", "write_kv_cache"]

DENSE_BF16_MAX_M = 32
LM_HEAD_BF16_MAX_M = 128
INT4PACK_MAX_M = 256
NATIVE_MAX_M = 512  # the crossover with dequantize + fp32 GEMM on SmolLM2's shapes
INT8PACK_MAX_M = 64
NATIVE_INT8_MAX_M = 8  # W8A8 / W4A8: the native int8-activation kernel below, fbgemm from here
# 4-bit weight-only products from this many rows take the 8-bit activation kernel (at M = 1 both kernels
# stream the weight from DRAM at the same speed; from 2 rows it wins: benchmarks/kernel_speed.py)
W4_A8_MIN_M = 2
W4_ACTIVATION_BITS = envs.ASCQ_W4_ACTIVATION_BITS  # read once: a per-call read costs more than a small GEMV
# Where torch's bf16 GEMM runs on AMX tiles (`BF16_GEMM_FAST`), large products take it instead of the fp32
# GEMM: weight-only: the native kernel below, bf16 dequantization + bf16 GEMM from here (measured on SmolLM2's
# shapes)
BF16_GEMM_NATIVE_MAX_M = 24
BF16_GEMM_LM_HEAD_MIN_M = 8  # LM head: native bf16 kernel below, torch's bf16 GEMM from here
# A weight-only linear without a kept bf16 copy (the model's linears exceed the budget, see `bf16_copies_for`)
# dequantizes (and oneDNN packs) on every bf16 GEMM call, which the native kernel outruns up to this many rows
# (deepseek-moe-16b's 2816 x 2048 experts, one thread, EPYC-512: 6.0 vs 7.4 ms at 64 rows, 9.0 vs 7.6 at 96;
# at 8 rows 0.8 vs 3.9)
BF16_GEMM_UNCACHED_NATIVE_MAX_M = 80
# Linears on the bf16 GEMM path keep a bf16 copy of their weight (4x an int4 weight's bytes; dense bf16: a
# second copy) while the process total stays within ASCQ_BF16_WEIGHT_CACHE_MB, instead of dequantizing (and
# oneDNN repacking) on every call, a sizeable share of a batched decode step; past it they do that per call. 0
# turns the copies off. The kept copy is in oneDNN's blocked layout (packed for ONEDNN_PACK_ROWS rows:
# identical results, faster than packing per call).
ONEDNN_PACK_ROWS = 64
_bf16_cache_bytes = 0
_bf16_copies_off = False  # while loading a model whose linears the budget cannot all hold (`bf16_copies_for`)
FBGEMM_SPLIT_MAX_M = 256
INT4PACK_GROUP_SIZES = (256, 128, 64, 32)
ACTIVATION_SPLIT = 4  # v = 4*h + l keeps fbgemm's u8 activations within 7 bits
INT4PACK_BLOCK_N = 32  # int4pack layout: [out/32, in, 16] bytes, low nibbles rows 0-15 of a block, high 16-31

_workspaces: dict[torch.dtype, torch.Tensor] = {}


def _workspace(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    buf = _workspaces.get(dtype)
    if buf is None or buf.numel() < rows * cols:
        # a normal tensor: the engine runs under inference mode, tests do not
        with torch.inference_mode(False):
            buf = _workspaces[dtype] = torch.empty(rows * cols, dtype=dtype)
    return buf[: rows * cols].view(rows, cols)


def _detect_bf16_gemm() -> str | None:
    """Where torch's bf16 GEMM outruns its fp32 GEMM on this CPU, how: oneDNN runs it on AMX tiles ("amx") or
    with AVX-512 BF16 dot products ("avx512_bf16"), several times its fp32 GEMM either way; None without
    either (AVX2 hosts: bf16 products run as GEMVs, several times slower than fp32). `ASCQ_BF16_GEMM=1|0`
    (read at import) forces the answer ("amx"'s thresholds when forced on)."""
    forced = envs.ASCQ_BF16_GEMM
    if forced is not None:
        return "amx" if forced else None
    for kind, probe in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, probe, lambda: False)():
            return kind
    return None


BF16_GEMM_KIND = _detect_bf16_gemm()
BF16_GEMM_FAST = BF16_GEMM_KIND is not None  # a plain global: compiled decode graphs read it as a constant
if BF16_GEMM_KIND == "avx512_bf16":  # the packed bf16 GEMM wins from a few rows there (SmolLM2's shapes)
    BF16_GEMM_NATIVE_MAX_M, DENSE_BF16_MAX_M = 3, 4
# torch's int8 GEMM (`torch._int_mm`, exact int32 sums) on VNNI hosts: several times the fp32 GEMM on
# SmolLM2's shapes; not measured without VNNI
INT8_GEMM_FAST = bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)())


def native_max_m() -> int:
    """The most rows + 1 the native weight-only kernel serves on this host (from there: the large-M path)."""
    return BF16_GEMM_NATIVE_MAX_M if BF16_GEMM_FAST else NATIVE_MAX_M


@dataclass
class Int4PackWeights:
    packed: torch.Tensor  # aten int4pack uint8
    group_size: int
    scales_and_zeros: torch.Tensor  # bf16 [groups, out, 2]


@dataclass
class Int8PackWeights:
    scales: torch.Tensor  # bf16 [out]


@dataclass
class FbgemmWeights:
    params: Any  # torch.ops.quantized.linear_prepack's packed params


@dataclass
class CpuLinear:
    kernel: str  # dense | native | int4pack | int8pack | native_int8 | fbgemm | dequant
    weights: QuantLinearWeights  # scheme and input qparams; its weight is on the meta device
    out_features: int
    weight: torch.Tensor | None  # dense: float; else int8 [out, in] for the dequant path (None: unused)
    scale: torch.Tensor | None = None  # fp32 [out, groups]
    zero: torch.Tensor | None = None  # fp32 [out, groups]
    packed: native.PackedWeights | Int4PackWeights | Int8PackWeights | FbgemmWeights | None = (
        None  # the kernel's own copy
    )
    bias: torch.Tensor | None = None  # fp32
    bf16_weight: torch.Tensor | None = (
        None  # AMX hosts: the bf16 weight kept within ASCQ_BF16_WEIGHT_CACHE_MB
    )
    bf16_prepacked: bool = False  # bf16_weight is in oneDNN's blocked layout (`_onednn_pack`)
    # native_int8: fbgemm's copy for medium M (`packed`: the native one), the activations' static qparams
    fbgemm: FbgemmWeights | None = None
    input_scale: float | None = None  # None: per token (dynamic)
    input_zero_point: int = 0


def _int4pack_group_size(w: QuantLinearWeights) -> int | None:
    if w.out_features % 16:
        return None
    if w.group_size is not None and w.group_size != w.in_features:
        return w.group_size if w.group_size in INT4PACK_GROUP_SIZES else None
    return next((g for g in INT4PACK_GROUP_SIZES if w.in_features % g == 0), None)


def native_per_channel_group_size(in_features: int, num_bits: int) -> int | None:
    """The group size the native kernel runs a per-channel weight with: the largest multiple of 32 up to its
    maximum that divides in_features (None: in_features is not a multiple of 32)."""
    if in_features % 32:
        return None
    return next(
        g for g in range(min(in_features, native.MAX_GROUP_SIZE[num_bits]), 0, -32) if in_features % g == 0
    )


def _native_group_size(w: QuantLinearWeights) -> int | None:
    """The group size the native kernel runs `w` with (per channel: `native_per_channel_group_size`)."""
    if w.in_features % 32:
        return None
    if w.group_size is not None and w.group_size != w.in_features:
        return (
            w.group_size
            if w.group_size % 32 == 0 and w.group_size <= native.MAX_GROUP_SIZE[w.num_bits]
            else None
        )
    return native_per_channel_group_size(w.in_features, w.num_bits)


def _static_input_qparams(w: QuantLinearWeights) -> tuple[float | None, int]:
    """(input scale, input zero point) of a static W8A8 linear; (None, 0) for per-token activations."""
    if w.scheme != "w8a8_static":
        return None, 0
    zero = 0 if w.input_zero_point is None else int(w.input_zero_point.reshape(()))
    return float(w.input_scale.float().reshape(())), zero


def _native_int8_applies(w: QuantLinearWeights) -> bool:
    """Whether the native kernel takes this per-channel W8A8 / W4A8 linear (`native.int8_activation_mm`)."""
    scale, zero = _static_input_qparams(w)
    return (
        native_per_channel_group_size(w.in_features, w.num_bits) is not None
        and (scale is None or scale > 0)
        and (w.num_bits == 8 or zero == 0)
        and native.load() is not None
    )


def _choose_kernel(w: QuantLinearWeights, dtype: torch.dtype) -> str:
    per_channel = w.group_size is None or w.group_size == w.in_features
    if w.scheme == "dense":
        return "dense"
    if w.scheme in ("w8a8_dynamic", "w8a8_static", "w4a8_dynamic"):
        if not per_channel:
            return "dequant"
        return "native_int8" if _native_int8_applies(w) else "fbgemm"
    if dtype != torch.bfloat16:
        return "dequant"
    if w.scheme in ("w4a16", "w8a16") and _native_group_size(w) is not None and native.load() is not None:
        return "native"
    if w.scheme == "w4a16" and _int4pack_group_size(w) is not None:
        return "int4pack"
    if w.scheme == "w8a16" and per_channel and w.zero_point is None:
        return "int8pack"
    return "dequant"


def _prepare_int4pack(p: CpuLinear) -> None:
    group_size = _int4pack_group_size(p.weights)
    num_groups = p.weight.shape[1] // group_size
    scale = p.scale.repeat_interleave(num_groups // p.scale.shape[1], dim=1)
    zero = (
        torch.zeros_like(scale)
        if p.zero is None
        else p.zero.repeat_interleave(num_groups // p.zero.shape[1], 1)
    )
    unsigned = (p.weight.to(torch.int32) + 8).contiguous()
    # the kernel computes (u - 8) * scale + offset; ours is (q - zero) * scale with q = u - 8
    p.packed = Int4PackWeights(
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2),
        group_size,
        torch.stack([scale.T, (-zero * scale).T], dim=-1).to(torch.bfloat16).contiguous(),
    )


def _prepare_native(p: CpuLinear) -> None:
    bits, group_size = p.weights.num_bits, _native_group_size(p.weights)
    repeats = p.weights.in_features // group_size // p.scale.shape[1]
    zeros = None if p.zero is None else p.zero.repeat_interleave(repeats, 1)
    p.packed = native.pack(p.weight, bits, p.scale.repeat_interleave(repeats, 1), zeros, group_size)
    p.weight = None  # large M dequantizes from the packed copy
    if BF16_GEMM_FAST:  # large M dequantizes from the packed copy's own qparams (`_bf16_values`)
        p.scale = p.zero = None
        return
    # else with these, in the fewest bytes that hold them exactly (fp32 qparams of group 64: 1/8 byte each)
    p.scale = native.compact_qparams(p.scale, integral=False)
    p.zero = None if p.zero is None else native.compact_qparams(p.zero, integral=True)


def _fbgemm_weights(p: CpuLinear) -> FbgemmWeights:
    zero = torch.zeros(p.out_features, dtype=torch.int64) if p.zero is None else p.zero[:, 0].round().long()
    with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes them
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(p.weight, p.scale[:, 0].double(), zero, 0)
        return FbgemmWeights(torch.ops.quantized.linear_prepack(qweight, None))


def _prepare_native_int8(p: CpuLinear) -> None:
    """fbgemm's copy for medium M, the native layout (per-channel qparams repeated per kernel group) for small
    M and the dequantized large-M path; the int8 values themselves are not kept."""
    p.fbgemm = _fbgemm_weights(p)
    bits, in_features = p.weights.num_bits, p.weights.in_features
    repeats = in_features // native_per_channel_group_size(in_features, bits)
    zeros = None if p.zero is None else p.zero.repeat_interleave(repeats, 1)
    scales = p.scale.repeat_interleave(repeats, 1)
    p.packed = native.pack(p.weight, bits, scales, zeros, in_features // repeats)
    p.weight = None
    p.input_scale, p.input_zero_point = _static_input_qparams(p.weights)


def _metadata_only(w: QuantLinearWeights) -> QuantLinearWeights:
    """`w` with its weight and weight qparams on the meta device: the scheme, shapes and input qparams,
    without holding a second copy of what the prepared linear keeps (`scale`, `zero`, the packed copy)."""
    on_meta = {
        name: getattr(w, name).to("meta")
        for name in ("weight", "weight_scale", "zero_point")
        if getattr(w, name) is not None
    }
    return dataclasses.replace(w, **on_meta)


def prepare_linear(w: QuantLinearWeights, dtype: torch.dtype = torch.float32) -> CpuLinear:
    kernel = _choose_kernel(w, dtype)
    bias = None if w.bias is None else w.bias.float()
    meta = _metadata_only(w)
    if kernel == "dense":
        p = CpuLinear(kernel, meta, w.out_features, _dense_weight(w.weight, dtype), bias=bias)
        return _with_bf16_copy(p) if dtype == torch.bfloat16 else p
    zero = None if w.zero_point is None else w.zero_point.float()
    p = CpuLinear(
        kernel, meta, w.out_features, w.weight.contiguous(), w.weight_scale.float(), zero, bias=bias
    )
    if kernel == "native":
        _prepare_native(p)
    elif kernel == "int4pack":
        _prepare_int4pack(p)
        if _unpacks_exactly(p):
            p.weight = None  # keep 4 bits per weight: large M dequantizes from the packed copy
    elif kernel == "int8pack":
        p.packed = Int8PackWeights(p.scale[:, 0].to(torch.bfloat16))
    elif kernel == "native_int8":
        _prepare_native_int8(p)
    elif kernel == "fbgemm":
        p.packed = _fbgemm_weights(p)
        if w.num_bits == 4:
            p.weight = None  # fbgemm keeps its own copy and serves every M
    return _with_bf16_copy(p)


def _dense_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense weight as the `dense` path keeps it: in `dtype`, except an fp32 engine's weight whose values
    bf16 holds exactly, kept in bf16 where the native bf16 kernel takes it."""
    native_bf16 = weight.shape[1] % 16 == 0 and native.available()
    if dtype == torch.float32 and native_bf16 and weight.dtype in (torch.bfloat16, torch.float32):
        values = weight.bfloat16()
        if weight.dtype == torch.bfloat16 or torch.equal(values.float(), weight):
            return values.contiguous()
    return weight.to(dtype).contiguous()


def _with_bf16_copy(p: CpuLinear) -> CpuLinear:
    """`p`, with a kept bf16 copy of its weight (`bf16_weight`) made at load where it will take the bf16 GEMM
    path and the budget (ASCQ_BF16_WEIGHT_CACHE_MB) allows; oneDNN-packed where this torch build can
    (`_onednn_pack`)."""
    global _bf16_cache_bytes
    bf16_dense = p.kernel == "dense" and p.weight.dtype == torch.bfloat16
    eligible = bf16_dense or p.kernel in ("native", "int4pack", "int8pack")
    size = p.out_features * p.weights.in_features * 2
    if not (BF16_GEMM_FAST and eligible and _bf16_copy_fits(size)):
        return p
    with torch.inference_mode(False):  # kept across calls: a normal tensor
        weight = _bf16_values(p)
        packed = _onednn_pack(weight)
        if packed is None and bf16_dense:
            return p  # nothing to gain from a second plain copy
        p.bf16_weight, p.bf16_prepacked = (weight.clone(), False) if packed is None else (packed, True)
    _bf16_cache_bytes += size
    weakref.finalize(p.bf16_weight, _release_bf16_copy, size)  # a freed model gives its budget back
    return p


def _unpack_int4pack_into(p: CpuLinear, buf: torch.Tensor) -> torch.Tensor:
    """The signed int4 values of an int4pack weight, written into `buf` [out, in] (any float dtype)."""
    out_features, in_features = buf.shape
    packed = p.packed.packed.view(
        out_features // INT4PACK_BLOCK_N, in_features, INT4PACK_BLOCK_N // 2
    ).transpose(1, 2)
    blocks = buf.view(out_features // INT4PACK_BLOCK_N, INT4PACK_BLOCK_N, in_features)
    blocks[:, : INT4PACK_BLOCK_N // 2].copy_(packed & 15)
    blocks[:, INT4PACK_BLOCK_N // 2 :].copy_(packed >> 4)
    return buf.sub_(8)


def _unpacks_exactly(p: CpuLinear) -> bool:
    """Whether this torch build's int4pack layout is the one `_unpack_int4pack_into` reads (checked per
    layer)."""
    if p.weight.shape[0] % INT4PACK_BLOCK_N or p.packed.packed.numel() * 2 != p.weight.numel():
        return False
    unpacked = _unpack_int4pack_into(p, torch.empty(p.weight.shape, dtype=torch.int16))
    return torch.equal(unpacked, p.weight.to(torch.int16))


def _dequantized(p: CpuLinear) -> torch.Tensor:
    buf = _workspace(p.out_features, p.weights.in_features)
    if p.kernel == "native" and p.scale is None:  # qparams only in the packed copy
        bf16 = _workspace(p.out_features, p.weights.in_features, torch.bfloat16)
        return buf.copy_(native.dequantize_bf16(None, p.packed, bf16))
    if p.weight is None and p.kernel in ("native", "native_int8"):
        native.unpack_into(p.packed, buf)
    elif p.weight is None:
        _unpack_int4pack_into(p, buf)
    else:
        buf.copy_(p.weight)
    if p.scale is None:
        return buf
    grouped = buf.view(p.scale.shape[0], p.scale.shape[1], -1)
    if p.zero is not None:
        grouped.sub_(p.zero[..., None])
    grouped.mul_(p.scale[..., None])
    return buf


def _dequant_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    return F.linear(fake_quantize_input(x.float(), p.weights), _dequantized(p), p.bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 [out, in] weight reordered into oneDNN's blocked layout (what inductor's CPU freezing keeps), or
    None where this torch build lacks the op."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None


def _bf16_copy_fits(size: int) -> bool:
    return not _bf16_copies_off and _bf16_cache_bytes + size <= envs.ASCQ_BF16_WEIGHT_CACHE_MB << 20


@contextlib.contextmanager
def bf16_copies_for(model_bytes: int) -> Iterator[None]:
    """While loading a model whose linears take `model_bytes` in bf16: bf16 weight copies only if all of them
    fit the budget. Copies of the first layers of a larger model would spend the whole budget on a few percent
    of its dequantization work (deepseek-moe-16b: 1 GiB for about 3 % of its linears)."""
    global _bf16_copies_off
    before = _bf16_copies_off
    _bf16_copies_off = _bf16_cache_bytes + model_bytes > envs.ASCQ_BF16_WEIGHT_CACHE_MB << 20
    try:
        yield
    finally:
        _bf16_copies_off = before


def _bf16_values(p: CpuLinear) -> torch.Tensor:
    """`p`'s weight in bf16 [out, in]: the dense weight itself, or the weight dequantized into a workspace."""
    if p.kernel == "dense":
        return p.weight
    weight = _workspace(p.out_features, p.weights.in_features, torch.bfloat16)
    if p.kernel == "native":
        return native.dequantize_bf16(None, p.packed, weight)
    return weight.copy_(_dequantized(p))


def _release_bf16_copy(size: int) -> None:
    global _bf16_cache_bytes
    _bf16_cache_bytes -= size


def _bf16_gemm_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    """x @ W.T as one bf16 GEMM on `p`'s bf16 weight (dense, or dequantized from a weight-only scheme whose
    activations are bf16): AMX hosts, large M."""
    x = x.to(torch.bfloat16).contiguous()
    # inductor cannot lower the mkldnn op on a fused input
    if p.bf16_prepacked and torch.compiler.is_compiling():
        y = torch.ops.ascq.bf16_packed_linear(x, p.bf16_weight, p.out_features)
    elif p.bf16_prepacked:
        y = _packed_linear(x, p.bf16_weight, p.out_features)
    else:  # bf16, as the activations it goes back into
        y = F.linear(x, _bf16_values(p) if p.bf16_weight is None else p.bf16_weight)
    return y if p.bias is None else y.float() + p.bias


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [None], "")


# the packed GEMM as an operator opaque to graph capture (as native.py's kernels)
_OPS = torch.library.Library("ascq", "FRAGMENT")
_OPS.define("bf16_packed_linear(Tensor x, Tensor weight, int out_features) -> Tensor")
for _key in ("CPU", "MkldnnCPU"):  # the packed weight is an MKLDNN tensor where this build packs to one
    _OPS.impl("bf16_packed_linear", _packed_linear, _key)


@torch.library.register_fake("ascq::bf16_packed_linear", lib=_OPS)
def _(x, weight, out_features):
    return x.new_empty((x.shape[0], out_features), dtype=torch.bfloat16)


def _large_m_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    """Rows past a kernel's threshold: one bf16 GEMM on AMX hosts, else an fp32 GEMM on the dequantized
    weight."""
    return _bf16_gemm_linear(x, p) if BF16_GEMM_FAST else _dequant_linear(x, p)


def bf16_small_m_linear(
    x: torch.Tensor, weight: torch.Tensor, max_m: int | None = None
) -> torch.Tensor | None:
    """fp32 x @ weight.T by the native bf16 kernel (M < max_m rows share one pass over the weights, each row's
    result independent of M), or None where it does not apply (weight not bf16, M too large, K % 16, no native
    library)."""
    max_m = DENSE_BF16_MAX_M if max_m is None else max_m  # read per call: the host's threshold, or a test's
    if weight.dtype != torch.bfloat16 or x.shape[0] >= max_m or weight.shape[1] % 16:
        return None
    return native.bf16_mm(None, x, weight) if native.available() else None


def _dense_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    if p.weight.dtype == torch.bfloat16 and x.shape[0] >= DENSE_BF16_MAX_M:
        # fp32 activations (a bf16-exact weight of an fp32 engine) stay fp32
        return _large_m_linear(x, p) if x.dtype == torch.bfloat16 else _dequant_linear(x, p)
    y = bf16_small_m_linear(x, p.weight)
    if y is not None:  # fp32; `linear` rounds it to x's dtype
        return y if p.bias is None else y + p.bias
    bias = None if p.bias is None else p.bias.to(p.weight.dtype)
    return F.linear(x.to(p.weight.dtype), p.weight, bias)


def _int4pack_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    if x.shape[0] >= INT4PACK_MAX_M:
        return _large_m_linear(x, p)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16).contiguous(), p.packed.packed, p.packed.group_size, p.packed.scales_and_zeros
    )
    return y if p.bias is None else y + p.bias


def w4_a8_min_rows() -> int:
    """The fewest rows a 4-bit native product takes 8-bit activations from on this host (0: never)."""
    return W4_A8_MIN_M if W4_ACTIVATION_BITS == 8 and not BF16_GEMM_FAST else 0


def _native_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    a8_min_rows = w4_a8_min_rows()
    if p.packed.bits == 4 and 0 < a8_min_rows <= x.shape[0]:
        y = native.weight_only_mm(None, x, p.packed, activation_bits=8)
        return y if p.bias is None else y + p.bias
    uncached = BF16_GEMM_FAST and p.bf16_weight is None
    if x.shape[0] >= (max(native_max_m(), BF16_GEMM_UNCACHED_NATIVE_MAX_M) if uncached else native_max_m()):
        return _large_m_linear(x, p)
    y = native.weight_only_mm(None, x, p.packed)
    return y if p.bias is None else y + p.bias


def _int8pack_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    if x.shape[0] >= INT8PACK_MAX_M:
        return _large_m_linear(x, p)
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), p.weight, p.packed.scales)
    return y if p.bias is None else y + p.bias


def _native_int8_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    if x.shape[0] >= NATIVE_INT8_MAX_M:
        return _fbgemm_linear(x, p)
    y = native.int8_activation_mm(None, x, p.packed, p.input_scale, p.input_zero_point)
    return y if p.bias is None else y + p.bias


def _fbgemm_linear(x: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    if p.weights.num_bits == 8 and x.shape[0] >= FBGEMM_SPLIT_MAX_M:
        return _dequant_linear(x, p)
    gemm = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    v, scale = integer_activations(x.float(), p.weights)
    params = (p.packed if p.fbgemm is None else p.fbgemm).params
    if p.weights.num_bits == 4:
        y = gemm(v, 1.0, 128, params)
    else:
        high = torch.floor(v / ACTIVATION_SPLIT)
        y = gemm(high, 1.0, 64, params) * ACTIVATION_SPLIT + gemm(v - high * ACTIVATION_SPLIT, 1.0, 0, params)
    y = y * scale
    return y if p.bias is None else y + p.bias


_LINEARS = {
    "dense": _dense_linear,
    "native": _native_linear,
    "int4pack": _int4pack_linear,
    "int8pack": _int8pack_linear,
    "native_int8": _native_int8_linear,
    "fbgemm": _fbgemm_linear,
    "dequant": _dequant_linear,
}


def streamed_bytes(p: CpuLinear) -> int:
    """The bytes of weights and qparams a small-M product of `p` reads (the copy its kernel keeps for decode
    batches; the dequantizing path also writes and reads its fp32 workspace): what one decode step moves from
    memory for this linear, whatever the batch."""
    workspace = 0
    if p.kernel in ("native", "native_int8"):
        parts = (p.packed.data, p.packed.scales, p.packed.zeros)
    elif p.kernel == "int4pack":
        parts = (p.packed.packed, p.packed.scales_and_zeros)
    elif p.kernel == "fbgemm":  # its prepacked copy: a byte per weight
        return p.out_features * p.weights.in_features
    else:
        parts = (p.weight, p.scale, p.zero)
        workspace = 2 * 4 * p.out_features * p.weights.in_features if p.kernel == "dequant" else 0
    return workspace + sum(t.numel() * t.element_size() for t in (*parts, p.bias) if t is not None)


def _linear_rows(rows: torch.Tensor, p: CpuLinear) -> torch.Tensor:
    return _LINEARS[p.kernel](rows, p)


def linear(x: torch.Tensor, prepared: CpuLinear) -> torch.Tensor:
    return linear_over_rows(_linear_rows, x, prepared)


# MoE experts: moe.py's grouped experts over this backend's linear
prepare_experts = functools.partial(moe.prepare_experts, prepare_linear)
moe_experts = functools.partial(moe.moe_experts, linear)
