"""Completions and chat completions: request -> prompt token ids + SamplingParams -> engine -> OpenAI
response.

Prompts are tokenized here (the same `tokenizer.encode` the engine applies to text prompts; chat prompts
through the chat template without special tokens) so that length errors name both numbers before the engine
sees them.

Work that grows with the input (tokenizing, rendering the chat template, detokenizing, building a complete
response) runs in a worker thread (`asyncio.to_thread`), never on the event loop: one large request cannot
stall /health or the other requests' streams. Per-request limits (`RequestLimits`) bound what one request may
cost before that work starts.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import struct
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ascq.core.errors import AscqError
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sampling.structured_output import StructuredOutputsParams, require_xgrammar
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
    DetokenizeRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    Usage,
    prompt_list,
    random_id,
)
from ascq.runtime.server.reasoning import REASONING_PARSERS, ReasoningStream
from ascq.runtime.server.tool_call_stream import ToolCallStream, tool_call_stream
from ascq.runtime.server.tool_calls import (
    forced_tool_structure,
    hermes_messages,
    parse_tool_calls,
    template_renders_tools,
    tool_mode,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_RETURNED_PROMPT_TOKENS = 16384  # the default --max-returned-prompt-tokens, when max_model_len is shorter


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may cost (`ascq serve` flags; README "Serving limits").

    max_prompt_chars: characters of one prompt (a chat's messages together), checked before tokenizing.
    max_returned_prompt_tokens: prompt tokens a response carries back (`echo`, `prompt_logprobs`), summed
    over its prompts and choices (n): the two fields that turn a small request into a large response."""

    max_prompt_chars: int
    max_returned_prompt_tokens: int

    @classmethod
    def for_model(
        cls,
        max_model_len: int,
        longest_token_chars: int,
        max_prompt_chars: int | None = None,
        max_returned_prompt_tokens: int | None = None,
    ) -> RequestLimits:
        """The defaults never refuse what could be served: a prompt longer than max_model_len tokens of the
        vocabulary's longest token cannot fit; one full-length prompt's tokens always come back."""
        return cls(
            max_prompt_chars or max_model_len * max(1, longest_token_chars),
            max_returned_prompt_tokens or max(max_model_len, MIN_RETURNED_PROMPT_TOKENS),
        )


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string (at least the text one token can stand for:
    byte-level and sentencepiece token strings spell out every byte or character of it)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        prompter: ChatPrompter,
        model_names: list[str] | str,
        max_model_len: int,
        vocab_size: int,
        tool_options: Any = None,
        limits: RequestLimits | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        """`tool_options`: the server's ServeOptions (tool calling, usage, logprob and reasoning switches);
        `sampling_defaults`: SamplingParams defaults from --generation-config (generation_config.py)."""
        self.engine = engine
        self.enable_auto_tool_choice = bool(tool_options and tool_options.enable_auto_tool_choice)
        self.limits = limits or RequestLimits.for_model(max_model_len, longest_token_chars(tokenizer))
        self.prompt_tokens_details = bool(getattr(tool_options, "enable_prompt_tokens_details", False))
        self.force_include_usage = bool(getattr(tool_options, "enable_force_include_usage", False))
        parser = getattr(tool_options, "reasoning_parser", None)
        self.reasoning = REASONING_PARSERS[parser] if parser else None
        self.sampling_defaults = sampling_defaults or {}
        # worker threads share the tokenizer (reads only); transformers' first encode clears a truncation or
        # padding the tokenizer file sets, a write that must not race them, so it happens here
        tokenizer.encode("")
        self.tokenizer = tokenizer
        self.prompter = prompter
        # every name clients may use (vLLM's --served-model-name a b); responses carry the first
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.model_name = self.model_names[0]
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.logprobs = LogprobFormatter(
            tokenizer, bool(getattr(tool_options, "return_tokens_as_token_ids", False))
        )
        self.created = int(time.time())

    def model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "ascq",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card(name) for name in self.model_names]}

    def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self.model_card(model_id)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does."""
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": self.vocab_size,
            "model_max_length": self.max_model_len,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "add_bos_token": getattr(tok, "add_bos_token", None),
            "chat_template": self.prompter.template,
            "clean_up_tokenization_spaces": getattr(tok, "clean_up_tokenization_spaces", None),
        }

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        if body.messages is not None:
            self._check_prompt_chars(sum(len(m.text) for m in body.messages), "the messages", "messages")
            ids = await asyncio.to_thread(
                self.prompter.render,
                [m.as_template_dict() for m in body.messages],
                body.add_generation_prompt,
            )
        else:
            self._check_prompt_chars(len(body.prompt), "the prompt", "prompt")
            ids = await asyncio.to_thread(
                self.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        # vLLM's TokenizeResponse: token_strs is always there, null unless asked for
        token_strs = (
            await asyncio.to_thread(self.tokenizer.convert_ids_to_tokens, ids)
            if body.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": token_strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        return {"prompt": await asyncio.to_thread(self._decode_tokens, body.tokens)}

    def _decode_tokens(self, tokens: list[int]) -> str:
        if not all(0 <= t < self.vocab_size for t in tokens):
            raise APIError(400, f"tokens has token ids outside [0, {self.vocab_size})", param="tokens")
        return self.tokenizer.decode(tokens)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_priority(body)
        prompts = await self._prompts_ids(
            body.prompts(), body.add_special_tokens, body.truncate_prompt_tokens
        )
        score_only = body.max_tokens == 0  # echo with no new tokens: the engine makes one, it is dropped
        max_tokens = 1 if score_only else (body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
        for ids in prompts:
            self._check_fits(len(ids), max_tokens, "prompt")
        max_tokens = self._capped(max_tokens)
        params = self._sampling_params(body, max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # echoed prompt tokens carry their logprobs too
            params.prompt_logprobs = max(params.prompt_logprobs or 0, body.logprobs)
        if body.echo or params.prompt_logprobs is not None:
            self._check_returned_prompt_tokens(prompts, body.n, "echo" if body.echo else "prompt_logprobs")
        request_id = request_id_of("cmpl", body)
        group = await self._submit(request_id, prompts, params, body.cache_salt)
        if score_only:
            group = ScoredPromptGroup(group)
        if body.stream:
            return _event_stream(self._completion_chunks(group, body, request_id), group)
        finals = await _final_outputs(group, request)
        return await asyncio.to_thread(self._completion_response, body, request_id, finals)

    def _completion_response(self, body: CompletionRequest, request_id: str, finals: list[Any]) -> Response:
        choices = [
            self._completion_choice(body, i, final, o)
            for i, final in enumerate(finals)
            for o in final.outputs
        ]
        response = CompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=self._usage(finals)
        )
        return JSONResponse(response.model_dump())

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """vLLM's LAST pooling for a decoder model: each input's last-token final hidden state, L2-normalized
        (the engine computes one token past the input and drops it)."""
        self._check_model(body.model)
        self._check_priority(body)
        if body.dimensions is not None:  # vLLM refuses it too for a model without matryoshka training
            raise APIError(
                400,
                "dimensions: this model does not support matryoshka representation; its embeddings have "
                "the model's hidden size",
                param="dimensions",
            )
        prompts = await self._prompts_ids(
            prompt_list(body.input), body.add_special_tokens, body.truncate_prompt_tokens, "input"
        )
        for i, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {self.max_model_len} tokens, but input {i} has "
                    f"{len(ids)} tokens (an embedding needs one position past its input)",
                    param="input",
                )
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling="last")
        request_id = request_id_of("embd", body)
        finals = await _final_outputs(await self._submit(request_id, prompts, params), request)
        return await asyncio.to_thread(self._embedding_response, body, request_id, prompts, finals)

    def _embedding_response(
        self, body: EmbeddingRequest, request_id: str, prompts: list[list[int]], finals: list[Any]
    ) -> Response:
        data = [
            EmbeddingData(index=i, embedding=encode_embedding(final.prompt_embedding, body.encoding_format))
            for i, final in enumerate(finals)
        ]
        num_tokens = sum(len(ids) for ids in prompts)
        usage = Usage(prompt_tokens=num_tokens, completion_tokens=0, total_tokens=num_tokens)
        response = EmbeddingResponse(id=request_id, model=self.model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump())

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_priority(body)
        mode = tool_mode(body, self.enable_auto_tool_choice)
        messages = [message.as_template_dict() for message in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if mode else None
        if tools and not template_renders_tools(self.prompter.template):
            messages, tools = hermes_messages(messages, tools), None
        template_kwargs = dict(body.chat_template_kwargs or {})
        if body.reasoning_effort is not None:  # as vLLM: a variable the template may read
            template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "the messages", "messages")
        ids = await asyncio.to_thread(
            self.prompter.render,
            messages,
            body.add_generation_prompt,
            tools,
            continue_final_message=body.continue_final_message,
            documents=body.documents,
            template_kwargs=template_kwargs,
            add_special_tokens=body.add_special_tokens,
        )
        if body.truncate_prompt_tokens is not None:
            ids = ids[-body.truncate_prompt_tokens :]
        requested = body.max_completion_tokens or body.max_tokens
        self._check_fits(len(ids), requested, "messages")
        max_tokens = self._capped(requested or self.max_model_len - len(ids))
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        forced = forced_tool_structure(body, mode)
        if forced is not None and structured_outputs_of(body) is not None:
            raise APIError(
                400,
                "tool_choice required / named cannot be combined with another structured-output constraint",
                param="tool_choice",
            )
        params = self._sampling_params(body, max_tokens, top_n, forced)
        if params.prompt_logprobs is not None:
            self._check_returned_prompt_tokens([ids], body.n, "prompt_logprobs")
        group = await self._submit(request_id_of("chatcmpl", body), [ids], params, body.cache_salt)
        if body.stream and mode is None:
            return _event_stream(self._chat_chunks(group, body, top_n), group)
        if body.stream:
            return _event_stream(self._chat_tool_chunks(group, body, top_n, mode), group)
        (final,) = await _final_outputs(group, request)
        return await asyncio.to_thread(self._chat_response, body, group.request_id, final, top_n, mode)

    def _chat_response(
        self, body: ChatCompletionRequest, request_id: str, final: Any, top_n: int | None, mode: str | None
    ) -> Response:
        choices = [self._chat_choice(o, body, top_n, mode) for o in final.outputs]
        if echo := chat_echo_text(body):
            for choice in choices:
                choice.message.content = echo + (choice.message.content or "")
        response = ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=self._usage([final]),
            prompt_logprobs=self.logprobs.prompt(final.prompt_logprobs),
        )
        return JSONResponse(response.model_dump())

    def _chat_choice(
        self, o: Any, body: ChatCompletionRequest, top_n: int | None, mode: str | None
    ) -> ChatChoice:
        reasoning, text = self.reasoning.split(o.text) if self.reasoning else (None, o.text)
        content, calls = parse_tool_calls(text or "", body, mode)
        finish = "tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason
        return ChatChoice(
            index=o.index,
            message=AssistantMessage(
                content=content if text is not None else None, tool_calls=calls, reasoning_content=reasoning
            ),
            finish_reason=finish,
            stop_reason=o.stop_reason,
            logprobs=self.logprobs.chat(o.token_ids, o.logprobs, top_n),
        )

    def _completion_choice(self, body: CompletionRequest, i: int, final: Any, o: Any) -> CompletionChoice:
        text, logprobs = o.text, self.logprobs.completion(o.token_ids, o.logprobs, body.logprobs, 0)
        if body.echo:
            prompt_text = self._prompt_text(body, i, final)
            text = prompt_text + text
            if body.logprobs is not None:
                echoed = self.logprobs.completion(
                    final.prompt_token_ids, final.prompt_logprobs, body.logprobs, 0
                )
                logprobs = self.logprobs.concat(
                    echoed, self.logprobs.completion(o.token_ids, o.logprobs, body.logprobs, len(prompt_text))
                )
        prompt_logprobs = (
            self.logprobs.prompt(final.prompt_logprobs) if body.prompt_logprobs is not None else None
        )
        return CompletionChoice(
            index=i * body.n + o.index,
            text=text,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_text(self, body: CompletionRequest, i: int, output: Any) -> str:
        prompt = body.prompts()[i]
        if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(output.prompt_token_ids)  # token ids, or what truncation left

    # ---- validation ----------------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def _check_priority(self, body: SamplingFields | EmbeddingRequest) -> None:
        if body.priority != 0:  # vLLM refuses it too unless started with --scheduling-policy priority
            raise APIError(
                400,
                "priority scheduling is not enabled: this server schedules first come, first served "
                "(priority 0)",
                param="priority",
            )

    def _check_prompt_chars(self, num_chars: int, what: str, param: str) -> None:
        limit = self.limits.max_prompt_chars
        if num_chars > limit:
            raise APIError(
                400,
                f"{what} has {num_chars} characters, more than this server's limit of {limit} per prompt "
                f"(--max-prompt-chars)",
                param=param,
                code="prompt_too_long",
            )

    def _check_returned_prompt_tokens(self, prompts: list[list[int]], n: int, param: str) -> None:
        """Refuses a request whose response would carry back more prompt tokens (echo, prompt logprobs) than
        the limit: each prompt's tokens once per choice."""
        num_tokens = sum(len(ids) for ids in prompts) * n
        limit = self.limits.max_returned_prompt_tokens
        if num_tokens > limit:
            raise APIError(
                400,
                f"{param} would return {num_tokens} prompt tokens ({len(prompts)} prompts x n {n}), more "
                f"than this server's limit of {limit} per request (--max-returned-prompt-tokens)",
                param=param,
                code="response_too_large",
            )

    async def _prompts_ids(
        self,
        prompts: list[str | list[int]],
        add_special_tokens: bool,
        truncate_prompt_tokens: int | None,
        param: str = "prompt",
    ) -> list[list[int]]:
        """Every prompt's token ids, tokenized in a worker thread after the character limit is checked."""
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self._check_prompt_chars(len(prompt), f"{param} {i}", param)
        return await asyncio.to_thread(
            lambda: [
                self._prompt_ids(prompt, i, add_special_tokens, truncate_prompt_tokens)
                for i, prompt in enumerate(prompts)
            ]
        )

    def _prompt_ids(
        self,
        prompt: str | list[int],
        index: int,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[int]:
        ids = (
            self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if isinstance(prompt, str)
            else prompt
        )
        if truncate_prompt_tokens is not None:
            ids = ids[-truncate_prompt_tokens:]  # vLLM keeps the prompt's last tokens
        if not ids:
            raise APIError(400, f"prompt {index} is empty", param="prompt")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise APIError(
                400, f"prompt {index} has token ids outside [0, {self.vocab_size})", param="prompt"
            )
        return ids

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if max_tokens is None and num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room to generate",
                param=param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens is {max_tokens} "
                f"({num_prompt_tokens + max_tokens} in total)",
                param="max_tokens",
            )

    def _capped(self, max_tokens: int) -> int:
        """vLLM: a generation config's max_new_tokens caps every request's max_tokens."""
        return min(max_tokens, self.sampling_defaults.get("max_tokens", max_tokens))

    def _default(self, value: Any, name: str, fallback: Any) -> Any:
        """A request's sampling field, else the generation config's default, else vLLM's."""
        return value if value is not None else self.sampling_defaults.get(name, fallback)

    def _usage(self, finals: list[Any]) -> Usage:
        """Usage of finished outputs; with --enable-prompt-tokens-details, the prompt tokens the prefix cache
        supplied (vLLM: only when there were some)."""
        usage = _usage(finals)
        cached = sum(final.num_cached_tokens for final in finals)
        if self.prompt_tokens_details and cached:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        return usage

    def _sampling_params(
        self,
        body: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        structured = structured or structured_outputs_of(body)
        if structured is not None:
            try:
                require_xgrammar()
            except AscqError as exc:
                raise APIError(400, str(exc), code="structured_outputs_unavailable") from exc
        try:
            return SamplingParams(
                n=body.n,
                temperature=self._default(body.temperature, "temperature", 1.0),
                top_p=self._default(body.top_p, "top_p", 1.0),
                top_k=min(self._default(body.top_k, "top_k", 0) or 0, self.vocab_size),
                min_p=self._default(body.min_p, "min_p", 0.0) or 0.0,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=self._default(body.repetition_penalty, "repetition_penalty", 1.0),
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
                bad_words=body.bad_words,
                allowed_token_ids=body.allowed_token_ids,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                prompt_logprobs=body.prompt_logprobs,
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def _submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, cache_salt: str | None = None
    ) -> RequestGroup:
        try:
            return await self.engine.submit(request_id, prompts, params, cache_salt)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    # ---- streaming -----------------------------------------------------------------------------------------

    async def _completion_chunks(self, group: RequestGroup, body: CompletionRequest, request_id: str):
        include_usage, continuous = usage_options(body, self.force_include_usage)
        finals: dict[int, Any] = {}
        echoed: set[tuple[int, int]] = set()
        async for i, output, o, start in _deltas(group, finals):
            if body.echo and (i, o.index) not in echoed:  # the prompt goes first, once per choice
                echoed.add((i, o.index))
                yield await asyncio.to_thread(
                    self._echo_chunk, body, request_id, i * body.n + o.index, i, output, include_usage
                )
            chunk = CompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[
                    CompletionChoice(
                        index=i * body.n + o.index,
                        text=o.text[start[0] :],
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        logprobs=self.logprobs.completion(
                            o.token_ids[start[1] :], (o.logprobs or [])[start[1] :], body.logprobs, start[0]
                        ),
                    )
                ],
                usage=_running_usage(output, o) if continuous else None,
            )
            yield _sse(chunk, include_usage)
        if include_usage:
            usage = self._usage([finals[i] for i in sorted(finals)])
            yield _sse(CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage))

    def _echo_chunk(
        self, body: CompletionRequest, request_id: str, index: int, i: int, output: Any, include_usage: bool
    ) -> str:
        """A completions stream's echoed prompt (and its logprobs) for choice `index` of prompt `i`."""
        prompt_logprobs = self.logprobs.completion(
            output.prompt_token_ids, output.prompt_logprobs, body.logprobs, 0
        )
        choice = CompletionChoice(
            index=index, text=self._prompt_text(body, i, output), logprobs=prompt_logprobs
        )
        response = CompletionResponse(id=request_id, model=self.model_name, choices=[choice])
        return _sse(response, include_usage)

    def _chat_chunk_writer(self, group: RequestGroup, include_usage: bool):
        """A chat stream's chunk as an SSE event (usage left out unless the client asked for it)."""

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            response = ChatCompletionChunk(
                id=group.request_id, model=self.model_name, choices=choices, usage=usage
            )
            return _sse(response, include_usage)

        return chunk

    async def _chat_chunks(self, group: RequestGroup, body: ChatCompletionRequest, top_n: int | None):
        include_usage, continuous = usage_options(body, self.force_include_usage)

        chunk = self._chat_chunk_writer(group, include_usage)

        for opening in _opening_choices(body):
            yield chunk(opening)
        finals: dict[int, Any] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        async for _, output, o, start in _deltas(group, finals):
            logprobs = self.logprobs.chat(o.token_ids[start[1] :], (o.logprobs or [])[start[1] :], top_n)
            delta = DeltaMessage(content=o.text[start[0] :])
            if self.reasoning:
                stream = reasoning_streams.setdefault(o.index, ReasoningStream(self.reasoning))
                reasoning, content = stream.feed(o.text, o.finish_reason is not None)
                delta = DeltaMessage(content=content, reasoning_content=reasoning)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=o.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                    )
                ],
                _running_usage(output, o) if continuous else None,
            )
        if include_usage:
            yield chunk([], self._usage([finals[0]]))

    async def _chat_tool_chunks(
        self, group: RequestGroup, body: ChatCompletionRequest, top_n: int | None, mode: str
    ):
        """Tool calls streamed as vLLM streams them: content as it is decoded, each call's id and name
        first, then its arguments' JSON in pieces that concatenate to them (tool_call_stream.py)."""
        include_usage, continuous = usage_options(body, self.force_include_usage)
        streams: dict[int, ToolCallStream] = {}

        chunk = self._chat_chunk_writer(group, include_usage)

        for opening in _opening_choices(body):
            yield chunk(opening)
        finals: dict[int, Any] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        async for _, output, o, start in _deltas(group, finals):
            stream = streams.setdefault(o.index, tool_call_stream(body, mode))
            text, reasoning = o.text, None
            if self.reasoning:  # reasoning first; tool calls are parsed from the content after it
                thinking = reasoning_streams.setdefault(o.index, ReasoningStream(self.reasoning))
                reasoning, _ = thinking.feed(o.text, o.finish_reason is not None)
                text = thinking.content
            content, calls = stream.feed(text, o.finish_reason is not None)
            finish = "tool_calls" if stream.num_calls and o.finish_reason == "stop" else o.finish_reason
            logprobs = self.logprobs.chat(o.token_ids[start[1] :], (o.logprobs or [])[start[1] :], top_n)
            choice = ChatChunkChoice(
                index=o.index,
                delta=DeltaMessage(
                    content=content or None, tool_calls=calls or None, reasoning_content=reasoning
                ),
                logprobs=logprobs,
                finish_reason=finish,
            )
            yield chunk([choice], _running_usage(output, o) if continuous else None)
        if include_usage:
            yield chunk([], self._usage([finals[0]]))


