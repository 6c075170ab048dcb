"""Rotary position embedding (neox / rotate-half layout) with the config's rope scaling.

Inverse frequencies of scaled variants (linear, llama3, yarn, ...) come from transformers'
ROPE_INIT_FUNCTIONS; cos/sin are precomputed in fp32 for every position up to max_position_embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascq.core.errors import UnsupportedError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(config: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], attention factor) for a config.json dict."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(scaling.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_config = LlamaConfig(
        hidden_size=head_dim * config["num_attention_heads"],
        num_attention_heads=config["num_attention_heads"],
        head_dim=head_dim,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling={**scaling, "rope_type": rope_type},
    )
    with torch.device("cpu"):  # the model is being built under a meta device context
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](rope_config, "cpu")
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(config, head_dim)  # on the CPU even under a meta device
        freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] of the positions, in `dtype`: gathered once per step and shared by every
        layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @classmethod
    def rotate(cls, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, D] (q and k heads side by side: one rotation for both) rotated by `cos_sin`."""
        cos, sin = cos_sin
        return x * cos + cls._rotate_half(x) * sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] rotated by their token positions [T]."""
        cos_sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos_sin), self.rotate(k, cos_sin)
