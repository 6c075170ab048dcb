"""Devices, one `Platform` each (vLLM's `vllm/platforms`): device selection and availability, where tensors
live, the default compute dtype, the distributed backend, graph capture and memory queries. Nothing else in
ascq tests a device name or imports torch_npu; the kernels' backend folders are the only other device-specific
code."""

from __future__ import annotations

import torch

from ascq.core.errors import UnsupportedError
from ascq.platforms.base import Platform
from ascq.platforms.cpu import CpuPlatform
from ascq.platforms.cuda import CudaPlatform
from ascq.platforms.npu import NpuPlatform

# device names a user can pass (--device): `reference` is the CPU with the plain-torch kernel backend
DEVICES = ("cpu", "reference", "cuda", "npu")
CALIBRATION_DEVICES = ("cpu", "cuda", "npu")  # where `ascq convert --device` runs its calibration forwards
_PLATFORMS: dict[str, Platform] = {
    "cpu": CpuPlatform("cpu"),
    "reference": CpuPlatform("reference"),
    "cuda": CudaPlatform(),
    "npu": NpuPlatform(),
}


def device_kind(device: str | torch.device) -> str:
    """ "cpu", "reference", "cuda" or "npu" of a device name ("cuda:1" -> "cuda") or torch.device."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def platform_for(device: str | torch.device) -> Platform:
    kind = device_kind(device)
    if kind not in _PLATFORMS:
        raise UnsupportedError(f"unknown device {str(device)!r}; supported: {', '.join(DEVICES)}")
    return _PLATFORMS[kind]


def check_device(device: str) -> str:
    """`device` if it can run here, else a one-line AscqError (no CUDA device, torch_npu missing)."""
    platform_for(device).check()
    return device


__all__ = ["CALIBRATION_DEVICES", "DEVICES", "Platform", "check_device", "device_kind", "platform_for"]
