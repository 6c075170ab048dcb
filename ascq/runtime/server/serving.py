"""Completions and chat completions: request -> prompt token ids + SamplingParams -> engine -> OpenAI response.

Prompts are tokenized here (the same `tokenizer.encode` the engine applies to text prompts; chat prompts through
the chat template without special tokens) so that length errors name both numbers before the engine sees them.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ascq.runtime.sampling_params import SamplingParams
from ascq.runtime.server.async_engine import AsyncEngine, RequestGroup
from ascq.runtime.server.chat_template import ChatPrompter
from ascq.runtime.server.logprobs import LogprobFormatter
from ascq.runtime.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    Usage,
    random_id,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, prompter: ChatPrompter, model_name: str,
                 max_model_len: int, vocab_size: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompter = prompter
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.logprobs = LogprobFormatter(tokenizer)
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ascq",
                "max_model_len": self.max_model_len}
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        prompts = [self._prompt_ids(prompt, i) for i, prompt in enumerate(body.prompts())]
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        for ids in prompts:
            self._check_fits(len(ids), max_tokens, "prompt")
        params = self._sampling_params(body, max_tokens, body.logprobs)
        request_id = random_id("cmpl")
        group = await self._submit(request_id, prompts, params)
        if body.stream:
            return _event_stream(self._completion_chunks(group, body, request_id), group)
        finals = await _final_outputs(group, request)
        choices = [CompletionChoice(index=i * body.n + o.index, text=o.text, finish_reason=o.finish_reason,
                                    stop_reason=o.stop_reason,
                                    logprobs=self.logprobs.completion(o.token_ids, o.logprobs, body.logprobs, 0))
                   for i, final in enumerate(finals) for o in final.outputs]
        response = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=_usage(finals))
        return JSONResponse(response.model_dump())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        messages = [message.as_template_dict() for message in body.messages]
        ids = self.prompter.render(messages, body.add_generation_prompt)
        requested = body.max_completion_tokens or body.max_tokens
        self._check_fits(len(ids), requested, "messages")
        max_tokens = requested or self.max_model_len - len(ids)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        group = await self._submit(random_id("chatcmpl"), [ids], self._sampling_params(body, max_tokens, top_n))
        if body.stream:
            return _event_stream(self._chat_chunks(group, body, top_n), group)
        (final,) = await _final_outputs(group, request)
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason, logprobs=self.logprobs.chat(o.token_ids, o.logprobs, top_n))
                   for o in final.outputs]
        response = ChatCompletionResponse(id=group.request_ids[0], model=self.model_name, choices=choices,
                                          usage=_usage([final]))
        return JSONResponse(response.model_dump())

    # ---- validation ----------------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _prompt_ids(self, prompt: str | list[int], index: int) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise APIError(400, f"prompt {index} is empty", param="prompt")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"prompt {index} has token ids outside [0, {self.vocab_size})", param="prompt")
        return ids

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if max_tokens is None and num_prompt_tokens >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                f"{num_prompt_tokens} tokens, which leaves no room to generate", param=param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                f"{num_prompt_tokens} tokens and max_tokens is {max_tokens} "
                                f"({num_prompt_tokens + max_tokens} in total)", param="max_tokens")

    def _sampling_params(self, body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=min(body.top_k or 0, self.vocab_size),
                min_p=body.min_p or 0.0, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, max_tokens=max_tokens,
                logprobs=logprobs, ignore_eos=body.ignore_eos)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def _submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> RequestGroup:
        try:
            return await self.engine.submit(request_id, prompts, params)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    # ---- streaming -----------------------------------------------------------------------------------------

    async def _completion_chunks(self, group: RequestGroup, body: CompletionRequest, request_id: str):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        finals: dict[int, Any] = {}
        async for i, _, o, start in _deltas(group, finals):
            chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[CompletionChoice(
                index=i * body.n + o.index, text=o.text[start[0]:], finish_reason=o.finish_reason,
                stop_reason=o.stop_reason, logprobs=self.logprobs.completion(
                    o.token_ids[start[1]:], (o.logprobs or [])[start[1]:], body.logprobs, start[0]))])
            yield _sse(chunk, include_usage)
        if include_usage:
            usage = _usage([finals[i] for i in sorted(finals)])
            yield _sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage))

    async def _chat_chunks(self, group: RequestGroup, body: ChatCompletionRequest, top_n: int | None):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return _sse(ChatCompletionChunk(id=group.request_ids[0], model=self.model_name, choices=choices,
                                            usage=usage), include_usage)

        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(body.n)])
        finals: dict[int, Any] = {}
        async for _, _, o, start in _deltas(group, finals):
            logprobs = self.logprobs.chat(o.token_ids[start[1]:], (o.logprobs or [])[start[1]:], top_n)
            yield chunk([ChatChunkChoice(index=o.index, delta=DeltaMessage(content=o.text[start[0]:]),
                                         logprobs=logprobs, finish_reason=o.finish_reason)])
        if include_usage:
            yield chunk([], _usage([finals[0]]))


async def _deltas(group: RequestGroup, finals: dict[int, Any]):
    """(prompt index, output, completion, (chars, tokens) already sent) for each completion with new text."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}
    async for i, output in group:
        finals[i] = output
        for o in output.outputs:
            start = sent.get((i, o.index), (0, 0))
            if len(o.text) > start[0] or o.finish_reason is not None:
                yield i, output, o, start
                sent[(i, o.index)] = (len(o.text), len(o.token_ids))


def _event_stream(chunks: Any, group: RequestGroup) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:  # the engine failed or shut down mid-stream: tell the client in-band
            yield _sse_json(exc.to_json())
        finally:
            group.abort()  # no-op when finished; frees the KV blocks when the client left or the task was cancelled
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(response: Any, include_usage: bool = True) -> str:
    return f"data: {response.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"


def _sse_json(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(finals: list[Any]) -> Usage:
    num_prompt = sum(len(final.prompt_token_ids) for final in finals)
    num_completion = sum(len(o.token_ids) for final in finals for o in final.outputs)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion)


async def _final_outputs(group: RequestGroup, request: Request) -> list[Any]:
    """The finished outputs in prompt order; aborts the engine requests if the client disconnects first."""

    async def collect() -> list[Any]:
        finals: dict[int, Any] = {}
        async for i, output in group:
            finals[i] = output
        return [finals[i] for i in range(len(group.request_ids))]

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        work.cancel()  # no-op when done
        group.abort()  # no-op when every request finished
    if not work.done() or work.cancelled():
        raise APIError(499, "client disconnected", code="client_disconnected")
    return work.result()


async def _client_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
