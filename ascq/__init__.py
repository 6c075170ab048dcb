"""ascq: quantize Hugging Face LLM checkpoints into a model zoo and serve them."""

from typing import Any

from ascq.core.version import __version__ as __version__

# vLLM's top-level names (`from vllm import ...` -> `from ascq import ...`), imported on first use
_LAZY = {
    "LLM": "ascq.runtime.engine.llm",
    "SamplingParams": "ascq.runtime.sampling.sampling_params",
    "EngineArgs": "ascq.runtime.engine.engine_args",
    "AsyncEngineArgs": "ascq.runtime.engine.engine_args",
    "LLMEngine": "ascq.runtime.engine.vllm_engine",
    "AsyncLLMEngine": "ascq.runtime.server.async_llm_engine",
    "TextPrompt": "ascq.runtime.engine.inputs",
    "TokensPrompt": "ascq.runtime.engine.inputs",
    "PromptType": "ascq.runtime.engine.inputs",
    "RequestOutput": "ascq.runtime.engine.outputs",
    "CompletionOutput": "ascq.runtime.engine.outputs",
    "PoolingParams": "ascq.runtime.engine.pooling_params",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """`from ascq import LLM, SamplingParams, ...` without importing torch when the CLI starts."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ascq' has no attribute {name!r}")
