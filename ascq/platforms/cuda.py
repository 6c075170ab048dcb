"""NVIDIA GPUs through torch.cuda (NCCL between ranks, CUDA graphs for decode)."""

from __future__ import annotations

from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.platforms.base import Platform

DEFAULT_KV_CACHE_FRACTION = 0.8  # of free device memory when kv_cache_memory is not given


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    graph_class = "CUDAGraph"

    def check(self) -> None:
        if not torch.cuda.is_available():
            raise AscqError("--device cuda: no CUDA device is available")

    def torch_module(self) -> Any:
        return torch.cuda

    def default_kv_cache_bytes(self, device: torch.device) -> int:
        return int(self.free_memory(device) * DEFAULT_KV_CACHE_FRACTION)
