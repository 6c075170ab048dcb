"""Llama-layout decoder, serving every family whose registry row names `LlamaForCausalLM` (Llama 1 to 3.x,
Mistral, Qwen 2 with q/k/v biases): GQA, tied or untied embeddings, rope scaling, and per-head q/k RMSNorm
before rotary where the family has it (`ModelFamily.qk_norm`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascq.core.architecture import divide, head_dim_of, kv_heads_per_rank
from ascq.core.families.registry import family_of
from ascq.core.rotary import RotaryEmbedding
from ascq.core.tensors import tie_word_embeddings
from ascq.runtime.distributed.parallel import tp_world_size
from ascq.runtime.layers.attention import Attention, AttentionMetadata
from ascq.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ascq.runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ascq.runtime.layers.rmsnorm import RMSNorm
from ascq.runtime.models.weights import load_named_weights


class LlamaAttention(nn.Module):
    """`qk_norm`: the norm class of the per-head q and k norms (`q_norm`, `k_norm`; None: none)."""

    def __init__(self, config: dict[str, Any], qkv_bias: bool, qk_norm: type[RMSNorm] | None = None) -> None:
        super().__init__()
        world = tp_world_size()
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = divide(num_heads, world)
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, world)
        hidden = config["hidden_size"]
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, hidden, bias=bool(config.get("attention_bias"))
        )
        max_position = config.get("max_position_embeddings", 2048)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_position)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = qk_norm(self.head_dim, eps), qk_norm(self.head_dim, eps)

    def project(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D] of x (rotated); `cos_sin`: this step's rotary factors
        (`RotaryEmbedding.cos_sin`), shared by all layers when given; q and k are RMS-normed per head first
        when the family has q/k norms. `self.attn` and `self.o_proj` follow."""
        qkv = self.qkv_proj(x)
        heads, q_heads = self.num_heads + self.num_kv_heads, self.num_heads
        qk_size = heads * self.head_dim
        if cos_sin is None:
            cos_sin = self.rotary_emb.cos_sin(positions, qkv.dtype)
        qk = qkv[:, :qk_size].view(-1, heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :q_heads]), self.k_norm(qk[:, q_heads:])], dim=1)
        # q and k heads are adjacent in the fused projection's output: one rotation for both
        qk = self.rotary_emb.rotate(qk, cos_sin)
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        return qk[:, :q_heads], qk[:, q_heads:], v


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; `mlp` is any module mapping [T, hidden] -> [T, hidden].

    `decode_graph`: `run` compiled for pure decode steps (set by the model runner's `DecodeGraphs`), used when
    the step's metadata asks for it."""

    decode_graph: Callable | None = None

    def __init__(
        self, config: dict[str, Any], mlp: nn.Module, qkv_bias: bool, qk_norm: type[RMSNorm] | None = None
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.use_decode_graph and self.decode_graph is not None:
            return self.decode_graph(positions, x, residual, meta, cos_sin)
        return self.run(positions, x, residual, meta, cos_sin)

    def run(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.pre_attention(positions, x, residual, cos_sin)
        x, residual = self.post_attention(self.self_attn.attn(q, k, v, meta), residual)
        return self.mlp(x), residual

    def pre_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (adding the residual) -> q, k, v projection -> rotary: (q, k, v, residual)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(positions, x, cos_sin), residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj -> post-attention norm (adding the residual): (the MLP's input, residual)."""
        return self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)


class DecoderModel(nn.Module):
    """`fused_decode`: runs a pure decode step's layers and final norm in one native call (set by the model
    runner; see runtime/fused_decode.py), returning None for steps it does not take."""

    fused_decode: Callable | None = None

    def __init__(self, config: dict[str, Any], make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(make_layer(i) for i in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, cos_sin = self.embed(input_ids, positions)
        residual = None
        fused = self.fused_decode(x, cos_sin, meta) if self.fused_decode is not None else None
        if fused is not None:
            return fused
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, cos_sin)
        x, _ = self.norm(x, residual)
        return x

    def embed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Token embeddings and the step's rotary factors (shared by every layer)."""
        x = self.embed_tokens(input_ids)
        cos_sin = (
            self.layers[0].self_attn.rotary_emb.cos_sin(positions, x.dtype) if len(self.layers) else None
        )
        return x, cos_sin


class CausalLM(nn.Module):
    """Decoder + LM head; `forward` returns final hidden states, `compute_logits` fp32 logits for chosen
    rows."""

    def __init__(self, config: dict[str, Any], make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = tie_word_embeddings(config)
        self.model = DecoderModel(config, make_layer)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        scheme_for: Callable[[str], str],
        on_loaded: Callable[[nn.Module], None] | None = None,
    ) -> None:
        def with_tied_head() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue
                yield name, tensor
                if name == "model.embed_tokens.weight" and self.tie_word_embeddings:
                    yield "lm_head.weight", tensor

        load_named_weights(self, with_tied_head(), scheme_for, on_loaded)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any]) -> None:
        family = family_of(config)
        qkv_bias, mlp_bias = family.qkv_bias(config), bool(config.get("mlp_bias"))
        qk_norm = RMSNorm if family.qk_norm else None

        def make_layer(i: int) -> nn.Module:
            mlp = LlamaMLP(config["hidden_size"], config["intermediate_size"], bias=mlp_bias)
            return DecoderLayer(config, mlp, qkv_bias, qk_norm)

        super().__init__(config, make_layer)
