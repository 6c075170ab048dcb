"""ascq: quantize Hugging Face LLM checkpoints into a model zoo and serve them."""

from typing import Any

from ascq.core.version import __version__ as __version__

_LAZY = {"LLM": "ascq.runtime.engine.llm", "SamplingParams": "ascq.runtime.sampling.sampling_params"}


def __getattr__(name: str) -> Any:
    """`from ascq import LLM, SamplingParams` without importing torch when the CLI starts."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ascq' has no attribute {name!r}")
