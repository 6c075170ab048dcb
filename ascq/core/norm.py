"""RMSNorm math, the one of ascq: the runtime, the reference models and the converter call it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), the statistics in fp32 (as transformers' LlamaRMSNorm): the one RMSNorm of ascq.
    x * rsqrt(mean(x^2) + eps) runs as one fused op (the same math as the explicit ops, fewer dispatches)."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in fp32, cast to x's dtype at the end (transformers'
    Gemma3RMSNorm; Llama's casts before the product)."""
    x32 = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)
