"""The CPU, with the native kernels (`cpu`) or the plain-torch ground truth (`reference`)."""

from __future__ import annotations

import os

import torch

from ascq.platforms.base import Platform

DEFAULT_KV_CACHE_FRACTION = 0.1  # of available host memory when kv_cache_memory is not given
MAX_DEFAULT_KV_CACHE_BYTES = 4 << 30


def host_free_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def default_host_kv_cache_bytes() -> int:
    return min(int(host_free_memory() * DEFAULT_KV_CACHE_FRACTION), MAX_DEFAULT_KV_CACHE_BYTES)


class CpuPlatform(Platform):
    is_cpu = True

    def __init__(self, name: str) -> None:
        self.name = name

    def torch_device(self, device: str | torch.device) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> str:
        return self.name  # CPU ranks share the CPU

    def free_memory(self, device: torch.device) -> int:
        return host_free_memory()

    def default_kv_cache_bytes(self, device: torch.device) -> int:
        return default_host_kv_cache_bytes()

    def default_dtype(self, checkpoint_dtype: torch.dtype, weight_only_quantized: bool) -> torch.dtype:
        """Weight-only int4/int8 checkpoints decode fastest through the native kernel, which takes bf16
        activations; dense GEMMs are fastest in fp32 (no bf16 GEMM on AVX2). `reference`: plain fp32 math."""
        return torch.bfloat16 if self.name == "cpu" and weight_only_quantized else torch.float32

    def set_cpu_threads(self, ranks_on_node: int) -> None:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
