"""Qwen 2: the Llama layout with q/k/v biases whatever `attention_bias` says (o_proj has none)."""

from __future__ import annotations

from ascq.core.families.base import ModelFamily
from ascq.core.families.llama import CONVERTER, SERVING_MODEL, check_config

QWEN2 = ModelFamily(
    converter=CONVERTER, serving_model=SERVING_MODEL, check_config=check_config, qkv_bias_always=True
)
