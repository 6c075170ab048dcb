"""Emulated MoE ops: npu_moe_gating_top_k_softmax and npu_grouped_matmul.

npu_grouped_matmul is modelled for the "single x, single 3-D weight, single y" scenario (group_type=0,
split_item 2/3, tensor group_list) in three flavours: float, per-token quantized (int8 x int8 with per-channel
`scale` and `per_token_scale`) and pseudo-quantized (float x int8/int4 with
`antiquant_scale`/`antiquant_offset`).
"""

from __future__ import annotations

import torch

from .contract import require, require_dtype, sizes_from_ends, unpack_int4

MAX_GROUPS = 1024


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished=None, k: int = 1):
    """softmax over the last dim, then top-k: (values in x.dtype, expert_idx int32, row_idx int32)."""
    op = "npu_moe_gating_top_k_softmax"
    require_dtype(x, (torch.float16, torch.bfloat16, torch.float32), op, "x")
    require(x.dim() in (2, 3), op, "x must be 2-D or 3-D")
    require(
        0 < k <= x.shape[-1] and k <= 1024, op, f"k={k} must satisfy 0 < k <= {x.shape[-1]} and k <= 1024"
    )
    if finished is not None:
        raise NotImplementedError("npu_moe_gating_top_k_softmax emulator: `finished` is not modelled")
    values, expert_idx = x.float().softmax(dim=-1).topk(k, dim=-1)
    num_rows = x.shape[:-1].numel()
    row_idx = torch.arange(k * num_rows, dtype=torch.int32).reshape(k, num_rows).t().reshape(expert_idx.shape)
    return values.to(x.dtype), expert_idx.to(torch.int32), row_idx.contiguous()


def _group_sizes(group_list: torch.Tensor, group_list_type: int, num_rows: int, num_groups: int) -> list[int]:
    op = "npu_grouped_matmul"
    require(
        isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64,
        op,
        "group_list must be an int64 tensor in this scenario",
    )
    require(
        group_list.dim() == 1 and group_list.shape[0] == num_groups,
        op,
        f"group_list must be 1-D with one entry per weight group ({num_groups})",
    )
    require(num_groups <= MAX_GROUPS, op, f"at most {MAX_GROUPS} groups")
    values = group_list.tolist()
    require(group_list_type in (0, 1), op, f"group_list_type {group_list_type} must be 0 or 1")
    if group_list_type == 0:
        sizes = sizes_from_ends(values)
        require(min(sizes) >= 0, op, "cumsum group_list must be non-decreasing")
        require(values[-1] == num_rows, op, f"last cumsum value {values[-1]} must equal x rows {num_rows}")
        return sizes
    require(
        all(v >= 0 for v in values) and len(values) != 1,
        op,
        "count group_list must be non-negative, len != 1",
    )
    require(sum(values) == num_rows, op, f"group sizes sum {sum(values)} must equal x rows {num_rows}")
    return values


def _expert_weight(w: torch.Tensor, antiquant_scale, antiquant_offset, k: int) -> list[torch.Tensor]:
    """Per group fp32 (k, n) weights, dequantized as (w + offset) * scale when antiquant params are given."""
    values = unpack_int4(w) if w.dtype == torch.int32 else w
    if antiquant_scale is None:
        return [values[g].float() for g in range(values.shape[0])]
    scale = antiquant_scale.float()
    offset = None if antiquant_offset is None else antiquant_offset.float()
    if scale.dim() == 2:  # per channel (g, n)
        scale, offset = scale[:, None, :], None if offset is None else offset[:, None, :]
    else:  # per group (g, G, n)
        group = k // scale.shape[1]
        scale = scale.repeat_interleave(group, dim=1)
        offset = None if offset is None else offset.repeat_interleave(group, dim=1)
    deq = values.float() + (0.0 if offset is None else offset)
    return list(deq * scale)


