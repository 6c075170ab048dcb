"""What every device answers, with the CPU's answers as defaults."""

from __future__ import annotations

from typing import Any

import torch


class Platform:
    name: str  # the kernel backend's name: ascq.kernels.<name>
    is_cpu: bool = False  # tensors in host memory, CPU kernels
    dist_backend: str = "gloo"  # torch.distributed backend of the ranks' process group
    graph_class: str | None = None  # torch.<module>.<graph_class> for captured decode graphs; None: none

    def check(self) -> None:
        """Raise a one-line AscqError when this device cannot run here."""

    def torch_device(self, device: str | torch.device) -> torch.device:
        return torch.device(device)

    def torch_module(self) -> Any:
        """torch.cuda / torch.npu: the device's memory, stream and graph API."""
        raise NotImplementedError(f"{self.name} has no device module")

    def set_device(self, local_rank: int) -> str:
        """Bind this process to its node-local device; returns the rank's device name."""
        module = self.torch_module()
        module.set_device(local_rank)
        return f"{self.name}:{local_rank}"

    def prepare_distributed(self) -> None:
        """Whatever must be imported for `dist_backend` to be registered."""

    def free_memory(self, device: torch.device) -> int:
        """Free bytes where the weights and the KV cache go."""
        free, _ = self.torch_module().mem_get_info(device)
        return int(free)

    def default_kv_cache_bytes(self, device: torch.device) -> int:
        """The KV cache budget when neither kv_cache_memory nor gpu_memory_utilization is given."""
        raise NotImplementedError

    def default_dtype(self, checkpoint_dtype: torch.dtype, weight_only_quantized: bool) -> torch.dtype:
        """The compute dtype for `--dtype auto`: the checkpoint's on accelerators."""
        return checkpoint_dtype

    def set_cpu_threads(self, ranks_on_node: int) -> None:
        """CPU ranks of one node split its cores (accelerator ranks: nothing to do)."""
