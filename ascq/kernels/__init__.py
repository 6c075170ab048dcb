"""Kernel interface shared by every backend: quantized linear, paged KV cache write + attention, MoE experts.

A backend is a module (`reference`, `cpu`, `cuda`, `npu`) with these functions; see docs/ARCHITECTURE.md
("Kernel interface") for the full contract:

    prepare_linear(w: QuantLinearWeights, dtype) -> prepared         # once at load: repack / transpose / cast
    linear(x [..., in], prepared) -> y [..., out] in x.dtype
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None
    paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    k_scale=1.0, v_scale=1.0) -> [T, H, D] in query.dtype
    select_experts(router_logits, top_k, renormalize) -> (topk_weights fp32 [T, k], topk_ids int64 [T, k])
    prepare_experts(gate, up, down: list[QuantLinearWeights], dtype) -> prepared_experts
    moe_experts(x [T, hidden], topk_weights, topk_ids, prepared_experts) -> [T, hidden] in x.dtype
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ascq.core.errors import AscqError, UnsupportedError
from ascq.platforms import platform_for

SCHEMES = ("dense", "w8a8_dynamic", "w8a8_static", "w4a16", "w8a16", "w4a8_dynamic")
WEIGHT_BITS = {"w8a8_dynamic": 8, "w8a8_static": 8, "w4a16": 4, "w8a16": 8, "w4a8_dynamic": 4}
# weight-only: every backend dequantizes (q - zero) * scale in float
FLOAT_ZERO_POINT_SCHEMES = (
    "w4a16",
    "w8a16",
)


@dataclass
class QuantLinearWeights:
    """One linear layer's weights in the project's quantized convention (docs/ARCHITECTURE.md).

    dense: `weight` is float [out, in]. Quantized: `weight` holds signed integer values [out, in] (int8
    tensor; int4 values in [-8, 7]), `weight_scale` is [out, 1] (per channel) or [out, in // group_size] (per
    group), `zero_point` the same shape (signed int8, or float for weight-only schemes: zp_dtype) or None
    (symmetric); w = (q - zero_point) * scale. w8a8_static: `input_scale` (one value) and optional
    `input_zero_point` quantize activations to int8 as clamp(round(x / input_scale) + input_zero_point).
    Activations of `*_dynamic` are int8 per token, symmetric.
    """

    scheme: str
    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    group_size: int | None = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise UnsupportedError(
                f"unknown quantization scheme {self.scheme!r}; supported: {', '.join(SCHEMES)}"
            )
        if self.weight.dim() != 2:
            raise AscqError(f"linear weight must be 2-D [out, in], got shape {tuple(self.weight.shape)}")
        out_features, in_features = self.weight.shape
        if self.bias is not None and tuple(self.bias.shape) != (out_features,):
            raise AscqError(f"bias shape {tuple(self.bias.shape)} does not match out_features {out_features}")
        if self.scheme == "dense":
            if not self.weight.is_floating_point():
                raise AscqError(f"dense weight must be floating point, got {self.weight.dtype}")
            return
        self._check_quantized(out_features, in_features)

    def _check_quantized(self, out_features: int, in_features: int) -> None:
        if self.weight.dtype != torch.int8:
            raise AscqError(
                f"{self.scheme} weight must be int8 holding signed values, got {self.weight.dtype}"
            )
        if self.weight_scale is None:
            raise AscqError(f"{self.scheme} weight needs weight_scale")
        if self.num_bits == 4 and not self.weight.is_meta:
            low, high = (int(v) for v in torch.aminmax(self.weight))
            if low < -8 or high > 7:
                raise AscqError(
                    f"{self.scheme} weight values must be signed int4 in [-8, 7], got [{low}, {high}]"
                )
        num_groups = 1
        if self.group_size is not None:
            if self.group_size <= 0 or in_features % self.group_size:
                raise AscqError(f"group_size {self.group_size} does not divide in_features {in_features}")
            num_groups = in_features // self.group_size
        if tuple(self.weight_scale.shape) != (out_features, num_groups):
            raise AscqError(
                f"weight_scale shape {tuple(self.weight_scale.shape)} != expected "
                f"{(out_features, num_groups)}"
            )
        zero = self.zero_point
        if zero is not None and zero.shape != self.weight_scale.shape:
            raise AscqError(f"zero_point shape {tuple(zero.shape)} != weight_scale shape")
        if zero is not None and zero.is_floating_point() and self.scheme not in FLOAT_ZERO_POINT_SCHEMES:
            raise UnsupportedError(
                f"{self.scheme}: float weight zero points are supported for "
                f"{' and '.join(FLOAT_ZERO_POINT_SCHEMES)} only (integer activations need integer ones)"
            )
        if self.scheme == "w8a8_static" and (self.input_scale is None or self.input_scale.numel() != 1):
            raise AscqError("w8a8_static needs a single-valued input_scale")
        if self.input_zero_point is not None and self.scheme != "w8a8_static":
            raise AscqError(f"input_zero_point only applies to w8a8_static, not {self.scheme}")

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def num_bits(self) -> int:
        return WEIGHT_BITS.get(self.scheme, 16)


def merge_output_dim(parts: list[QuantLinearWeights]) -> QuantLinearWeights:
    """Concatenate linears that read the same input along the output dim (q/k/v, gate/up) into one.

    For w8a8_static the merged layer uses the largest input scale (as vLLM does); asymmetric static inputs
    must share one zero point.
    """
    first = parts[0]
    if any(p.scheme != first.scheme or p.group_size != first.group_size for p in parts):
        raise AscqError("cannot merge linears with different schemes or group sizes")

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        if any(t is None for t in tensors):
            raise AscqError(f"cannot merge linears where only some have {name}")
        return torch.cat(tensors, dim=0)

    input_scale = input_zero_point = None
    if first.scheme == "w8a8_static":
        input_scale = torch.stack([p.input_scale.reshape(()) for p in parts]).max().reshape(1)
        zeros = {float(p.input_zero_point) if p.input_zero_point is not None else 0.0 for p in parts}
        if len(zeros) > 1:
            raise AscqError("cannot merge w8a8_static linears with different input zero points")
        input_zero_point = first.input_zero_point
    return QuantLinearWeights(
        scheme=first.scheme,
        weight=torch.cat([p.weight for p in parts], dim=0),
        weight_scale=cat("weight_scale"),
        zero_point=cat("zero_point"),
        group_size=first.group_size,
        input_scale=input_scale,
        input_zero_point=input_zero_point,
        bias=cat("bias"),
    )


def linear_over_rows(
    linear_rows: Callable[[torch.Tensor, Any], torch.Tensor], x: torch.Tensor, prepared: Any
) -> torch.Tensor:
    """A backend's `linear` from its 2-D one: `linear_rows(rows [N, in], prepared) -> [N, out]` applied to x
    [..., in], the result in x.dtype; no kernel sees N = 0. `prepared` must have `out_features`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], prepared.out_features)
    return linear_rows(rows, prepared).to(x.dtype).reshape(*x.shape[:-1], prepared.out_features)


def get_backend(device: str | torch.device) -> ModuleType:
    """The kernel backend for a device: "reference", "cpu", "cuda[:N]" or "npu[:N]"."""
    return importlib.import_module(f"ascq.kernels.{platform_for(device).name}")


def torch_device(device: str | torch.device) -> torch.device:
    """Where a backend's tensors live: the backend's own `device()` when it has one (npu), else the CPU for
    `reference`/`cpu` and the named device otherwise."""
    backend_device = getattr(get_backend(device), "device", None)
    if callable(backend_device):
        return backend_device()
    return platform_for(device).torch_device(device)
