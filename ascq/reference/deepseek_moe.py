"""Plain-PyTorch DeepSeek-MoE v1 (`model_type: deepseek`, e.g. deepseek-ai/deepseek-moe-16b-base).

Follows the published `modeling_deepseek.py`: Llama-style attention (MHA/GQA, rotary), RMSNorm, a dense MLP in
the first `first_k_dense_replace` layers, then MoE layers with a softmax router over the routed experts, top-k
weights used as they are (renormalised only when `norm_topk_prob`), plus shared experts that every token
passes through. Module and parameter names are the Hugging Face tensor names, so `state_dict()` loads their
safetensors as-is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascq.core.errors import AscqError
from ascq.core.families.deepseek import DeepseekConfig
from ascq.formats.safetensors import CheckpointReader
from ascq.kernels.reference import select_experts
from ascq.reference.decoder import MLP, AttentionShape, DecoderLayer, RMSNorm, rotary_for

__all__ = ["DeepseekConfig", "DeepseekDecoderLayer", "DeepseekForCausalLM", "DeepseekMoE", "load_deepseek"]


class DeepseekMoE(nn.Module):
    """Routed experts weighted by the router's softmax top-k, plus shared experts added for every token.

    After each forward: `aux_loss` holds DeepSeek's load-balancing loss (training mode and aux_loss_alpha > 0,
    else None); with `record_routing = True`, `routed_token_counts[e]` accumulates how many tokens chose
    expert e.
    """

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
            )
        self.aux_loss: torch.Tensor | None = None
        self.record_routing = False
        self.routed_token_counts = torch.zeros(config.n_routed_experts, dtype=torch.long, device="cpu")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router scores [tokens, experts] and the chosen (top-k weights, expert ids), each [tokens, k]: the
        runtime's router (`select_experts`: fp32 softmax, top-k, renormalized when norm_topk_prob)."""
        logits = self.gate(x)
        topk_weight, topk_idx = select_experts(
            logits, self.config.num_experts_per_tok, self.config.norm_topk_prob
        )
        return logits.float().softmax(dim=-1), topk_weight.to(x.dtype), topk_idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        scores, topk_weight, topk_idx = self.route(x)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token_ids, slot = torch.nonzero(topk_idx == e, as_tuple=True)
            if token_ids.numel():
                y.index_add_(0, token_ids, expert(x[token_ids]) * topk_weight[token_ids, slot, None])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        self.aux_loss = (
            self._aux_loss(scores, topk_idx, batch, seq)
            if self.training and self.config.aux_loss_alpha > 0
            else None
        )
        if self.record_routing:
            self.routed_token_counts = self.routed_token_counts + torch.bincount(
                topk_idx.flatten().cpu(), minlength=self.config.n_routed_experts
            )
        return y.view(batch, seq, hidden)

    def _aux_loss(self, scores: torch.Tensor, topk_idx: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """DeepSeek's balance loss: alpha * sum_e f_e * P_e, f_e = load relative to uniform, P_e = mean
        score."""
        n, k = self.config.n_routed_experts, self.config.num_experts_per_tok
        if self.config.seq_aux:  # per sequence, then averaged
            load = torch.zeros(batch, n, device=scores.device)
            load.scatter_add_(1, topk_idx.view(batch, -1), torch.ones(batch, seq * k, device=scores.device))
            load = load / (seq * k / n)
            return (load * scores.view(batch, seq, n).mean(dim=1)).sum(
                dim=1
            ).mean() * self.config.aux_loss_alpha
        load = F.one_hot(topk_idx.flatten(), num_classes=n).float().mean(0) * n
        return (scores.mean(0) * load).sum() * self.config.aux_loss_alpha


def attention_shape(config: DeepseekConfig) -> AttentionShape:
    return AttentionShape(
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.attention_bias,
        config.attention_bias,
    )


class DeepseekDecoderLayer(DecoderLayer):
    """For the other families on this block (Qwen 3 MoE): `moe` (whether the layer has routed experts; None:
    DeepSeek's rule), `qk_norm` (the per-head q/k norm class) and `rotary_config` (the config.json dict the
    rotary settings are read from; None: `config`'s)."""

    def __init__(
        self,
        config: DeepseekConfig,
        layer_idx: int,
        moe: bool | None = None,
        qk_norm: type[RMSNorm] | None = None,
        rotary_config: dict[str, Any] | None = None,
    ) -> None:
        if config.is_moe_layer(layer_idx) if moe is None else moe:
            mlp: nn.Module = DeepseekMoE(config)
        else:
            mlp = MLP(config.hidden_size, config.intermediate_size)
        rotary = rotary_for(rotary_config or config.to_hf_dict())
        super().__init__(attention_shape(config), mlp, config.rms_norm_eps, rotary, qk_norm)


class DeepseekModel(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return self.norm(hidden_states)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] of a causal forward over `input_ids` [batch, seq]."""
        return self.lm_head(self.model(input_ids, position_ids))

    def moe_layers(self) -> list[DeepseekMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, DeepseekMoE)]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' load-balancing losses from the last forward (0 when there are none)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def record_routing(self, enabled: bool = True) -> None:
        """Start (and zero) or stop counting routed tokens per expert in every MoE layer."""
        for m in self.moe_layers():
            m.record_routing = enabled
            m.routed_token_counts = torch.zeros_like(m.routed_token_counts)

    def routed_token_counts(self) -> torch.Tensor:
        """[num_moe_layers, n_routed_experts] token counts recorded since `record_routing(True)`."""
        return torch.stack([m.routed_token_counts for m in self.moe_layers()])


def load_state_dict_files(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (sharded or single-file) safetensors checkpoint."""
    reader = CheckpointReader(model_dir)
    with reader.opened():
        return {name: reader.get(name) for name in reader}


def load_deepseek(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> DeepseekForCausalLM:
    """A DeepseekForCausalLM in eval mode with the weights of an HF-layout folder (config.json +
    safetensors)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise AscqError(f"{model_dir}: config.json is missing")
    config = DeepseekConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    with torch.device("meta"):
        model = DeepseekForCausalLM(config)
    state = {k: v.to(dtype) for k, v in load_state_dict_files(model_dir).items()}
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise AscqError(f"{model_dir}: weights do not match the config: {str(exc).splitlines()[0]}") from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
