"""vLLM's `AsyncLLMEngine` for asyncio code: the server's engine (engine core in its own process, the event
loop's `AsyncEngine` streaming its outputs: ascq/runtime/server/async_engine.py) behind vLLM's API."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.inputs import PromptType, check_request_options, parse_prompt
from ascq.runtime.engine.outputs import RequestOutput
from ascq.runtime.engine.pooling_params import PoolingParams, as_sampling_params
from ascq.runtime.sampling.sampling_params import SamplingParams


class _Aborted(Exception):
    """Put into an aborted request's output queue: its `generate` loop ends."""


class AsyncLLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        from ascq.runtime.engine.engine_core import EngineCoreProcess
        from ascq.runtime.server.async_engine import AsyncEngine
        from ascq.runtime.server.metrics import ServerMetrics
        from ascq.runtime.worker.loader import engine_tokenizer

        self.engine_args = engine_args
        core = EngineCoreProcess(engine_args)
        self.tokenizer = engine_tokenizer(engine_args)
        name = engine_args.served_model_name or str(engine_args.model)
        self.engine = AsyncEngine(core, self.tokenizer, ServerMetrics(name))
        self.max_model_len = core.info["max_model_len"]
        self._started = False
        self._groups: dict[str, Any] = {}  # request id -> its RequestGroup while it runs

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: Any = None,
        **_: Any,
    ) -> AsyncLLMEngine:
        """vLLM's constructor: the engine core process starts (and loads the model) now; the output loop
        starts with the first request, on the running event loop."""
        if stat_loggers:
            from ascq.core.errors import UnsupportedError

            raise UnsupportedError("stat_loggers are not supported")
        return cls(engine_args)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative RequestOutput after each step that changed it, the last one
        finished. Leaving the loop early (break, cancellation) aborts the request."""
        check_request_options(lora_request, options.pop("tokenization_kwargs", None), trace_headers, priority)
        if options:
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(options)}")
        params = as_sampling_params(sampling_params)
        parsed = parse_prompt(prompt)
        cache_salt = parsed.pop("cache_salt") if isinstance(parsed, dict) else None
        if isinstance(parsed, dict):
            parsed = parsed.get("prompt_token_ids", parsed.get("prompt"))
        self._start()
        group = await self.engine.submit(request_id, [parsed], params, cache_salt)
        self._groups[request_id] = group
        try:
            async for _, output in group:
                # the engine may tag its request id (it keeps clients' ids apart); callers see theirs
                yield dataclasses.replace(output, request_id=request_id)
        except _Aborted:
            return
        finally:
            group.abort()  # no-op once finished
            if self._groups.get(request_id) is group:
                del self._groups[request_id]

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop the request; its `generate` loop ends (its last output is the one before the abort)."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            group = self._groups.pop(one, None)
            if group is not None:
                group.abort()
                group.out.put_nowait(_Aborted())

    def _start(self) -> None:
        if not self._started:
            self.engine.start()
            self._started = True

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self.engine.is_alive

    @property
    def errored(self) -> bool:
        return not self.engine.is_alive

    def shutdown(self) -> None:
        """Stop the engine core process (vLLM: `shutdown()`); outstanding requests fail."""
        self.engine.stop()
