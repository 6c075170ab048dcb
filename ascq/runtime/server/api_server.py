"""The OpenAI-compatible HTTP app: routes, body parsing, API-key check, error JSON.

Bodies are parsed by hand (size limit, strict UTF-8, JSON object, pydantic model) so that every kind of bad input
becomes OpenAI's error JSON with a 4xx, never a 500. Engine work goes through `AsyncEngine`.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
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

import ascq
from ascq.errors import AscqError
from ascq.runtime.server.async_engine import ENGINE_DEAD_MESSAGE, AsyncEngine
from ascq.runtime.server.chat_template import ChatPrompter
from ascq.runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ascq.runtime.server.serving import OpenAIServing

MAX_BODY_BYTES = 16 << 20
ModelT = TypeVar("ModelT", bound=BaseModel)


def create_app(engine: AsyncEngine, tokenizer: Any, prompter: ChatPrompter, model_name: str,
               max_model_len: int, vocab_size: int, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="ascq", version=ascq.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, tokenizer, prompter, model_name, max_model_len, vocab_size)
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
        return Response(status_code=200 if serving.engine.is_alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ascq.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await serving.chat_completions(body, request)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The request body as `model`, or an APIError: 413 too large, 400 not UTF-8 / not JSON / invalid fields."""
    declared = request.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes",
                               code="request_too_large")
    except ClientDisconnect as exc:
        raise APIError(499, "client disconnected while sending the request", code="client_disconnected") from exc
    try:
        data = json.loads(bytes(body).decode("utf-8"))
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates (\ud800) cannot reach the tokenizer
    except UnicodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from exc
    except RecursionError as exc:
        raise APIError(400, "request body JSON is nested too deeply") from exc
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part)) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _is_union_tag(loc_part: str | int) -> bool:
    """pydantic names the union member that failed in `loc` (`str`, `list[int]`); it is not a field."""
    return isinstance(loc_part, str) and (loc_part in ("str", "int", "float", "bool") or "[" in loc_part)


class ApiKeyMiddleware:
    """`/v1/*` needs `Authorization: Bearer KEY` when the server has a key; /health, /metrics stay open."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.expected and scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key")
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
ENGINE_DEAD_EXIT_S = 4.0  # engine process died: the server exits (code 1) within this, open connections or not
# longer than clients' keep-alive (httpx, the openai client: 5 s), so a client never reuses a connection the
# server is closing at the same moment (that race surfaces as a read error on a non-retryable POST)
KEEP_ALIVE_S = 20


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise AscqError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise AscqError("--api-key must not be empty")


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


def run_server(engine_args: Any, options: ServeOptions) -> None:
    """Start the engine process, serve until SIGTERM/SIGINT, drain, return (exit code 0); exit code 1 when the
    engine process dies."""
    from transformers import AutoTokenizer

    from ascq.runtime.engine_core import EngineCoreProcess
    from ascq.runtime.server.chat_template import load_chat_template
    from ascq.runtime.server.metrics import ServerMetrics

    template = load_chat_template(options.chat_template)
    model_name = options.served_model_name or engine_args.served_model_name or str(engine_args.model)
    core = EngineCoreProcess(engine_args)
    tokenizer = AutoTokenizer.from_pretrained(str(engine_args.tokenizer or engine_args.model))
    async_engine = AsyncEngine(core, ServerMetrics(model_name))
    app = create_app(async_engine, tokenizer, ChatPrompter(tokenizer, template), model_name,
                     core.info["max_model_len"], core.info["vocab_size"], options.api_key)
    uv_config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                               timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn re-raises the caught signal after its graceful shutdown; with these no-op handlers restored
    # first, a drained SIGTERM ends the process with exit code 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = _Server(uv_config, async_engine)
    server.exit_code = 0
    async_engine.on_engine_dead = server.engine_died
    try:
        server.run()
    finally:
        core.shutdown()
    if server.exit_code:
        sys.exit(server.exit_code)