def _check_quant_params(x, w, scale, per_token_scale, antiquant_scale, antiquant_offset, bias, output_dtype):
    op = "npu_grouped_matmul"
    g, k, n = w.shape[0], x.shape[1], w.shape[2] * (8 if w.dtype == torch.int32 else 1)
    if x.dtype == torch.int8:  # per-token quantization
        require_dtype(w, (torch.int8,), op, "weight (per-token quantization)")
        require(
            scale is not None and per_token_scale is not None,
            op,
            "per-token quantization needs scale and per_token_scale",
        )
        require_dtype(scale, (torch.float32, torch.bfloat16), op, "scale")
        require(
            tuple(scale.shape) == (g, n), op, f"scale must be (g, n)=({g}, {n}), got {tuple(scale.shape)}"
        )
        require_dtype(per_token_scale, (torch.float32,), op, "per_token_scale")
        require(tuple(per_token_scale.shape) == (x.shape[0],), op, "per_token_scale must be (m,)")
        require(
            output_dtype in (torch.bfloat16, torch.float16), op, "per-token quantization outputs bf16/fp16"
        )
        if bias is not None:
            require_dtype(bias, (torch.int32,), op, "bias")
        return
    require_dtype(x, (torch.float16, torch.bfloat16, torch.float32), op, "x")
    require(scale is None and per_token_scale is None, op, "scale/per_token_scale need int8 x")
    require(output_dtype in (None, x.dtype), op, f"output_dtype {output_dtype} must be None or x's dtype")
    if antiquant_scale is None:
        require(w.dtype == x.dtype, op, f"float weight dtype {w.dtype} must equal x's {x.dtype}")
        return
    require_dtype(w, (torch.int8, torch.int32), op, "weight (pseudo-quantization)")
    require(x.dtype in (torch.float16, torch.bfloat16), op, "pseudo-quantization needs fp16/bf16 x")
    require(antiquant_scale.dtype == x.dtype, op, "antiquant_scale dtype must equal x's")
    shape = tuple(antiquant_scale.shape)
    per_group = len(shape) == 3
    require(
        shape == (g, n) or (per_group and shape[0] == g and shape[2] == n and k % shape[1] == 0),
        op,
        f"antiquant_scale must be (g, n) or (g, G, n) with G dividing k, got {shape}",
    )
    require(not (per_group and w.dtype == torch.int8), op, "int8 weights support per-channel only")
    if antiquant_offset is not None:
        require(
            antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == x.dtype,
            op,
            "antiquant_offset must match antiquant_scale's shape and dtype",
        )


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
) -> list[torch.Tensor]:
    """y[rows of group i] = x[rows of group i] @ weight[i] (+ bias[i]), dequantized per the scenario."""
    op = "npu_grouped_matmul"
    if group_type != 0 or len(x) != 1 or len(weight) != 1:
        raise NotImplementedError(
            "npu_grouped_matmul emulator: only group_type=0 with single x and weight tensors"
        )
    require(
        split_item in (2, 3),
        op,
        f"group_type=0 with a single weight needs split_item 2 or 3, got {split_item}",
    )
    require(offset is None and activation_input is None, op, "offset / activation_input must be None")
    require(
        activation_quant_scale is None and activation_quant_offset is None, op, "reserved params must be None"
    )
    if act_type != 0:
        raise NotImplementedError("npu_grouped_matmul emulator: fused activations are not modelled")
    xs, w = x[0], weight[0]
    require(xs.dim() == 2 and w.dim() == 3, op, "x must be 2-D (m, k) and the single weight 3-D (g, k, n)")
    require(w.shape[1] == xs.shape[1], op, f"weight k={w.shape[1]} does not match x's k={xs.shape[1]}")
    require(xs.shape[1] < 65536 and w.shape[2] < 65536, op, "inner dims must be < 65536")

    def first(items):
        return None if items is None else items[0]

    sc, pts, aqs, aqo, b = map(first, (scale, per_token_scale, antiquant_scale, antiquant_offset, bias))
    _check_quant_params(xs, w, sc, pts, aqs, aqo, b, output_dtype)
    sizes = _group_sizes(group_list, group_list_type, xs.shape[0], w.shape[0])
    weights = _expert_weight(w, aqs, aqo, xs.shape[1])
    rows = torch.split(xs.double() if xs.dtype == torch.int8 else xs.float(), sizes)
    out = torch.cat([r @ wg.to(r.dtype) for r, wg in zip(rows, weights, strict=True)]).float()
    if b is not None:
        out = out + b.float().repeat_interleave(torch.tensor(sizes), dim=0)
    if xs.dtype == torch.int8:
        out = out * sc.float().repeat_interleave(torch.tensor(sizes), dim=0) * pts.float()[:, None]
    return [out.to(output_dtype or xs.dtype)]
