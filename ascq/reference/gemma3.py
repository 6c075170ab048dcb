"""The plain-PyTorch reference Gemma 3 decoder layer (Hugging Face names): the shared `Attention` with q/k
RMSNorm, Gemma's query scale and a sliding window on `sliding_attention` layers, a GELU-tanh MLP, and four
(1 + weight) RMSNorms: the attention and MLP branches are each normed before and after."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascq.core.families import gemma3
from ascq.reference.decoder import MLP, Attention, AttentionShape, GemmaRMSNorm, KVHook, rotary_for


class Gemma3Attention(Attention):
    def __init__(self, config: dict[str, Any], index: int, shape: AttentionShape) -> None:
        layer_type = gemma3.layer_types(config)[index]
        rotary = rotary_for(gemma3.rope_config(config, layer_type))
        scale, window = gemma3.query_scale(config), gemma3.sliding_window(config, index)
        super().__init__(shape, rotary, scale, window, GemmaRMSNorm, float(config.get("rms_norm_eps", 1e-6)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], index: int) -> None:
        super().__init__()
        bias = bool(config.get("attention_bias"))
        shape = AttentionShape.from_config(config, bias, bias)
        hidden, eps = shape.hidden_size, float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = Gemma3Attention(config, index, shape)
        self.mlp = MLP(hidden, int(config["intermediate_size"]), activation="gelu_pytorch_tanh")
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        return self.mlp_block(self.attention_block(hidden_states, position_ids, kv_hook))

    def attention_block(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        """hidden + post_attention_layernorm(self_attn(input_layernorm(hidden)))."""
        attn = self.self_attn(self.input_layernorm(hidden_states), position_ids, kv_hook)
        return hidden_states + self.post_attention_layernorm(attn)

    def mlp_block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(hidden)))."""
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)
