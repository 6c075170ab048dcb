"""Linear layers that load checkpoint shards per parameter and run through the kernel backend.

As in vLLM / nano-vllm: `ColumnParallelLinear` splits the output dim across ranks (q/k/v, gate/up — merged
into one matmul), `RowParallelLinear` splits the input dim and all-reduces. Checkpoint tensors arrive one at a
time via `weight_loader(param_name, tensor, shard_id, scheme)` (param_name: weight, weight_scale, zero_point,
input_scale, input_zero_point, bias), are narrowed to this rank's shard and kept until `finalize`, which
builds the kernels' `QuantLinearWeights`, merges the shards along the output dim and calls
`backend.prepare_linear`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from ascq.core.architecture import divide, kv_heads_per_rank
from ascq.core.errors import AscqError
from ascq.kernels import QuantLinearWeights, merge_output_dim
from ascq.runtime.distributed.parallel import all_reduce, shard_tensor, tp_rank, tp_world_size

ACTIVATION_PARAMS = ("input_scale", "input_zero_point")
DYNAMIC_ACTIVATION_SCHEMES = ("w8a8_dynamic", "w4a8_dynamic")


def build_quant_weights(params: dict[str, torch.Tensor], scheme: str) -> QuantLinearWeights:
    """One checkpoint linear's tensors -> `QuantLinearWeights` (group size read off the scale's shape)."""
    weight = params["weight"]
    scale = params.get("weight_scale")
    if scheme == "dense" or scale is None:
        return QuantLinearWeights("dense", weight, bias=params.get("bias"))
    scale = scale.reshape(weight.shape[0], -1)
    zero = params.get("zero_point")
    num_groups = scale.shape[1]
    return QuantLinearWeights(
        scheme=scheme,
        weight=weight.to(torch.int8),
        weight_scale=scale,
        zero_point=None
        if zero is None
        else zero.reshape(scale.shape).to(zero.dtype if zero.is_floating_point() else torch.int8),
        group_size=weight.shape[1] // num_groups if num_groups > 1 else None,
        input_scale=params.get("input_scale"),
        input_zero_point=params.get("input_zero_point"),
        bias=params.get("bias"),
    )


class LinearBase(nn.Module):
    """A linear whose output is made of named shards (one per checkpoint tensor it was merged from)."""

    tp_dim: int | None = None  # 0: output split across ranks, 1: input split, None: replicated

    def __init__(self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.has_bias = bias
        self.pending: dict[str | int, dict[str, torch.Tensor]] = {k: {} for k in output_sizes}
        self.schemes: dict[str | int, str] = {}
        self.prepared = None
        self.backend: ModuleType | None = None

    def weight_loader(
        self, param_name: str, tensor: torch.Tensor, shard_id: str | int = 0, scheme: str = "dense"
    ) -> None:
        if shard_id not in self.pending:
            raise AscqError(f"unexpected shard {shard_id!r} for a linear with shards {list(self.pending)}")
        self.pending[shard_id][param_name] = self.shard_tensor(param_name, tensor)
        self.schemes[shard_id] = scheme

    def shard_tensor(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_tensor(tensor, param_name, self.tp_dim, self.input_size * tp_world_size())

    def is_loaded(self) -> bool:
        """Every shard has its weight (a checkpoint module's tensors arrive together, so it is complete once
        loading moves on to another module)."""
        return all("weight" in params for params in self.pending.values())

    def finalize(self, backend: ModuleType, dtype: torch.dtype) -> None:
        if self.prepared is not None:  # finalized while loading
            return
        missing = [str(k) for k, params in self.pending.items() if "weight" not in params]
        if missing:
            raise AscqError(f"checkpoint is missing weights for linear shards {missing}")
        parts = [build_quant_weights(self.pending[k], self.schemes[k]) for k in self.output_sizes]
        merged = parts[0] if len(parts) == 1 else merge_output_dim(parts)
        self.backend = backend
        self.prepared = backend.prepare_linear(merged, dtype)
        self.pending = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.prepared)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, {0: output_size}, bias)


class ColumnParallelLinear(LinearBase):
    tp_dim = 0

    def __init__(self, input_size: int, output_sizes: dict[str | int, int], bias: bool = False) -> None:
        world = tp_world_size()
        super().__init__(input_size, {k: divide(v, world) for k, v in output_sizes.items()}, bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_proj and up_proj as one matmul; shards 0 and 1."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj as one matmul; shards "q", "k", "v". With more ranks than KV heads each rank
    holds the one KV head its query heads use (replicated across tp_size / num_kv_heads ranks)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        world = tp_world_size()
        kv_size = kv_heads_per_rank(num_kv_heads, world) * head_dim
        sizes = {"q": divide(num_heads * head_dim, world), "k": kv_size, "v": kv_size}
        LinearBase.__init__(self, hidden_size, sizes, bias)
        self.head_dim = head_dim
        self.kv_replicas = max(1, world // num_kv_heads)

    def weight_loader(
        self, param_name: str, tensor: torch.Tensor, shard_id: str | int = 0, scheme: str = "dense"
    ) -> None:
        if shard_id in ("k", "v") and self.kv_replicas > 1 and param_name not in ACTIVATION_PARAMS:
            start = tp_rank() // self.kv_replicas * self.head_dim
            self.pending[shard_id][param_name] = tensor.narrow(0, start, self.head_dim)
            self.schemes[shard_id] = scheme
            return
        super().weight_loader(param_name, tensor, shard_id, scheme)


class RowParallelLinear(LinearBase):
    """Input split across ranks, partial outputs all-reduced.

    Dynamic per-token activation scales (W8A8 / W4A8 dynamic, per channel) must come from the whole row, as at
    TP=1, not from this rank's slice: the row's absmax is all-reduced (max) and rides into the kernel as one
    extra input column whose weights are zero, so the kernel's own per-token absmax is the global one.
    """

    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        super().__init__(divide(input_size, self.tp_size), {0: output_size}, bias)
        self.global_token_scale = False

    def finalize(self, backend: ModuleType, dtype: torch.dtype) -> None:
        if self.prepared is not None:
            return
        params = self.pending.get(0, {})
        scale = params.get("weight_scale")
        if (
            self.tp_size > 1
            and self.schemes.get(0) in DYNAMIC_ACTIVATION_SCHEMES
            and scale is not None
            and scale.reshape(scale.shape[0], -1).shape[1] == 1
        ):
            weight = params["weight"]
            params["weight"] = torch.cat([weight, weight.new_zeros(weight.shape[0], 1)], dim=1)
            self.global_token_scale = True
        super().finalize(backend, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_token_scale:
            absmax = all_reduce(x.abs().amax(dim=-1, keepdim=True), op=dist.ReduceOp.MAX)
            x = torch.cat([x, absmax], dim=-1)
        y = self.backend.linear(x, self.prepared)
        return all_reduce(y) if self.tp_size > 1 else y
