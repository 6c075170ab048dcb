"""Parallel layout of this process: tensor-parallel group, pipeline stage, expert parallelism.

Ranks are laid out as vLLM's: global rank = pp_rank * tp_size + tp_rank, so a pipeline stage's TP group is
consecutive ranks (one node, when it fits). Layers read `tp_world_size()` / `tp_rank()` while they are built
and shard their weights at load time (q/k/v and gate/up by output, o/down by input, experts by rank under
expert parallelism); `all_reduce` / `all_gather_last_dim` run on the TP group. Without `init_parallel` (one
process) every size is 1 and every collective a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ascq.core.architecture import divide
from ascq.platforms import platform_for

INIT_TIMEOUT = timedelta(minutes=10)


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    enable_expert_parallel: bool = False
    tp_group: object | None = None
    cpu_group: object | None = None  # gloo over every rank: step metadata, whatever the device backend

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


_state = ParallelState()


def state() -> ParallelState:
    return _state


def init_parallel(
    rank: int, tp_size: int, pp_size: int, device: str, init_method: str, enable_expert_parallel: bool = False
) -> ParallelState:
    """Join the process group (tcp:// or env:// rendezvous) and build the TP groups and the metadata group."""
    global _state
    platform = platform_for(device)
    platform.prepare_distributed()
    backend = platform.dist_backend
    world = tp_size * pp_size
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=INIT_TIMEOUT
    )
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == rank // tp_size:
            tp_group = group
    cpu_group = dist.new_group(list(range(world)), backend="gloo") if backend != "gloo" else dist.group.WORLD
    _state = ParallelState(
        tp_size, rank % tp_size, pp_size, rank // tp_size, enable_expert_parallel, tp_group, cpu_group
    )
    return _state


def destroy_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


def tp_world_size() -> int:
    return _state.tp_size


def tp_rank() -> int:
    return _state.tp_rank


def expert_parallel() -> bool:
    return _state.enable_expert_parallel and _state.tp_size > 1


def all_reduce(x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if _state.tp_size > 1:
        dist.all_reduce(x, op=op, group=_state.tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim=-1)


def shard_tensor(
    tensor: torch.Tensor, param_name: str, tp_dim: int | None, full_in_features: int
) -> torch.Tensor:
    """This rank's part of one checkpoint tensor of a linear (weight, scale, zero point, bias).

    tp_dim 0 (column parallel): rows split. tp_dim 1 (row parallel): columns split; bias kept on rank 0 only
    (it is added once, after the all-reduce); per-channel scales and zero points kept whole; group scales
    split along the groups, re-expressed at a finer group size when a group straddles two ranks (gcd of the
    group size and the columns per rank: the same numbers, repeated; a shorter last group, as
    compressed-tensors stores in_features that are not a multiple of the group size, is cut there; its group
    size is taken as the power of two the shapes imply). Activation qparams (static input scale / zero) are
    replicated.
    """
    world, rank = _state.tp_size, _state.tp_rank
    if world == 1 or tp_dim is None or param_name in ("input_scale", "input_zero_point"):
        return tensor
    if tp_dim == 0:
        size = divide(tensor.shape[0], world)
        return tensor.narrow(0, rank * size, size)
    if param_name == "bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if param_name == "weight":
        size = divide(tensor.shape[1], world)
        return tensor.narrow(1, rank * size, size)
    if tensor.dim() < 2 or tensor.shape[1] == 1:
        return tensor
    local_in = divide(full_in_features, world)
    num_groups = tensor.shape[1]
    group_size = full_in_features // num_groups
    if full_in_features % num_groups:  # a shorter last group (in_features not a multiple of the group size)
        group_size = 2 ** math.ceil(math.log2(full_in_features / num_groups))
    fine = math.gcd(group_size, local_in)
    if fine != group_size:
        tensor = tensor.repeat_interleave(group_size // fine, dim=1)[:, : full_in_features // fine]
    size = local_in // fine
    return tensor.narrow(1, rank * size, size)
