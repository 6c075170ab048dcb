"""The OpenAI-compatible HTTP app: routes, body parsing, API-key check, error JSON.

Bodies are parsed by hand (size limit, strict UTF-8, JSON object, pydantic model) so that every kind of bad
input becomes OpenAI's error JSON with a 4xx, never a 500. Engine work goes through `AsyncEngine`.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import gc
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ascq.core.errors import AscqError
from ascq.core.version import __version__
from ascq.runtime.server.async_engine import ENGINE_DEAD_MESSAGE, AsyncEngine
from ascq.runtime.server.chat_template import ChatPrompter
from ascq.runtime.server.listen import bind_socket
from ascq.runtime.server.protocol import (
    VLLM_API_VERSION,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    UnsupportedFieldError,
)
from ascq.runtime.server.responses import chat_request_data, create_response
from ascq.runtime.server.serving import OpenAIServing, RequestLimits, longest_token_chars

MAX_BODY_BYTES = 16 << 20
LARGE_BODY_BYTES = 1 << 20  # bodies above this are decoded in a worker thread (decode_json)
DECODE_SLICE_BYTES = 1 << 20
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
logger = logging.getLogger("ascq.serve")
ModelT = TypeVar("ModelT", bound=BaseModel)


def create_app(
    engine: AsyncEngine,
    tokenizer: Any,
    prompter: ChatPrompter,
    model_names: list[str] | str,
    max_model_len: int,
    vocab_size: int,
    api_key: str | None = None,
    tool_options: Any = None,
    limits: RequestLimits | None = None,
    sampling_defaults: dict[str, Any] | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        # as vLLM's server does: what startup made (torch, the tokenizer, the app) moves out of the garbage
        # collector's reach, so a full collection scans only objects made since instead of stalling the
        # event loop (every stream, /health) for up to a second
        gc.collect()
        gc.freeze()
        yield
        engine.stop()

    root_path = getattr(tool_options, "root_path", None) or ""  # vLLM's --root-path: both /v1 and ROOT/v1
    app = FastAPI(
        title="ascq",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        root_path=root_path,
    )
    serving = OpenAIServing(
        engine,
        tokenizer,
        prompter,
        model_names,
        max_model_len,
        vocab_size,
        tool_options,
        limits,
        sampling_defaults,
    )
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(EngineDeadMiddleware, engine=engine)
    app.add_exception_handler(APIError, _api_error_response)
    app.add_exception_handler(StarletteHTTPException, _http_error_response)
    app.add_exception_handler(Exception, _internal_error_response)
    _add_routes(app, serving)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.get("/health")
    async def health() -> Response:
        engine = serving.engine
        if engine.is_stalled:
            logger.warning(
                "health check: the engine has made no progress for over %s s while requests wait (503)",
                engine.stall_timeout_s,
            )
        return Response(status_code=200 if engine.is_alive and not engine.is_stalled else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        # `version` is the vLLM API this server follows (clients compare it); ascq's own beside it
        return {
            "version": VLLM_API_VERSION,
            "vllm_api_version": VLLM_API_VERSION,
            "ascq_version": __version__,
        }

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return serving.tokenizer_info()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return Response(status_code=200 if serving.engine.is_alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return serving.model(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return await serving.tokenize(await parse_body(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        return await serving.detokenize(await parse_body(request, DetokenizeRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await serving.completions(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serving.embeddings(await parse_body(request, EmbeddingRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await serving.chat_completions(body, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        data = await read_json_object(request)
        body = validate_body(chat_request_data(data), ChatCompletionRequest)
        return await create_response(serving, body, request)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one route: routed by the body's shape, as vLLM does (messages: chat; prompt:
        completions)."""
        data = await read_json_object(request)
        if "messages" in data:
            return await serving.chat_completions(validate_body(data, ChatCompletionRequest), request)
        if "prompt" in data:
            return await serving.completions(validate_body(data, CompletionRequest), request)
        raise APIError(400, "/invocations needs a chat (messages) or completions (prompt) request body")


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request body as `model`, or an APIError: 413 too large, 400 not UTF-8 / not JSON / invalid
    fields."""
    return validate_body(await read_json_object(request), model)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or an APIError: 413 too large, 400 not UTF-8 / not JSON."""
    declared = request.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(
            413,
            f"request body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES} bytes",
            code="request_too_large",
        )
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(
                    413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes", code="request_too_large"
                )
    except ClientDisconnect as exc:
        raise APIError(
            499, "client disconnected while sending the request", code="client_disconnected"
        ) from exc
    try:
        data = (
            await asyncio.to_thread(decode_json, body) if len(body) > LARGE_BODY_BYTES else decode_json(body)
        )
    except UnicodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
        ) from exc
    except RecursionError as exc:
        raise APIError(400, "request body JSON is nested too deeply") from exc
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def decode_json(body: bytearray) -> Any:
    """Strict UTF-8, then JSON, without lone surrogates (\\ud800: they cannot reach the tokenizer). The text
    is decoded in slices: in a worker thread, the event loop gets its turns in between."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    parts = [
        decoder.decode(view[i : i + DECODE_SLICE_BYTES]) for i in range(0, len(body), DECODE_SLICE_BYTES)
    ]
    parts.append(decoder.decode(b"", final=True))
    data = json.loads("".join(parts))
    if b"\\ud" in body or b"\\uD" in body:  # only such an escape makes a surrogate: re-encode only then
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    return data


def validate_body(data: dict[str, Any], model: type[ModelT]) -> ModelT:
    """`data` as `model`, or a 400 APIError naming the first invalid field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        parts = [str(part) for part in first["loc"] if not _is_union_tag(part)]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedFieldError):
            parts.append(cause.field)
        param = ".".join(parts) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _is_union_tag(loc_part: str | int) -> bool:
    """pydantic names the union member that failed in `loc` (`str`, `list[int]`); it is not a field."""
    return isinstance(loc_part, str) and (loc_part in ("str", "int", "float", "bool") or "[" in loc_part)


PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations")


def route_path(scope: dict) -> str:
    """The request's path without the --root-path prefix, when it came with it (as the router matches)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """`/v1/*`, /tokenize and /detokenize need `Authorization: Bearer KEY` when the server has a key; /health,
    /ping, /version and /metrics stay open (probes and scrapers)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.expected and scope["type"] == "http" and route_path(scope).startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                )
                await _api_error_response(None, error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class EngineDeadMiddleware:
    """Once the engine process died, every route answers 503 (OpenAI error JSON) until the server exits."""

    def __init__(self, app: Any, engine: AsyncEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.engine.loop is not None and not self.engine.is_alive:
            error = APIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")
            await _api_error_response(None, error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _api_error_response(_: Request | None, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.to_json(), status_code=exc.status)


def _http_error_response(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return _api_error_response(None, APIError(exc.status_code, str(exc.detail), code=code))


def _internal_error_response(_: Request, exc: Exception) -> JSONResponse:
    return _api_error_response(None, APIError(500, f"internal server error ({type(exc).__name__})"))


# ---- process ---------------------------------------------------------------------------------------------

DRAIN_TIMEOUT_S = 5.0  # SIGTERM: running requests may finish for this long, then they fail
GRACEFUL_SHUTDOWN_S = DRAIN_TIMEOUT_S + 2.0
ENGINE_DEAD_EXIT_S = (
    4.0  # engine process died: the server exits (code 1) within this, open connections or not
)
# longer than clients' keep-alive (httpx, the openai client: 5 s), so a client never reuses a connection the
# server is closing at the same moment (that race surfaces as a read error on a non-retryable POST)
KEEP_ALIVE_S = 20


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | str | None = None  # the first is the one responses carry
    chat_template: str | None = None
    log_level: str = "info"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    stream_interval: int = 1
    # per-request limits (serving.RequestLimits; None: its defaults) and the /health stall check (0: off)
    max_prompt_chars: int | None = None
    max_returned_prompt_tokens: int | None = None
    engine_stall_timeout: float = 0.0
    access_log: bool = True
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    root_path: str | None = None
    generation_config: str = "auto"  # vLLM's: auto | vllm | a folder (engine/generation_config.py)
    override_generation_config: dict[str, Any] | str | None = None  # JSON text from the command line
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        from ascq.runtime.engine.generation_config import check_source, parse_override
        from ascq.runtime.server.reasoning import REASONING_PARSERS
        from ascq.runtime.server.tool_calls import TOOL_CALL_PARSERS

        if self.log_level not in UVICORN_LOG_LEVELS:
            raise AscqError(
                f"--uvicorn-log-level {self.log_level!r} is not one of {', '.join(UVICORN_LOG_LEVELS)}"
            )
        if self.root_path is not None and (
            not self.root_path.startswith("/") or self.root_path.endswith("/")
        ):
            raise AscqError(f"--root-path must start with '/' and not end with one, got {self.root_path!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise AscqError(
                f"--reasoning-parser {self.reasoning_parser!r} is not supported; supported: "
                f"{', '.join(REASONING_PARSERS)}"
            )
        check_source(self.generation_config)
        self.override_generation_config = parse_override(self.override_generation_config)

        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not all(n.strip() for n in self.served_model_name):
            raise AscqError("--served-model-name must not be empty")

        if not 0 <= self.port <= 65535:
            raise AscqError(f"--port must be in [0, 65535], got {self.port}")
        if self.stream_interval < 1:
            raise AscqError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        for flag, value in (
            ("--max-prompt-chars", self.max_prompt_chars),
            ("--max-returned-prompt-tokens", self.max_returned_prompt_tokens),
        ):
            if value is not None and value < 1:
                raise AscqError(f"{flag} must be at least 1, got {value}")
        if not self.engine_stall_timeout >= 0:  # NaN too
            raise AscqError(
                f"--engine-stall-timeout must be 0 (off) or more seconds, got {self.engine_stall_timeout}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise AscqError("--api-key must not be empty")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise AscqError(
                f"--tool-call-parser {self.tool_call_parser!r} is not supported; supported: "
                f"{', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise AscqError(
                "--enable-auto-tool-choice needs --tool-call-parser (supported: "
                f"{', '.join(TOOL_CALL_PARSERS)})"
            )


def check_kv_fits_one_sequence(engine: Any) -> None:
    """Refuse to serve when the KV cache cannot hold a single max_model_len sequence (vLLM's startup
    check)."""
    blocks = engine.block_manager
    num_tokens = blocks.num_blocks * blocks.block_size
    if num_tokens >= engine.max_model_len:
        return
    needed = blocks.blocks_needed(engine.max_model_len) * engine.block_bytes
    raise AscqError(
        f"the KV cache holds {num_tokens} tokens ({blocks.num_blocks} blocks of {blocks.block_size}), fewer "
        f"than one "
        f"max_model_len {engine.max_model_len} sequence needs: give --kv-cache-memory {needed} (or more), or "
        f"--max-model-len {num_tokens} (or less)"
    )


def describe_engine(engine: Any, model_name: str, options: ServeOptions) -> dict[str, Any]:
    """Runs in the engine process once the model is loaded: the startup check and what the server needs."""
    check_kv_fits_one_sequence(engine)
    return {
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "cache_config": {  # vllm:cache_config_info's labels
            "block_size": engine.block_manager.block_size,
            "num_gpu_blocks": engine.block_manager.num_blocks,
            "cache_dtype": engine.args.kv_cache_dtype,
            "enable_prefix_caching": engine.block_manager.enable_prefix_caching,
        },
        "startup_lines": startup_lines(engine, model_name, options),
    }


def startup_lines(engine: Any, model_name: str, options: ServeOptions) -> list[str]:
    args, blocks = engine.args, engine.block_manager
    schemes = sorted({group[1] for group in engine.quant_config.groups}) if engine.quant_config else ["dense"]
    kv_dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
    host = f"[{options.host}]" if ":" in options.host else options.host
    auth = (
        "on (Authorization: Bearer required on /v1/*, /tokenize, /detokenize)"
        if options.api_key
        else "off (no API key: anyone who can reach the port can use it)"
    )
    tool_calling = "named/required tool_choice only"
    if options.tool_call_parser:
        auto = "on" if options.enable_auto_tool_choice else "off"
        tool_calling = f"{options.tool_call_parser} parser, auto tool choice {auto}"
    return [
        f"model: {args.model} (served as '{model_name}')",
        f"dtype: {str(engine.dtype).removeprefix('torch.')}, scheme: {', '.join(schemes)}, device: "
        f"{args.device}",
        f"KV cache: {blocks.num_blocks} blocks x {blocks.block_size} tokens = "
        f"{blocks.num_blocks * blocks.block_size} "
        f"tokens ({blocks.num_blocks * engine.block_bytes / 2**20:.1f} MiB, {kv_dtype}), prefix caching "
        f"{'on' if blocks.enable_prefix_caching else 'off'}",
        f"max_model_len: {engine.max_model_len}, max_num_seqs: {args.max_num_seqs}",
        f"auth: {auth}",
        f"tool calling: {tool_calling}",
        f"URL: http://{host}:{options.port}/v1",
    ]


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM/SIGINT first stop the engine from taking new requests (drain)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine.begin_drain(DRAIN_TIMEOUT_S)
        super().handle_exit(sig, frame)

    def engine_died(self) -> None:
        """Let the error events reach open streams, shut down; a timer bounds it if connections hang."""
        self.exit_code = 1
        self.engine.loop.call_later(0.5, setattr, self, "should_exit", True)
        deadline = threading.Timer(ENGINE_DEAD_EXIT_S, os._exit, args=(1,))
        deadline.daemon = True
        deadline.start()


def run_server(engine_args: Any, options: ServeOptions, sock: socket.socket | None = None) -> None:
    """Start the engine process, serve until SIGTERM/SIGINT, drain, return (exit code 0); exit code 1 when the
    engine process dies. `sock`: the already bound listening socket (bind_socket), else it is bound here,
    still before the model loads."""
    from ascq.runtime.engine.engine_core import EngineCoreProcess
    from ascq.runtime.server.chat_template import load_chat_template
    from ascq.runtime.server.metrics import ServerMetrics
    from ascq.runtime.worker.loader import engine_tokenizer

    sock = sock or bind_socket(options.host, options.port)
    if not logger.handlers:  # uvicorn configures only its own loggers
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    template = load_chat_template(options.chat_template)
    model_names = options.served_model_name or [engine_args.served_model_name or str(engine_args.model)]
    model_name = model_names[0]
    options.port = sock.getsockname()[1]
    # the engine process checks the KV cache and describes itself (api_key: only whether there is one)
    described = dataclasses.replace(options, api_key="set" if options.api_key else None)
    core = EngineCoreProcess(
        engine_args, functools.partial(describe_engine, model_name=model_name, options=described)
    )
    for line in core.info["startup_lines"]:
        logger.info(line)
    from ascq.runtime.engine.generation_config import default_sampling_params

    sampling_defaults = default_sampling_params(
        engine_args.model, options.generation_config, options.override_generation_config
    )
    if sampling_defaults:  # vLLM warns the same way: requests that leave these unset get them
        logger.info(
            "default sampling parameters (--generation-config %s): %s",
            options.generation_config,
            sampling_defaults,
        )
    # the event loop's own tokenizer copy
    tokenizer = engine_tokenizer(engine_args)
    async_engine = AsyncEngine(
        core,
        tokenizer,
        ServerMetrics(model_name, core.info.get("cache_config")),
        stream_interval=options.stream_interval,
        stall_timeout_s=options.engine_stall_timeout,
    )
    limits = RequestLimits.for_model(
        core.info["max_model_len"],
        longest_token_chars(tokenizer),
        options.max_prompt_chars,
        options.max_returned_prompt_tokens,
    )
    logger.info(
        "limits per request: %d prompt characters, %d returned prompt tokens (echo, prompt_logprobs), "
        "%d body bytes; engine stall check: %s",
        limits.max_prompt_chars,
        limits.max_returned_prompt_tokens,
        MAX_BODY_BYTES,
        f"{options.engine_stall_timeout:g} s" if options.engine_stall_timeout else "off",
    )
    app = create_app(
        async_engine,
        tokenizer,
        ChatPrompter(tokenizer, template),
        model_names,
        core.info["max_model_len"],
        core.info["vocab_size"],
        options.api_key,
        tool_options=options,
        limits=limits,
        sampling_defaults=sampling_defaults,
    )
    uv_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        access_log=options.access_log,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    # uvicorn re-raises the caught signal after its graceful shutdown; with these no-op handlers restored
    # first, a drained SIGTERM ends the process with exit code 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = _Server(uv_config, async_engine)
    server.exit_code = 0
    async_engine.on_engine_dead = server.engine_died
    try:
        server.run(sockets=[sock])
    finally:
        core.shutdown()
    if server.exit_code:  # the engine died: exit now (module teardown with torch loaded takes seconds)
        logger.error("exiting with code %d: the engine process died", server.exit_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
