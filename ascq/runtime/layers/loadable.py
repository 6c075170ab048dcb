"""Plain parameters (embeddings, norms) loaded by assignment: built on the meta device, replaced at load
time."""

from __future__ import annotations

import torch
from torch import nn

from ascq.core.errors import AscqError


def assign_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace `module.<name>` (a meta placeholder) with the loaded tensor, checking its shape."""
    expected = tuple(getattr(module, name).shape)
    if tuple(tensor.shape) != expected:
        raise AscqError(
            f"checkpoint tensor for {type(module).__name__}.{name} has shape {tuple(tensor.shape)}, "
            f"expected {expected}"
        )
    setattr(module, name, nn.Parameter(tensor, requires_grad=False))


def cast_parameters(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            raise AscqError(f"checkpoint has no tensor for {type(module).__name__}.{name}")
        setattr(module, name, nn.Parameter(param.to(device=device, dtype=dtype), requires_grad=False))
