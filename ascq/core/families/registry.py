"""The model families ascq converts and serves, one row each (vLLM's model_executor/models/registry.py): the
config.json `model_type`, the `architectures` class name, and the "module:attr" of the family's
`ModelFamily`, imported only when a config of that type is read. Adding a family: its module under
`ascq/core/families/` and a row here (docs/ARCHITECTURE.md, "How to add a model family")."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.core.families.base import Config, ModelFamily

# model_type: (the `architectures` class name, the family description)
FAMILY_ROWS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "ascq.core.families.llama:LLAMA"),
    "mistral": ("MistralForCausalLM", "ascq.core.families.llama:MISTRAL"),
    "qwen2": ("Qwen2ForCausalLM", "ascq.core.families.qwen2:QWEN2"),
    "deepseek": ("DeepseekForCausalLM", "ascq.core.families.deepseek:DEEPSEEK"),
    "gemma3_text": ("Gemma3ForCausalLM", "ascq.core.families.gemma3:GEMMA3_FAMILY"),
    "qwen3": ("Qwen3ForCausalLM", "ascq.core.families.qwen3:QWEN3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "ascq.core.families.qwen3_moe:QWEN3_MOE"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILY_ROWS)
SUPPORTED_ARCHITECTURES = tuple(architecture for architecture, _ in FAMILY_ROWS.values())


@functools.cache
def resolve(path: str) -> Any:
    """The object a "module:attr" path names (imported on first use)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def lookup(model_type: Any) -> ModelFamily | None:
    """The family of a model_type, None for one ascq does not know."""
    row = FAMILY_ROWS.get(model_type) if isinstance(model_type, str) else None
    return resolve(row[1]) if row else None


def family_of(config: Config) -> ModelFamily:
    """The family of a config.json dict, its config checked (`ModelFamily.check_config`); UnsupportedError
    names the supported model types."""
    family = lookup(config.get("model_type"))
    if family is None:
        raise unsupported_model_type(config.get("model_type"))
    family.check_config(config)
    return family


def family_of_architectures(config: Config) -> ModelFamily:
    """The family of the first known class in config.json's `architectures` (what the server loads by)."""
    architectures = config.get("architectures") or []
    model_types = {architecture: model_type for model_type, (architecture, _) in FAMILY_ROWS.items()}
    for architecture in architectures:
        if architecture in model_types:
            return family_of({**config, "model_type": model_types[architecture]})
    raise UnsupportedError(
        f"model architecture {architectures or config.get('model_type')} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def unsupported_model_type(model_type: Any) -> UnsupportedError:
    """The one-line refusal of an architecture ascq cannot convert or run, naming the supported families."""
    return UnsupportedError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def model_type_of_gguf(architecture: Any) -> Any:
    """transformers' model_type for a GGUF file's `general.architecture` (the same name unless a family says
    otherwise)."""
    for model_type in FAMILY_ROWS:
        family = lookup(model_type)
        if family is not None and family.gguf_architecture == architecture:
            return model_type
    return architecture
