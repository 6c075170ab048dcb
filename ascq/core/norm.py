"""RMSNorm math, the one of ascq: the runtime, the reference models and the converter call it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), the statistics in fp32 (as transformers' LlamaRMSNorm): the one RMSNorm of ascq.
    x * rsqrt(mean(x^2) + eps) runs as one fused op (the same math as the explicit ops, fewer dispatches)."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * x32.to(x.dtype)
