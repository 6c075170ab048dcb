"""RMSNorm (`ascq.core.norm.rms_norm`) as a loadable module, with the residual add fused in (returns the new
residual too); `GemmaRMSNorm` multiplies by (1 + weight) (`ascq.core.norm.gemma_rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from ascq.core.norm import gemma_rms_norm, rms_norm
from ascq.runtime.layers.loadable import assign_parameter


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


class GemmaRMSNorm(RMSNorm):
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)
