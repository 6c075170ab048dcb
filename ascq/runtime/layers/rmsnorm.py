"""RMSNorm computed in fp32, with the residual add fused in (returns the new residual too); `rms_norm` is also the
reference models' and the converter's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascq.runtime.layers.loadable import assign_parameter


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), the statistics in fp32 (as transformers' LlamaRMSNorm): the one RMSNorm of ascq.
    x * rsqrt(mean(x^2) + eps) runs as one fused op (the same math as the explicit ops, fewer dispatches)."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def weight_loader(self, param_name: str, tensor: torch.Tensor) -> None:
        assign_parameter(self, param_name, tensor)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
