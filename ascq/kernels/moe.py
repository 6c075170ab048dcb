"""MoE experts over a backend's linear: tokens grouped by expert, gate and up merged into one GEMM per expert.
Shared by the `cpu` and `cuda` backends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ascq.kernels import QuantLinearWeights, merge_output_dim


@dataclass
class PreparedExperts:
    gate_up: list[Any]  # per expert: prepared [2 * intermediate, hidden]
    down: list[Any]
    intermediate_sizes: list[int]


def prepare_experts(
    prepare_linear: Callable[[QuantLinearWeights, torch.dtype], Any],
    gate: list[QuantLinearWeights],
    up: list[QuantLinearWeights],
    down: list[QuantLinearWeights],
    dtype: torch.dtype = torch.float32,
) -> PreparedExperts:
    return PreparedExperts(
        gate_up=[prepare_linear(merge_output_dim([g, u]), dtype) for g, u in zip(gate, up, strict=True)],
        down=[prepare_linear(d, dtype) for d in down],
        intermediate_sizes=[g.out_features for g in gate],
    )


def moe_experts(
    linear: Callable[[torch.Tensor, Any], torch.Tensor],
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: PreparedExperts,
) -> torch.Tensor:
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=len(experts.down)).tolist()
    token_of = order // top_k  # token row of each (sorted) assignment
    weight_of = topk_weights.flatten()[order].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert_id, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate_up = linear(x[tokens], experts.gate_up[expert_id])
        gate, up = gate_up.split(experts.intermediate_sizes[expert_id], dim=-1)
        expert_out = linear(F.silu(gate) * up, experts.down[expert_id])
        out.index_add_(0, tokens, expert_out.float() * weight_of[start : start + count, None])
        start += count
    return out.to(x.dtype)
