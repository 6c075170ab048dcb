"""On-disk checkpoint formats: one module per format (compressed_tensors, msmodelslim), the safetensors
reader, and `QuantizedLinear`, the in-memory form every format compresses from and decompresses to."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class QuantizedLinear:
    """A linear's integer weights in the signed convention (docs/ARCHITECTURE.md), plus its scales as
    written."""

    q: torch.Tensor  # int8 [out, in], int4 values in [-8, 7]
    scale: torch.Tensor  # [1], [out, 1] or [out, in // group_size], checkpoint scale dtype
    zero_point: torch.Tensor | None = (
        None  # same shape as scale: int8, or a float dtype (zp_dtype); None: symmetric
    )
    input_scale: torch.Tensor | None = None  # [1] for static per-tensor activations

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.ndim != 2:
            raise ValueError(
                f"QuantizedLinear.q must be a 2-D int8 tensor, got {self.q.dtype} {tuple(self.q.shape)}"
            )
        if self.zero_point is not None and self.zero_point.shape != self.scale.shape:
            raise ValueError("QuantizedLinear.zero_point must have the shape of scale")
