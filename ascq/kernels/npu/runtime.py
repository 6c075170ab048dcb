"""torch_npu access and tensor placement for the NPU backend.

torch_npu is imported on first use only, so `import ascq` and every command without `--device npu` work where
it is absent (installed without the CANN toolkit it even breaks `import torch`). `set_device` redirects where
prepared tensors live; the test suite uses it with a CPU emulator of the ops installed as `torch_npu`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ascq.core.errors import UnsupportedError

ACL_FORMAT_FRACTAL_NZ = 29
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)

_device_name = "npu"  # a torch.device("npu") only parses once torch_npu is imported
_torch_npu: ModuleType | None = None


def torch_npu() -> ModuleType:
    """The torch_npu module, imported on first call."""
    global _torch_npu
    if _torch_npu is None:
        try:
            _torch_npu = importlib.import_module("torch_npu")
        except ImportError as exc:
            raise UnsupportedError(
                "--device npu needs torch_npu and the Ascend CANN toolkit: source the CANN set_env.sh, then "
                "`pip install ascq[npu]`"
            ) from exc
    return _torch_npu


def set_device(device: str | torch.device) -> None:
    """Place the backend's prepared tensors on `device` (default "npu"); forgets the cached torch_npu
    module."""
    global _device_name, _torch_npu
    _device_name, _torch_npu = str(device), None


def device() -> torch.device:
    torch_npu()
    return torch.device(_device_name)


def to_device(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return tensor.to(device=device(), dtype=dtype or tensor.dtype).contiguous()


def check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise UnsupportedError(
            f"--device npu computes in bfloat16 or float16 (the quantized NPU kernels have no {dtype} "
            f"output); "
            "use --dtype bfloat16"
        )
