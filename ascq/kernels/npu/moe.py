"""MoE on Ascend: `npu_moe_gating_top_k_softmax` routes, `npu_grouped_matmul` runs all experts in one call
each for gate, up and down.

Token rows are sorted by expert (plain torch argsort), each projection is one grouped matmul over a single
(E, K, N) weight with `group_list` = tokens per expert (group_list_type 1, group_type 0, split_item 3):
- dense: float weights;
- w8a8_dynamic: `npu_dynamic_quant` rows, int8 weights, `scale` (E, N) fp32 and `per_token_scale` (M,);
- w8a8_static (symmetric inputs): rows quantized with `npu_quantize(axis=-2)` by their expert's input scale,
  then the per-token path with per_token_scale = that input scale;
- w8a16 / w4a16: pseudo-quantized, int8 or int4-packed weights with `antiquant_scale`/`antiquant_offset`
  (E, N) per channel or (E, G, N) per group (int4 only).
Results are weighted by the router and summed back per token (index_add_).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascq.core.errors import UnsupportedError
from ascq.kernels import QuantLinearWeights
from ascq.kernels.npu.runtime import check_compute_dtype, to_device, torch_npu


@dataclass
class GroupedWeights:
    scheme: str
    dtype: torch.dtype
    weight: torch.Tensor  # (E, K, N) float / int8, or int32 (E, K, N // 8) for int4
    scale: torch.Tensor | None = None  # (E, N) fp32 weight scale, or antiquant (E, N) / (E, G, N)
    offset: torch.Tensor | None = None  # antiquant offset, like scale
    input_scale: torch.Tensor | None = None  # (E,) static input scales


@dataclass
class NpuExperts:
    gate: GroupedWeights
    up: GroupedWeights
    down: GroupedWeights

    @property
    def num_experts(self) -> int:
        return self.gate.weight.shape[0]


def _prepare_group(linears: list[QuantLinearWeights], dtype: torch.dtype) -> GroupedWeights:
    first = linears[0]
    scheme = first.scheme
    if any(w.scheme != scheme or w.group_size != first.group_size for w in linears):
        raise UnsupportedError(
            "--device npu needs every expert quantized with the same scheme and group size"
        )
    weight_kn = torch.stack([w.weight.t() for w in linears])  # (E, K, N)
    if scheme == "dense":
        return GroupedWeights(scheme, dtype, to_device(weight_kn, dtype))
    if scheme in ("w8a8_dynamic", "w8a8_static"):
        if any(w.zero_point is not None and bool(w.zero_point.any()) for w in linears):
            raise UnsupportedError(f"--device npu runs {scheme} experts with symmetric weights only")
        scale = to_device(torch.stack([w.weight_scale.float().reshape(-1) for w in linears]))
        input_scale = None
        if scheme == "w8a8_static":
            if any(w.input_zero_point is not None and bool(w.input_zero_point.any()) for w in linears):
                raise UnsupportedError(
                    "--device npu runs w8a8_static experts with symmetric input scales only"
                )
            input_scale = to_device(torch.stack([w.input_scale.float().reshape(()) for w in linears]))
        return GroupedWeights(scheme, dtype, to_device(weight_kn), scale=scale, input_scale=input_scale)
    if scheme in ("w4a16", "w8a16"):
        return _prepare_weight_only(linears, weight_kn, dtype)
    raise UnsupportedError(
        f"--device npu does not run {scheme} experts (no documented torch_npu grouped kernel)"
    )


def _prepare_weight_only(linears: list[QuantLinearWeights], weight_kn: torch.Tensor, dtype) -> GroupedWeights:
    first = linears[0]
    per_group = first.group_size is not None and first.group_size < first.in_features
    if per_group and first.num_bits == 8:
        raise UnsupportedError(
            "npu_grouped_matmul supports int8 expert weights per channel only, not per group"
        )
    weight = to_device(weight_kn)
    if first.num_bits == 4:
        num_experts, k, n = weight.shape
        packed = torch_npu().npu_convert_weight_to_int4pack(
            weight.reshape(num_experts * k, n).to(torch.int32)
        )
        weight = packed.reshape(num_experts, k, n // 8)

    def layout(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> (N,) per channel or (G, N) per group
        return t.float().t() if per_group else t.float().reshape(-1)

    scale = to_device(torch.stack([layout(w.weight_scale) for w in linears]), dtype)
    offset = None
    if any(w.zero_point is not None for w in linears):
        zeros = [
            w.zero_point if w.zero_point is not None else torch.zeros_like(w.weight_scale) for w in linears
        ]
        offset = to_device(torch.stack([-layout(z) for z in zeros]), dtype)
    return GroupedWeights(first.scheme, dtype, weight, scale=scale, offset=offset)


def prepare_experts(
    gate: list[QuantLinearWeights],
    up: list[QuantLinearWeights],
    down: list[QuantLinearWeights],
    dtype: torch.dtype = torch.bfloat16,
) -> NpuExperts:
    check_compute_dtype(dtype)
    return NpuExperts(_prepare_group(gate, dtype), _prepare_group(up, dtype), _prepare_group(down, dtype))


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts then top-k, fused on NPU; weights fp32 [T, k], ids int64 [T, k]."""
    topk_weights, topk_ids, _ = torch_npu().npu_moe_gating_top_k_softmax(
        router_logits.float().contiguous(), k=top_k
    )
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.float(), topk_ids.long()


def _grouped(
    rows: torch.Tensor, w: GroupedWeights, expert_of_row: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    npu = torch_npu()
    common = dict(group_list=counts, group_list_type=1, group_type=0, split_item=3)
    if w.scheme == "dense":
        return npu.npu_grouped_matmul([rows], [w.weight], **common)[0]
    if w.scheme in ("w4a16", "w8a16"):
        offset = None if w.offset is None else [w.offset]
        return npu.npu_grouped_matmul(
            [rows], [w.weight], antiquant_scale=[w.scale], antiquant_offset=offset, **common
        )[0]
    if w.scheme == "w8a8_dynamic":
        rows_int8, per_token_scale = npu.npu_dynamic_quant(rows)
    else:
        per_token_scale = w.input_scale[expert_of_row]
        rows_int8 = npu.npu_quantize(rows.float(), per_token_scale.reciprocal(), None, torch.qint8, -2, False)
    return npu.npu_grouped_matmul(
        [rows_int8],
        [w.weight],
        scale=[w.scale],
        per_token_scale=[per_token_scale],
        output_dtype=w.dtype,
        **common,
    )[0]


def moe_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prepared: NpuExperts
) -> torch.Tensor:
    """Σ over each token's chosen experts of weight * down(silu(gate(x)) * up(x)), in x.dtype."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of_row, expert_of_row = order // top_k, flat_ids[order]
    counts = torch.bincount(flat_ids, minlength=prepared.num_experts).to(torch.int64)
    rows = x[token_of_row].to(prepared.gate.dtype)
    gate = _grouped(rows, prepared.gate, expert_of_row, counts)
    up = _grouped(rows, prepared.up, expert_of_row, counts)
    down = _grouped(F.silu(gate) * up, prepared.down, expert_of_row, counts)
    weighted = down.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of_row, weighted).to(x.dtype)
