"""DeepSeek-MoE v1 (`model_type: deepseek`): Llama attention, dense first layers, routed + shared experts;
and every family on its routed-expert block (`ModelFamily.expert_block`: Qwen 3 MoE, with q/k norms and no
shared experts).

The router is a softmax over all experts followed by top-k; weights are renormalized only when norm_topk_prob.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascq.core.families.deepseek import DeepseekConfig
from ascq.core.families.registry import family_of
from ascq.runtime.layers.linear import ReplicatedLinear
from ascq.runtime.layers.moe import FusedMoE
from ascq.runtime.layers.rmsnorm import RMSNorm
from ascq.runtime.models.llama import CausalLM, DecoderLayer, LlamaMLP


class DeepseekMoEBlock(nn.Module):
    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.n_routed_experts)
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.moe_intermediate_size,
        )
        self.shared_experts = None
        if config.n_shared_experts:
            intermediate = config.moe_intermediate_size * config.n_shared_experts
            self.shared_experts = LlamaMLP(config.hidden_size, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DeepseekForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any]) -> None:
        family = family_of(config)
        parsed: DeepseekConfig = family.expert_block(config)
        qk_norm = RMSNorm if family.qk_norm else None
        config = {
            **config,
            "num_key_value_heads": parsed.num_key_value_heads,
            "rms_norm_eps": parsed.rms_norm_eps,
        }

        def make_layer(i: int) -> nn.Module:
            if family.is_moe_layer(config, i):
                mlp = DeepseekMoEBlock(parsed)
            else:
                mlp = LlamaMLP(parsed.hidden_size, parsed.intermediate_size)
            return DecoderLayer(config, mlp, parsed.attention_bias, qk_norm)

        super().__init__(config, make_layer)
