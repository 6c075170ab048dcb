"""The plain-PyTorch reference decoder layer (Hugging Face module and tensor names) of every supported family:
Llama-style attention (MHA/GQA, rotary, optional q/k/v and o biases) and a SiLU-gated MLP, or any `mlp` module
(DeepSeek-MoE's routed experts). The converter calibrates and measures on it; transformers stays the
independent reference in the tests.

Its RMSNorm, rotary embedding and attention are the runtime's own functions (`rms_norm`, `RotaryEmbedding`,
the reference backend's `causal_attention`), so the converter's fake-quantized logits are the reference
backend's served logits bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascq.core.architecture import head_dim_of
from ascq.core.errors import AscqError
from ascq.core.norm import gemma_rms_norm, rms_norm
from ascq.core.rotary import RotaryEmbedding
from ascq.kernels.reference import causal_attention, causal_visible

# kv_hook(key, value) -> (key, value) on post-RoPE keys/values [batch, kv_heads, seq, head_dim] (calibration,
# fp8 KV)
KVHook = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise AscqError(
                f"num_attention_heads {self.num_heads} must divide by num_key_value_heads {self.num_kv_heads}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], qkv_bias: bool, o_bias: bool) -> AttentionShape:
        num_heads = int(config["num_attention_heads"])
        return cls(
            int(config["hidden_size"]),
            num_heads,
            int(config.get("num_key_value_heads") or num_heads),
            head_dim_of(config),
            qkv_bias,
            o_bias,
        )


class RMSNorm(nn.Module):
    """`weight_offset`: the norm multiplies by (weight_offset + weight); smoothing divides that sum (AWQ,
    SmoothQuant)."""

    weight_offset = 0.0

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    weight_offset = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """`scale`: the query scale (head_dim ** -0.5 unless a family sets it); `sliding_window`: keys at most
    this many positions back are seen (None: all); `qk_norm`: the norm class of the per-head q and k norms
    (`q_norm`, `k_norm`, before rotary; None: none), of epsilon `eps`."""

    def __init__(
        self,
        shape: AttentionShape,
        rotary: RotaryEmbedding,
        scale: float | None = None,
        sliding_window: int | None = None,
        qk_norm: type[RMSNorm] | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.rotary_emb = rotary
        self.scale = shape.head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        hidden, q_size, kv_size = (
            shape.hidden_size,
            shape.num_heads * shape.head_dim,
            shape.num_kv_heads * shape.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=shape.o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(shape.head_dim, eps), qk_norm(shape.head_dim, eps)
        # the converter's calibration forwards (`pipeline.fast_layer`): torch's fused causal attention in this
        # dtype, several times faster on the CPU, equal to `causal_attention` up to float rounding (not bit
        # for bit); None: off
        self.fused_attention: torch.dtype | None = None

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        """x [batch, seq, hidden] at position_ids [1 or batch, seq]."""
        batch, seq, _ = x.shape
        s = self.shape
        q = self.q_proj(x).view(batch, seq, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = self.normalize_qk(q, k)
        # [batch, 1, seq, head_dim]
        cos_sin = self.rotary_emb.cos_sin(position_ids.expand(batch, seq), x.dtype)
        q, k = self.rotary_emb.rotate(q, cos_sin), self.rotary_emb.rotate(k, cos_sin)
        if kv_hook is not None:
            k, v = kv_hook(k, v)
        if self.fused_attention is not None and x.dtype == torch.float32:
            dtype = self.fused_attention
            window = self.sliding_window
            mask = None if window is None else causal_visible(seq, seq, x.device, window)
            out = F.scaled_dot_product_attention(
                q.to(dtype),
                k.to(dtype),
                v.to(dtype),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1).to(x.dtype))
        out = torch.stack(
            [
                causal_attention(
                    q[b].transpose(0, 1),
                    k[b].transpose(0, 1),
                    v[b].transpose(0, 1),
                    self.scale,
                    self.sliding_window,
                )
                for b in range(batch)
            ]
        ).to(x.dtype)
        return self.o_proj(out.reshape(batch, seq, -1))

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [batch, heads, seq, head_dim] before rotary: RMS-normed per head when the family has q/k norms
        (Qwen 3, Gemma 3), else unchanged."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); `activation`: a key of ACTIVATIONS."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        # training (tests/fixtures/train_fixture.py): autograd keeps the activation's input
        if torch.is_grad_enabled():
            return self.down_proj(self.act(gate) * self.up_proj(x))
        if self.act is F.silu:  # the same values, two fewer tensors
            return self.down_proj(F.silu(gate, inplace=True).mul_(self.up_proj(x)))
        return self.down_proj(self.act(gate).mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block with HF names (self_attn, mlp, input_layernorm,
    post_attention_layernorm)."""

    def __init__(
        self,
        shape: AttentionShape,
        mlp: nn.Module,
        rms_norm_eps: float,
        rotary: RotaryEmbedding,
        qk_norm: type[RMSNorm] | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(shape, rotary, qk_norm=qk_norm, eps=rms_norm_eps)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(shape.hidden_size, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, rms_norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        return self.mlp_block(self.attention_block(hidden_states, position_ids, kv_hook))

    def attention_block(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, kv_hook: KVHook | None = None
    ) -> torch.Tensor:
        """The first residual half: hidden + self_attn(input_layernorm(hidden))."""
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids, kv_hook)

    def mlp_block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The second residual half: hidden + mlp(post_attention_layernorm(hidden))."""
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def rotary_for(config: dict[str, Any]) -> RotaryEmbedding:
    """The runtime's rotary embedding for a config (cos/sin tables up to max_position_embeddings)."""
    return RotaryEmbedding(config, head_dim_of(config), int(config.get("max_position_embeddings", 2048)))
