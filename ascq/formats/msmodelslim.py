"""The msModelSlim checkpoint format (what vllm-ascend loads with `--quantization ascend`): the only module of
ascq that knows its tensor names and labels.

- `quant_model_weights.safetensors` (or `quant_model_weights-0000i-of-0000n.safetensors` + index) with HF
  tensor names; MoE experts keep their per-expert names (`mlp.experts.E.gate_proj.weight`, ...);
- `quant_model_description.json`: `model_quant_type`, `version`, `group_size` (+ `kv_cache_type: C8` when int8
  KV scales are written) and one label per tensor: `W8A8` (static), `W8A8_DYNAMIC`, `W4A8_DYNAMIC` or `FLOAT`;
- `config.json` = the source config without `quantization_config`.

Per quantized linear (vllm-ascend's AscendW8A8LinearMethod / AscendW8A8DynamicLinearMethod /
AscendW4A8DynamicLinearMethod parameter names):
- W8A8: `weight` int8 [out, in], `input_scale`, `input_offset` [1], `deq_scale` = input_scale * weight_scale
  [out] (fp32 for bf16 models, the fp32 bit pattern as int64 for fp16 models), `quant_bias` int32 [out] =
  round(bias / deq_scale - input_offset * Σ_k weight), `weight_scale`, `weight_offset` [out, 1];
- W8A8_DYNAMIC: `weight` int8 [out, in], `weight_scale`, `weight_offset` [out, 1];
- W4A8_DYNAMIC: `weight` int8 [out, in] holding int4 values, `weight_scale`, `weight_offset` [out, 1],
  `weight_scale_second`, `weight_offset_second` [out, in // group_size] (per-channel weights: second scale 1).
Weights must be symmetric (vllm-ascend's W8A8/W4A8 kernels ignore weight offsets); offsets are written as
zeros. The static W8A8 `deq_scale` / `quant_bias` identity (`static_dequant_params`) is also what the NPU
backend runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ascq.core.errors import UnsupportedError
from ascq.formats import QuantizedLinear

FORMAT = "msmodelslim"
DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_STEM = "quant_model_weights"
VERSION = "1.0.0"
LABELS = {"w8a8_static": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w4a8_dynamic": "W4A8_DYNAMIC"}
KV_CACHE_LABEL = "C8"
KV_CACHE_SUFFIXES = (".kv_cache_scale", ".kv_cache_offset")
MAX_GROUP_SIZE = 256


def deq_scale_tensor(deq_scale: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """fp32 for bf16 models; for fp16 models the fp32 bit pattern zero-extended to int64
    (npu_trans_quant_param)."""
    deq_scale = deq_scale.float()
    if model_dtype == torch.float16:
        return deq_scale.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return deq_scale


def static_dequant_params(
    q: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    input_offset: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(deq_scale fp32 [out], quant_bias int32 [out]) of a static W8A8 linear: y = (x_int8 @ q^T + quant_bias)
    * deq_scale, quant_bias = round(bias / deq_scale - input_offset * Σ_k q)."""
    deq_scale = input_scale.float().reshape(1) * weight_scale.float().reshape(-1)
    float_bias = torch.zeros(q.shape[0], dtype=torch.float64) if bias is None else bias.double()
    quant_bias = (
        float_bias / deq_scale.double() - input_offset.double().reshape(1) * q.double().sum(dim=1)
    ).round()
    return deq_scale, quant_bias.to(torch.int32)


def _w8a8_static_tensors(ql: QuantizedLinear, bias: torch.Tensor | None, model_dtype: torch.dtype) -> dict:
    # deq_scale from the scales as written, so the loaded tensors satisfy the identity exactly
    input_scale = ql.input_scale.reshape(1).to(model_dtype)
    input_offset = torch.zeros(1)
    deq_scale, quant_bias = static_dequant_params(
        ql.q, ql.scale.to(model_dtype), input_scale, input_offset, bias
    )
    return {
        "input_scale": input_scale,
        "input_offset": input_offset.to(model_dtype),
        "deq_scale": deq_scale_tensor(deq_scale, model_dtype),
        "quant_bias": quant_bias,
    }


def check_scheme(scheme: str) -> None:
    if scheme not in LABELS:
        raise UnsupportedError(
            f"--format msmodelslim writes W8A8 (w8a8-static), W8A8_DYNAMIC (w8a8) and W4A8_DYNAMIC "
            f"(w4a8-dynamic) "
            f"layers; {scheme} has no msModelSlim label (use --format compressed-tensors)"
        )


def compress_linear(
    scheme: str, ql: QuantizedLinear, bias: torch.Tensor | None, model_dtype: torch.dtype, group_size: int
) -> dict[str, torch.Tensor]:
    """One quantized linear's msModelSlim tensors (local names); all of them get the label
    `LABELS[scheme]`."""
    check_scheme(scheme)
    if ql.zero_point is not None and bool(ql.zero_point.any()):
        raise UnsupportedError(
            f"--format msmodelslim needs symmetric weights ({scheme} has weight zero points)"
        )
    out_features, in_features = ql.q.shape
    if ql.scale.shape != (out_features, 1):
        raise UnsupportedError(
            f"--format msmodelslim needs per-channel weight scales, got {tuple(ql.scale.shape)}"
        )
    tensors = {
        "weight": ql.q,
        "weight_scale": ql.scale.to(model_dtype),
        "weight_offset": torch.zeros(out_features, 1, dtype=model_dtype),
    }
    if scheme == "w8a8_static":
        tensors.update(_w8a8_static_tensors(ql, bias, model_dtype))
    if scheme == "w4a8_dynamic":
        groups = in_features // group_size
        tensors["weight_scale_second"] = torch.ones(out_features, groups, dtype=model_dtype)
        tensors["weight_offset_second"] = torch.zeros(out_features, groups, dtype=model_dtype)
    if bias is not None:
        tensors["bias"] = bias.to(model_dtype)
    return tensors


def w4a8_group_size(linear_input_sizes: list[int]) -> int:
    """One group size for the whole description: the largest power of two <= 256 dividing every linear's
    input."""
    common = math.gcd(*linear_input_sizes)
    return min(MAX_GROUP_SIZE, common & -common)


def description(labels: dict[str, str], group_size: int) -> dict[str, Any]:
    """quant_model_description.json for tensor name -> label."""
    quantized = sorted({label for label in labels.values() if label not in ("FLOAT", KV_CACHE_LABEL)})
    header: dict[str, Any] = {
        "model_quant_type": quantized[0] if len(quantized) == 1 else ("FLOAT" if not quantized else "MIXED"),
        "version": VERSION,
        "group_size": group_size if "W4A8_DYNAMIC" in quantized else 0,
    }
    if KV_CACHE_LABEL in labels.values():
        header["kv_cache_type"] = KV_CACHE_LABEL
    return {**header, **dict(sorted(labels.items()))}
