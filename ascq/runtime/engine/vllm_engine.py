"""vLLM's `LLMEngine` name: ascq's engine with vLLM's constructor, kept above `llm_engine` and `core_client`
so that the engine itself never imports the client that runs it in another process."""

from __future__ import annotations

from typing import Any

from ascq.core.errors import UnsupportedError
from ascq.runtime.engine import llm_engine
from ascq.runtime.engine.core_client import EngineCoreClient, offline_engine
from ascq.runtime.engine.engine_args import EngineArgs


class LLMEngine(llm_engine.LLMEngine):
    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None, **_: Any
    ) -> llm_engine.LLMEngine | EngineCoreClient:
        """vLLM's constructor. With several ranks outside torchrun, rank 0 runs in its own process: the
        returned `EngineCoreClient` has the same request / step API (see core_client.py)."""
        if stat_loggers:
            raise UnsupportedError("stat_loggers are not supported (ascq's statistics: get_stats())")
        return offline_engine(engine_args)
