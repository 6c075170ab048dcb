"""Tensor-parallel rank and world size: torch.distributed when initialized, else a single rank.

Layers shard their weights with these at load time (q/k/v and gate/up by output, o/down by input, experts by
rank) and reduce with `all_reduce`; at world size 1 every collective is a no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if tp_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
