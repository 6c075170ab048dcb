"""OpenAI request/response shapes (pydantic) and OpenAI's error JSON, for completions and chat completions.

Requests are validated strictly (a string where a number belongs is a 400, as OpenAI does). No field is ever
silently ignored: an OpenAI field ascq does not implement that would change the output (`UNSUPPORTED_FIELDS`)
is a 400 naming it unless its value is a no-op; fields that change nothing here (`IGNORED_FIELDS`: metadata,
store, service tiers, ...) and fields neither OpenAI nor vLLM defines are accepted, as vLLM accepts them, with
one warning naming them. vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, bad_words, allowed_token_ids, prompt_logprobs, include_stop_str_in_output, skip_special_tokens,
structured_outputs, guided_json / guided_regex / guided_choice / guided_grammar) are accepted too.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger("ascq.serve")

VLLM_API_VERSION = "0.11.0"  # the vLLM release whose OpenAI server behaviour this one follows (GET /version)
MAX_N = 16
MAX_BATCH = 2048  # prompts in one /v1/completions request, OpenAI's limit
INT64_MAX = 2**63 - 1


class APIError(Exception):
    """An error returned to the client as OpenAI's error JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


# OpenAI request fields ascq does not implement -> (values that change nothing and are accepted, why not)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "insertion (suffix) is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "functions": ((), "the deprecated 'functions' API is not supported; use 'tools'"),
    "function_call": ((), "the deprecated 'function_call' API is not supported; use 'tool_choice'"),
    "moderation": ((), "moderation is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "use_beam_search": ((False,), "beam search is not implemented; sample several choices with n instead"),
}
# OpenAI fields that do not change what is generated here (stored completions, routing and tiering hints):
# accepted and named in one warning, as vLLM does
IGNORED_FIELDS = (
    "metadata",
    "store",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "verbosity",
)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        ignored = []
        for name, value in data.items():
            if name in known:
                continue
            if name in UNSUPPORTED_FIELDS:
                no_ops, reason = UNSUPPORTED_FIELDS[name]
                if value is None or any(value == v and type(value) is type(v) for v in no_ops):
                    continue
                raise UnsupportedFieldError(name, f"{name} is not supported by this server: {reason}")
            ignored.append(name)
        if ignored:
            logger.warning(
                "The following fields were present in the request but ignored: %s", sorted(ignored)
            )
        return {k: v for k, v in data.items() if k in known}


class UnsupportedFieldError(ValueError):
    """Raised inside validation; api_server turns it into a 400 with `param` set to the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, not only the last


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class SamplingFields(StrictModel):
    """Fields shared by completions and chat; ranges mirror OpenAI's documented limits."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX - MAX_N)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: completions with echo only (prompt scoring)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None  # at most --max-logprobs (the engine checks)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; it does not change the output
    # vLLM's: keep the prompt's last k tokens; the response id; prefix-cache isolation; scheduling priority
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: int = 0

    @model_validator(mode="after")
    def _stream_fields_match_stream(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedFieldError(
                "prompt_logprobs", "prompt_logprobs are not available when streaming (as in vLLM)"
            )
        if self.stream_options is not None and not self.stream:
            raise UnsupportedFieldError(
                "stream_options", "stream_options can only be given when stream is true (as in vLLM)"
            )
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return bias


# a prompt, or a batch of them (OpenAI's `prompt` / `input`): text, token ids, texts, lists of token ids
PromptInput = (
    str
    | Annotated[list[int], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)]
    | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_BATCH)]
)


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A `PromptInput` as a list of single prompts."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and other special tokens) on text prompts

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedFieldError("max_tokens", "max_tokens 0 needs echo true (scoring the prompt)")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError(
                "best_of",
                f"best_of {self.best_of} > n {self.n} is not supported (as in "
                "vLLM v1): every generated sequence is returned; use n",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def as_template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    # vLLM's chat fields: continue the last (assistant) message instead of starting a new one; special tokens
    # on top of the template's (vLLM's default: none); extra variables and documents for the template; the
    # reasoning effort a template may read
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: the reply starts with the last message's content when that message has the reply's role
    echo: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.max_tokens == 0:
            raise UnsupportedFieldError("max_tokens", "max_tokens must be at least 1")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedFieldError(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true (as in vLLM)",
            )
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
            t.function.name for t in self.tools or []
        }:
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, not in tools"
            )
        return self


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


class EmbeddingRequest(StrictModel):
    """OpenAI's /v1/embeddings as vLLM serves a decoder model: the last token's final hidden state,
    L2-normalized, per input."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's
    add_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI encodes it


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # --enable-prompt-tokens-details


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


# vLLM's shape: one entry per prompt token (the first is None), {token id: logprob} of the token and the top-n
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None  # --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str = ""  # this delta's piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # in a call's first delta
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # --reasoning-parser


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None


class EmbeddingResponse(ResponseBase):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