def structured_outputs_of(body: SamplingFields) -> StructuredOutputsParams | None:
    """The one structured-output constraint of a request, from response_format, structured_outputs or
    guided_*."""
    found: dict[str, dict[str, Any]] = {}
    if body.response_format is not None and body.response_format.type != "text":
        if body.response_format.type == "json_object":
            found["response_format"] = {"json_object": True}
        else:
            found["response_format"] = {"json": body.response_format.json_schema.schema_}
    if body.structured_outputs is not None:
        found["structured_outputs"] = body.structured_outputs.model_dump(exclude_none=True, by_alias=True)
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(body, name) is not None:
            found[name] = {key: getattr(body, name)}
    if len(found) > 1:
        raise APIError(
            400, f"give one structured-output constraint, got {', '.join(found)}", param=list(found)[1]
        )
    if not found:
        return None
    name, fields = found.popitem()
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from exc


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding


def request_id_of(prefix: str, body: SamplingFields | EmbeddingRequest) -> str:
    """The response id: vLLM's `request_id` field when the client sends one, else a random one."""
    return f"{prefix}-{body.request_id}" if body.request_id else random_id(prefix)


class ScoredPromptGroup:
    """A request group whose completions are hidden (`max_tokens: 0` with `echo`: the engine generates one
    token that the client did not ask for; the prompt and its logprobs are the answer)."""

    def __init__(self, group: RequestGroup) -> None:
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    async def __aiter__(self):
        async for i, output in self.group:
            hidden = [
                dataclasses.replace(
                    o,
                    text="",
                    token_ids=[],
                    logprobs=[] if o.logprobs is not None else None,
                    cumulative_logprob=None,
                    finish_reason=o.finish_reason and "length",
                    stop_reason=None,
                )
                for o in output.outputs
            ]
            yield i, dataclasses.replace(output, outputs=hidden)


