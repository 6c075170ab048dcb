"""Qwen 3 (dense): the Llama layout with per-head q/k RMSNorm before rotary and no biases unless
`attention_bias` (then on q/k/v and o, as transformers' Qwen3Attention); its sliding-window layers are
refused."""

from __future__ import annotations

from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import ModelFamily
from ascq.core.families.llama import CONVERTER, SERVING_MODEL
from ascq.core.families.llama import check_config as check_llama_config


def check_config(config: dict[str, Any]) -> None:
    check_llama_config(config)
    windowed = config.get("use_sliding_window") or any(
        t != "full_attention" for t in config.get("layer_types") or ()
    )
    if windowed:
        raise UnsupportedError("Qwen 3 sliding-window layers are not supported (use_sliding_window: false)")


QWEN3 = ModelFamily(converter=CONVERTER, serving_model=SERVING_MODEL, check_config=check_config, qk_norm=True)
