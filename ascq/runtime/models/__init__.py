"""Model classes by the `architectures` entry of config.json."""

from __future__ import annotations

from typing import Any

from torch import nn

from ascq.core.architecture import GEMMA3, LLAMA_FAMILY, MODEL_TYPES
from ascq.core.errors import UnsupportedError

# `architectures` class name -> runtime model family (llama, deepseek, gemma3_text), from the model-type table
ARCHITECTURES = {
    f"{prefix}ForCausalLM": "llama" if model_type in LLAMA_FAMILY else model_type
    for model_type, prefix in MODEL_TYPES.items()
}


def model_class_for(config: dict[str, Any]) -> type[nn.Module]:
    archs = config.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedError(
            f"model architecture {archs or config.get('model_type')} is not supported; supported: {supported}"
        )
    if family == GEMMA3:
        from ascq.runtime.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if family == "deepseek":
        from ascq.runtime.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    from ascq.runtime.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
