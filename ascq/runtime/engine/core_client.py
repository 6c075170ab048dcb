"""`LLM`'s engine when the model runs on several ranks (vLLM v1's SyncMPClient): the engine core, and with it
rank 0, in its own process (engine_core.py), driven synchronously over its pipe.

So a rank that dies takes down the core process, never the user's: gloo can abort the process of a peer whose
connection breaks (an exception escaping its I/O thread), and rank 0 used to be the user's script. The core
sends token-id deltas; `OutputProcessor` turns them into cumulative `RequestOutput`s with text, as the server
does. Same methods as `LLMEngine` where `LLM` uses them.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from ascq.core.errors import AscqError
from ascq.runtime.engine.engine_core import EngineCoreProcess
from ascq.runtime.engine.inputs import PromptType, check_request_options, parse_prompt
from ascq.runtime.engine.output_processor import OutputProcessor
from ascq.runtime.engine.outputs import RequestOutput
from ascq.runtime.engine.pooling_params import PoolingParams, as_sampling_params
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.worker.loader import engine_tokenizer

POLL_S = 0.2


def offline_engine(args: Any, tokenizer: Any = None) -> Any:
    """The offline engine for `args`: `LLMEngine` in this process, or with several ranks outside torchrun an
    `EngineCoreClient` (rank 0 in its own process; same API). `tokenizer`: an object replacing the model's."""
    from ascq.runtime.distributed.rendezvous import torchrun_rank
    from ascq.runtime.engine.llm_engine import LLMEngine

    if args.world_size > 1 and torchrun_rank() is None:
        if tokenizer is not None:
            raise ValueError(
                "a tokenizer object cannot be used with tensor / pipeline parallel (the engine runs in "
                "its own process); pass the tokenizer's path"
            )
        return EngineCoreClient(args)
    return LLMEngine(args, tokenizer=tokenizer)


class EngineCoreClient:
    def __init__(self, args: Any, tokenizer: Any = None) -> None:
        self.core = EngineCoreProcess(args)
        self.tokenizer = tokenizer if tokenizer is not None else engine_tokenizer(args)
        self.max_model_len = self.core.info["max_model_len"]
        self.eos_token_ids = set(self.core.info["eos_token_ids"])
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.stats: dict[str, float | int] = {}
        self.ready: list[RequestOutput] = []  # outputs that arrived while waiting for an "added"

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        **options: Any,
    ) -> None:
        """`LLMEngine.add_request`'s signature and rules."""
        check_request_options(**options)
        params = as_sampling_params(params)
        prompt = parse_prompt(prompt)
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        message = (
            "add",
            request_id,
            token_ids if cache_salt is None else {"prompt_token_ids": token_ids, "cache_salt": cache_salt},
            params,
        )
        try:
            payload = pickle.dumps(message)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ValueError(
                f"sampling params must be picklable when the engine runs in its own process "
                f"(tensor / pipeline parallel): {exc}"
            ) from None
        self.processor.add(request_id, prompt if isinstance(prompt, str) else None, token_ids, params)
        self._send_bytes(payload)
        while True:
            reply = self._receive()
            if reply[0] == "added" and reply[1] == request_id:
                if reply[2] is not None:
                    self.processor.forget(request_id)
                    raise ValueError(reply[2])
                return
            self.ready += self._handle(reply)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            if one in self.processor.requests:
                self.processor.forget(one)
                self._send(("abort", one))

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests) or bool(self.ready)

    def step(self) -> list[RequestOutput]:
        """The outputs of the next engine step (blocks until the core sends them)."""
        if self.ready:
            outputs, self.ready = self.ready, []
            return outputs
        if not self.processor.requests:
            return []
        return self._handle(self._receive())

    def get_stats(self) -> dict[str, float | int]:
        return dict(self.stats)

    def shutdown(self) -> None:
        self.core.shutdown()

    def _handle(self, message: tuple) -> list[RequestOutput]:
        if message[0] == "step_error":
            self.processor.requests.clear()
            raise AscqError("the engine failed a step and dropped the requests in flight; see its log above")
        if message[0] == "dead":  # a rank exited; the core process stops after this message
            self.processor.requests.clear()
            raise AscqError(message[1])
        if message[0] != "outputs":
            return []
        self.stats = message[2]
        outputs = []
        for delta in message[1]:
            output, stopped = self.processor.process(delta)
            for index, stop_string in stopped:  # a stop string ended it here: the core stops generating it
                self._send(("finish", delta.request_id, index, stop_string))
            if output is not None:
                outputs.append(output)
        return outputs

    def _receive(self) -> tuple:
        while True:
            try:
                if self.core.conn.poll(POLL_S):
                    return self.core.conn.recv()
            except (EOFError, OSError):
                break
            if not self.core.is_alive():
                break
        self.processor.requests.clear()
        raise AscqError(
            f"the engine process died (exit code {self.core.exitcode}): a rank failed; see the log above"
        )

    def _send(self, message: tuple) -> None:
        self._send_bytes(pickle.dumps(message))

    def _send_bytes(self, payload: bytes) -> None:
        try:
            self.core.conn.send_bytes(payload)
        except (OSError, ValueError):
            self._receive()  # raises the engine-died error (or returns a last message if one is queued)
            raise AscqError("the engine process is gone") from None
