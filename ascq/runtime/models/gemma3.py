"""Gemma 3 (text) decoder: the Llama layout plus q/k RMSNorm, four (1 + weight) norms per layer, a GELU-tanh
MLP, embeddings scaled by sqrt(hidden_size), and sliding-window attention with its own rotary base on the
layers `layer_types` marks (`ascq.core.families.gemma3`). Windowed layers attend through
`AttentionMetadata.windowed`: their block tables start at the window, so blocks wholly past it are never read.

Its layers are not `llama.DecoderLayer`s (the post-attention and post-feed-forward norms sit on the branch
outputs), so the fused native decode and the compiled decode / device graphs, which are written against
that layer, leave Gemma 3 to the eager path; pipeline stages call the layers as they call Llama's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascq.core.families import gemma3
from ascq.core.tensors import tie_word_embeddings
from ascq.runtime.layers.attention import Attention, AttentionMetadata
from ascq.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ascq.runtime.layers.rmsnorm import GemmaRMSNorm
from ascq.runtime.models.llama import CausalLM, DecoderModel, LlamaAttention, LlamaMLP

CosSin = tuple[torch.Tensor, torch.Tensor]


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times a constant rounded to the embedding's dtype (transformers'
    Gemma3TextScaledWordEmbedding)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.embed_scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: dict[str, Any], index: int) -> None:
        self.layer_type = gemma3.layer_types(config)[index]
        rope_config = gemma3.rope_config(config, self.layer_type)
        super().__init__(rope_config, bool(config.get("attention_bias")), GemmaRMSNorm)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=gemma3.query_scale(config),
            sliding_window=gemma3.sliding_window(config, index),
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, cos_sin: CosSin | None
    ) -> torch.Tensor:
        q, k, v = self.project(positions, x, cos_sin)
        if self.attn.sliding_window is not None:
            meta = meta.windowed(self.attn.sliding_window, self.attn.k_cache.shape[1])
        return self.o_proj(self.attn(q, k, v, meta))


class GeluTanhMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class Gemma3DecoderLayer(nn.Module):
    """hidden + post_attention_layernorm(attn(input_layernorm(hidden))), then
    hidden + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(hidden))). As Llama's layers, it takes
    (x, residual) and returns its last branch output and the residual stream before that branch is added."""

    def __init__(self, config: dict[str, Any], index: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma3Attention(config, index)
        self.mlp = GeluTanhMLP(hidden, config["intermediate_size"])
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin: dict[str, CosSin] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin`: this step's rotary factors by layer type (`Gemma3Model.embed`), None: computed here."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        layer_cos_sin = cos_sin.get(self.self_attn.layer_type) if cos_sin is not None else None
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta, layer_cos_sin))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(DecoderModel):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config, lambda i: Gemma3DecoderLayer(config, i))
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.embed_tokens = ScaledEmbedding(config["vocab_size"], hidden, gemma3.embed_scale(config))
        self.norm = GemmaRMSNorm(hidden, eps)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, CosSin]]:
        """Scaled token embeddings and the step's rotary factors of each layer type (shared by its layers)."""
        x = self.embed_tokens(input_ids)
        cos_sin: dict[str, CosSin] = {}
        for layer in self.layers:
            attn = layer.self_attn
            if attn.layer_type not in cos_sin:
                cos_sin[attn.layer_type] = attn.rotary_emb.cos_sin(positions, x.dtype)
        return x, cos_sin


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any]) -> None:
        gemma3.check_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.tie_word_embeddings = tie_word_embeddings(config)
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
