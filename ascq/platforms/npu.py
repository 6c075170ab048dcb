"""Ascend NPUs through torch_npu (HCCL between ranks, NPU graphs for decode). torch_npu is imported on first
use only: `import ascq` and every command without `--device npu` work where it is absent. Written against the
documented torch_npu 2.13 API; executed here only on the CPU emulator in tests/npu_emulation."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.platforms.base import Platform
from ascq.platforms.cpu import default_host_kv_cache_bytes

INSTALL_HINT = "torch_npu is not installed (pip install ascq[npu] with the CANN toolkit)"


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    graph_class = "NPUGraph"

    def check(self) -> None:
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            raise AscqError(f"--device npu: {INSTALL_HINT}") from None

    def torch_module(self) -> Any:
        return torch.npu  # exists once torch_npu is imported (the npu kernels import it)

    def prepare_distributed(self) -> None:
        importlib.import_module("torch_npu")  # registers the hccl backend

    def default_kv_cache_bytes(self, device: torch.device) -> int:
        return default_host_kv_cache_bytes()  # as before the platform split: a share of host memory
