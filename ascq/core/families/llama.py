"""Llama (1 to 3.x: rope scaling of every `ascq.core.rotary` type, llama3's included) and Mistral: GQA,
SiLU-gated MLP, optional attention / MLP biases, tied or untied embeddings."""

from __future__ import annotations

from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import ModelFamily

CONVERTER = "ascq.quantize.architectures:LlamaArch"  # every Llama-layout family's
SERVING_MODEL = "ascq.runtime.models.llama:LlamaForCausalLM"


def check_config(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")


def check_mistral_config(config: dict[str, Any]) -> None:
    check_config(config)
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        if config["sliding_window"] < config.get("max_position_embeddings", 0):
            raise UnsupportedError(
                "sliding-window attention is not supported; set max_model_len <= sliding_window"
            )


LLAMA = ModelFamily(converter=CONVERTER, serving_model=SERVING_MODEL, check_config=check_config)
MISTRAL = ModelFamily(converter=CONVERTER, serving_model=SERVING_MODEL, check_config=check_mistral_config)