async def _deltas(group: RequestGroup, finals: dict[int, Any]):
    """(prompt index, output, completion, (chars, tokens) already sent) for each completion with new text,
    and once for each completion when it finishes (outputs are cumulative: with n > 1, a choice that finished
    early is in every later output too, and its finish must not be sent again)."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}
    finished: set[tuple[int, int]] = set()
    async for i, output in group:
        finals[i] = output
        for o in output.outputs:
            key = (i, o.index)
            if key in finished:
                continue
            start = sent.get(key, (0, 0))
            if len(o.text) > start[0] or o.finish_reason is not None:
                yield i, output, o, start
                sent[key] = (len(o.text), len(o.token_ids))
                if o.finish_reason is not None:
                    finished.add(key)


def _event_stream(chunks: Any, group: RequestGroup) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as exc:  # the engine failed or shut down mid-stream: tell the client in-band
            yield _sse_json(exc.to_json())
        finally:
            # a no-op when finished; frees the KV blocks when the client left or the task was cancelled
            group.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sse(response: Any, include_usage: bool = True) -> str:
    return f"data: {response.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"


def _sse_json(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _opening_choices(body: ChatCompletionRequest) -> list[list[ChatChunkChoice]]:
    """A chat stream's first chunks: the assistant role for each of the n choices, then, with `echo`, the
    echoed text for each choice in a chunk of its own (as vLLM streams them)."""
    n = body.n
    chunks = [[ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)]]
    if echo := chat_echo_text(body):
        chunks += [[ChatChunkChoice(index=i, delta=DeltaMessage(content=echo))] for i in range(n)]
    return chunks


def chat_echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content when that message has the reply's role (the assistant
    with add_generation_prompt, else the last message's own: the reply continues it); else nothing."""
    if not body.echo:
        return ""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    return last.text if last.role == role else ""


def usage_options(body: SamplingFields, force: bool = False) -> tuple[bool, bool]:
    """(usage in the last chunk, usage in every chunk): vLLM's stream_options include_usage and
    continuous_usage_stats (the second only with the first); `force`: --enable-force-include-usage."""
    options = body.stream_options
    include = force or bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


def _running_usage(output: Any, o: Any) -> Usage:
    """Usage so far of one completion: its prompt and the tokens generated up to this chunk."""
    num_prompt, num_completion = len(output.prompt_token_ids), len(o.token_ids)
    return Usage(
        prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion
    )


def _usage(finals: list[Any]) -> Usage:
    num_prompt = sum(len(final.prompt_token_ids) for final in finals)
    num_completion = sum(len(o.token_ids) for final in finals for o in final.outputs)
    return Usage(
        prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=num_prompt + num_completion
    )


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
