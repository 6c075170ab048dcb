"""The compressed-tensors checkpoint format: the only module of ascq that knows its tensor names.

- `compress_linear`: a quantized linear -> its on-disk tensors, through the pinned library's own compressor
  (`int-quantized`: int8 `weight`; `pack-quantized`: `weight_packed` int32 + `weight_shape`, asymmetric zero
  points packed along the output dim; `naive-quantized` for float zero points (`zp_dtype` a float dtype): int8
  `weight` holding the int4 values, `weight_zero_point` in `zp_dtype`, because pack-quantized packs zero
  points into int32 and so holds integers only. transformers loads it (compressed-tensors decompresses it);
  vLLM's compressed-tensors int4 path reads pack-quantized only.)
- `decompress_linear`: the on-disk tensors -> the signed-int convention of docs/ARCHITECTURE.md
  (`weight` int8 values, `weight_scale`, `zero_point` int8 or absent, `input_scale`, `bias` as stored).
- `scheme_name`: the kernels' name for a config group's weights + activations (w8a8_dynamic, w4a16, ...).
- `match_scheme`: which config group a module gets (the library's matcher: ignore first, then the most
  specific target: exact name, regex, class name), as transformers and vLLM pick it.
- `linear_tensor_specs` / `linear_bytes`: the tensor names, safetensors dtypes and shapes a linear is stored
  as (what `zoo verify` checks, what the planner counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.utils.match import is_match, match_targets
from torch import nn

from ascq.core import qmath
from ascq.core.errors import AscqError
from ascq.formats import QuantizedLinear

FORMAT = "compressed-tensors"
PACKED = "pack-quantized"
INT = "int-quantized"
NAIVE = "naive-quantized"  # int8-stored weights with float zero points (see compression_format)
SUPPORTED_FORMATS = (INT, PACKED, NAIVE)
ZP_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
# parameter names only a quantized linear has (a dense module holding one is stored quantized)
QUANTIZED_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
LINEAR = nn.Linear(1, 1, device="meta")  # stands for a checkpoint linear when matching class-name targets


def compression_format(weights: QuantizationArgs, input_activations: QuantizationArgs | None) -> str:
    """The on-disk format compressed-tensors itself picks for a scheme (int-quantized / pack-quantized), or
    naive-quantized for float zero points, which the packed format cannot hold."""
    if qmath.float_zero_point(weights):
        return NAIVE
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)
    return infer_module_format(nn.Linear, scheme).value


def scheme_name(weights: QuantizationArgs, input_activations: QuantizationArgs | None) -> str:
    """ascq's scheme name (docs/ARCHITECTURE.md) for int weights + activations: w{4,8}a16,
    w{4,8}a8_{dynamic,static}."""
    if input_activations is None:
        return f"w{weights.num_bits}a16"
    return f"w{weights.num_bits}a8_{'dynamic' if input_activations.dynamic else 'static'}"


def match_scheme(
    name: str, groups: Iterable[QuantizationScheme], ignore: list[str], module: nn.Module = LINEAR
) -> QuantizationScheme | None:
    """The config group of module `name` (None: ignored or no target matches), most specific target first."""
    by_target = {t: s for s in groups for t in s.targets}
    if not by_target or is_ignored(name, ignore, module):
        return None
    matched = match_targets(name, module, list(by_target))
    return by_target[matched[0]] if matched else None


def is_ignored(name: str, ignore: list[str], module: nn.Module = LINEAR) -> bool:
    return bool(ignore) and is_match(name, module, ignore)


def required_params(scheme: QuantizationScheme, fmt: str) -> set[str]:
    """The tensor names a quantized linear of `scheme` must have in format `fmt` (the library's
    compressor's)."""
    required = set(BaseCompressor.load_from_registry(fmt).compression_param_names(scheme))
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        required.add("input_scale")
    return required


def compress_linear(
    weights: QuantizationArgs,
    input_activations: QuantizationArgs | None,
    ql: QuantizedLinear,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one linear (local names), as the library's compressor writes them."""
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)
    compressor = BaseCompressor.get_value_from_registry(compression_format(weights, input_activations))
    state = {
        "weight": qmath.dequantize_weight(ql.q, ql.scale, ql.zero_point, weights),
        "weight_scale": ql.scale,
    }
    if ql.zero_point is not None:
        state["weight_zero_point"] = ql.zero_point
    out = dict(compressor.compress(state, scheme))
    if qmath.float_zero_point(weights) and not torch.equal(out["weight"], ql.q):
        raise AscqError("compressed-tensors re-quantized a float-zero-point weight to other values")
    if ql.input_scale is not None:
        out["input_scale"] = ql.input_scale
    if bias is not None:
        out["bias"] = bias
    return out


def is_quantized(params: Iterable[str]) -> bool:
    """Whether a module's stored parameter names are those of a quantized linear."""
    return "weight_scale" in set(params)


def decompress_linear(tensors: dict[str, torch.Tensor], num_bits: int) -> dict[str, torch.Tensor]:
    """A quantized linear's stored tensors (local names) in the signed-int convention.

    Returns `weight` (int8 values [out, in]), `weight_scale`, `zero_point` (the scale's shape; int8, or the
    stored float dtype for float zero points; only when asymmetric) and every other tensor (`input_scale`,
    `input_zero_point`, `bias`) unchanged.
    """
    rest = dict(tensors)
    scale = rest["weight_scale"]
    packed, shape = rest.pop("weight_packed", None), rest.pop("weight_shape", None)
    zero_point = rest.pop("weight_zero_point", None)
    if packed is not None:
        if shape is None:
            raise AscqError("a pack-quantized linear lacks weight_shape")
        out_features, in_features = (int(v) for v in shape.tolist())
        rest["weight"] = unpack_from_int32(packed, num_bits, torch.Size([out_features, in_features]))
        if zero_point is not None:
            zp_shape = torch.Size([out_features, scale.shape[-1]])
            zero_point = unpack_from_int32(zero_point, num_bits, zp_shape, packed_dim=0)
    if "weight" not in rest:
        raise AscqError("a quantized linear has neither weight nor weight_packed")
    rest["weight"] = rest["weight"].to(torch.int8)
    if zero_point is not None:
        zero_point = zero_point if zero_point.is_floating_point() else zero_point.to(torch.int8)
        rest["zero_point"] = zero_point.reshape(scale.shape)
    return rest


def quantized_linear(tensors: dict[str, torch.Tensor], num_bits: int) -> QuantizedLinear:
    """`decompress_linear` as a `QuantizedLinear` (the bias, if any, is not part of it)."""
    d = decompress_linear(tensors, num_bits)
    return QuantizedLinear(d["weight"], d["weight_scale"], d.get("zero_point"), d.get("input_scale"))


def linear_tensor_specs(
    weights: QuantizationArgs,
    input_activations: QuantizationArgs | None,
    out_features: int,
    in_features: int,
    scale_dtype: str = "BF16",
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Local name -> (safetensors dtype, shape) of every tensor a quantized linear is stored as (bias
    excluded)."""
    fmt = compression_format(weights, input_activations)
    bits = weights.num_bits
    if weights.strategy == "group":
        scale_shape: tuple[int, ...] = (out_features, math.ceil(in_features / weights.group_size))
    elif weights.strategy == "tensor":
        scale_shape = (1,)
    else:
        scale_shape = (out_features, 1)
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    if fmt == PACKED:
        specs["weight_packed"] = ("I32", (out_features, math.ceil(in_features * bits / 32)))
        specs["weight_shape"] = ("I64", (2,))
    else:
        specs["weight"] = ("I8", (out_features, in_features))
    specs["weight_scale"] = (scale_dtype, scale_shape)
    if qmath.float_zero_point(weights):
        specs["weight_zero_point"] = (ZP_SAFETENSORS_DTYPES[weights.zp_dtype], scale_shape)
    elif not weights.symmetric:
        zp_rows = math.ceil(scale_shape[0] * bits / 32) if fmt == PACKED else scale_shape[0]
        specs["weight_zero_point"] = ("I32" if fmt == PACKED else "I8", (zp_rows, *scale_shape[1:]))
    if input_activations is not None and not input_activations.dynamic:
        specs["input_scale"] = (scale_dtype, (1,))
    return specs


DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1}


def linear_bytes(
    weights: QuantizationArgs,
    input_activations: QuantizationArgs | None,
    out_features: int,
    in_features: int,
    scale_dtype: str = "BF16",
) -> int:
    """Payload bytes of one quantized linear as stored (safetensors headers not counted)."""
    specs = linear_tensor_specs(weights, input_activations, out_features, in_features, scale_dtype)
    return sum(DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in specs.values())


# what the bits per weight count (`ascq.zoo.card.quantized_weight_bits`): weights, scales and zero points
BITS_COUNTED = ("weight_packed", "weight", "weight_scale", "weight_zero_point")


def linear_stored_bits(
    weights: QuantizationArgs,
    input_activations: QuantizationArgs | None,
    out_features: int,
    in_features: int,
    scale_dtype: str = "BF16",
) -> int:
    """Stored bits of one quantized linear's weights, scales and zero points (`BITS_COUNTED`)."""
    specs = linear_tensor_specs(weights, input_activations, out_features, in_features, scale_dtype)
    counted = [spec for name, spec in specs.items() if name in BITS_COUNTED]
    return sum(8 * DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in counted)


def stored_shape(
    params: dict[str, tuple[str, tuple[int, ...]]], read: Callable[[str], torch.Tensor]
) -> tuple[int, int]:
    """(out, in) of a stored quantized linear from its tensor infos; `read(local name)` reads `weight_shape`
    when the weight is packed."""
    if "weight_shape" in params:
        out_features, in_features = (int(v) for v in read("weight_shape").tolist())
        return out_features, in_features
    out_features, in_features = params["weight"][1]
    return out_features, in_features


def is_linear_module(params: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """A module holding a packed or a 2-D weight."""
    return "weight_packed" in params or ("weight" in params and len(params["weight"][1]) == 2)
