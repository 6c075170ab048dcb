"""Routed experts: softmax top-k router + the backend's expert kernel, over the tensor-parallel group.

Expert parallelism (`enable_expert_parallel`): expert e lives on rank e // (num_experts / world) (contiguous
ranges, as vLLM's). Activations are already replicated across the TP group, so dispatch needs no all-to-all:
every rank runs its own experts on the tokens routed to them (tokens routed elsewhere get weight 0 here) and
one all-reduce combines the ranks' partial sums (all-gather + reduce-scatter degenerates to this when every
rank holds every token; an all-to-all pays off only with data-parallel attention, which ascq does not have).
Without it, every rank holds every expert, tensor-parallel: gate/up split by output, down by input,
all-reduced.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from ascq.core.architecture import divide
from ascq.core.errors import AscqError
from ascq.runtime.distributed.parallel import (
    all_reduce,
    expert_parallel,
    shard_tensor,
    tp_rank,
    tp_world_size,
)
from ascq.runtime.layers.linear import build_quant_weights

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FusedMoE(nn.Module):
    def __init__(
        self, num_experts: int, top_k: int, renormalize: bool, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_size = tp_world_size()
        self.expert_parallel = expert_parallel()
        self.intermediate_size = intermediate_size  # down_proj's input: needed to split its group scales
        if self.tp_size > 1 and not self.expert_parallel and intermediate_size is None:
            raise AscqError("tensor-parallel experts need the expert intermediate size")
        self.num_local_experts = divide(num_experts, self.tp_size) if self.expert_parallel else num_experts
        self.first_expert = tp_rank() * self.num_local_experts if self.expert_parallel else 0
        self.pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.schemes: dict[tuple[int, str], str] = {}
        self.prepared = None
        self.backend: ModuleType | None = None

    def is_local(self, expert_id: int) -> bool:
        return self.first_expert <= expert_id < self.first_expert + self.num_local_experts

    def weight_loader(
        self, param_name: str, tensor: torch.Tensor, expert_id: int, projection: str, scheme: str
    ) -> None:
        if projection not in PROJECTIONS or not 0 <= expert_id < self.num_experts:
            raise AscqError(f"unexpected expert weight: expert {expert_id} {projection}")
        if self.is_local(expert_id):
            if self.tp_size > 1 and not self.expert_parallel:
                tp_dim = 1 if projection == "down_proj" else 0
                tensor = shard_tensor(tensor, param_name, tp_dim, self.intermediate_size)
            self.pending.setdefault((expert_id, projection), {})[param_name] = tensor
            self.schemes[(expert_id, projection)] = scheme

    def _missing(self) -> list[str]:
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        return [
            f"{e}.{p}" for e in local for p in PROJECTIONS if "weight" not in self.pending.get((e, p), {})
        ]

    def is_loaded(self) -> bool:
        return not self._missing()

    def finalize(self, backend: ModuleType, dtype: torch.dtype) -> None:
        if self.prepared is not None:  # finalized while loading
            return
        local = range(self.first_expert, self.first_expert + self.num_local_experts)
        missing = self._missing()
        if missing:
            raise AscqError(f"checkpoint is missing expert weights: {', '.join(missing[:4])}")
        gate, up, down = (
            [build_quant_weights(self.pending[(e, p)], self.schemes[(e, p)]) for e in local]
            for p in PROJECTIONS
        )
        self.backend = backend
        self.prepared = backend.prepare_experts(gate, up, down, dtype)
        self.pending = {}

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.backend.select_experts(router_logits, self.top_k, self.renormalize)
        if not self.expert_parallel:
            return all_reduce(self.backend.moe_experts(x, topk_weights, topk_ids, self.prepared))
        local_ids = topk_ids - self.first_expert
        mine = (local_ids >= 0) & (local_ids < self.num_local_experts)
        topk_weights, topk_ids = topk_weights * mine, local_ids.clamp(0, self.num_local_experts - 1)
        return all_reduce(self.backend.moe_experts(x, topk_weights, topk_ids, self.prepared))
