"""Lets asyncio code submit requests to the engine core process (engine_core.py) and stream their outputs.

The event loop owns all bookkeeping, including detokenisation (`OutputProcessor`: the core sends token ids);
two threads move pickled messages: a writer (so a full pipe never blocks the event loop) and a reader that
hands each message to the loop with `call_soon_threadsafe`. Draining (SIGTERM) lets running requests finish
until a deadline and then fails the rest, so shutdown time is bounded. If the engine process dies, every open
request fails with a 503, new ones get 503, and `on_engine_dead` tells the server to exit non-zero (so a
supervisor restarts it).

`stall_timeout_s` (`--engine-stall-timeout`; 0: off): `is_stalled` says the engine has sent nothing for that
long while requests wait on it (a stopped or wedged engine process), and /health answers 503.

`stream_interval` (vLLM's `--stream-interval`): a request's output reaches its stream only at its first token,
every `stream_interval` tokens after that, and when it finishes. Outputs are cumulative, so nothing is lost;
fewer SSE events cost the server and the client less CPU per token (docs/benchmarks.md "Serving").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ascq.runtime.engine.engine_core import EngineCoreProcess
from ascq.runtime.engine.output_processor import OutputProcessor
from ascq.runtime.server.metrics import ServerMetrics
from ascq.runtime.server.protocol import APIError

logger = logging.getLogger("ascq.serve")
ENGINE_DEAD_MESSAGE = "the engine process died; the server is restarting"


@dataclass
class _Tracked:
    """Bookkeeping for one engine request: where its outputs go and its latency clock."""

    out: asyncio.Queue
    arrival: float
    first_scheduled: float | None = None  # from the core (time.monotonic() is system-wide)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    num_streamed_tokens: int | None = None  # tokens in the last output handed to the stream; None: none yet


@dataclass
class RequestGroup:
    """The asyncio side of the engine requests of one HTTP request (one per prompt), sharing one queue.

    `request_id` is the id the client sees (its own `request_id`, echoed); the engine requests have ids of
    their own, `{request_id}-{prompt index}-{serial}` with a serial unique in this server (vLLM's approach),
    so a client that reuses or guesses another request's id can never reach or disturb that request."""

    engine: AsyncEngine
    request_id: str
    request_ids: list[str] = field(default_factory=list)  # the engine ids, in prompt order
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    _prompt_index: dict[str, int] = field(default_factory=dict)

    def add(self, engine_id: str) -> None:
        self._prompt_index[engine_id] = len(self.request_ids)
        self.request_ids.append(engine_id)
        self.unfinished.add(engine_id)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        """Yields (prompt index, cumulative RequestOutput) until every request finished."""
        while self.unfinished:
            for item in await self._latest():
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield self._prompt_index[item.request_id], item

    async def _latest(self) -> list[Any]:
        """The next outputs, only the newest per request: outputs are cumulative, so a reader that fell behind
        skips the intermediate ones instead of piling them up."""
        items = [await self.out.get()]
        while not self.out.empty():
            items.append(self.out.get_nowait())
        latest: dict[str, Any] = {}
        for item in items:
            if isinstance(item, BaseException):
                self.abort()
                raise item
            latest[item.request_id] = item
        return list(latest.values())

    def abort(self) -> None:
        for request_id in self.unfinished:
            self.engine.abort(request_id)
        self.unfinished.clear()


class AsyncEngine:
    def __init__(
        self,
        core: EngineCoreProcess,
        tokenizer: Any,
        metrics: ServerMetrics,
        on_engine_dead: Callable[[], None] | None = None,
        stream_interval: int = 1,
        stall_timeout_s: float = 0.0,
    ) -> None:
        self.core = core
        self.stream_interval = stream_interval
        self.stall_timeout_s = stall_timeout_s
        self._last_progress = time.monotonic()  # the last message from the core, or the first request since
        self.metrics = metrics
        self.on_engine_dead = on_engine_dead
        self.loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._serials = itertools.count()  # makes every engine request id unique (RequestGroup)
        self._admitting: dict[str, asyncio.Future] = {}
        self._processor = OutputProcessor(tokenizer, set(core.info["eos_token_ids"]))
        self._stopping = False
        self._dead = False
        self._drain_deadline: float | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="ascq-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="ascq-engine-writer", daemon=True).start()

    @property
    def is_alive(self) -> bool:
        return not self._dead and self.core.is_alive()

    @property
    def is_stalled(self) -> bool:
        """Requests wait on the engine, and it has sent nothing for stall_timeout_s (when that is set)."""
        busy = bool(self._tracked or self._admitting)
        idle_s = time.monotonic() - self._last_progress
        return busy and self.stall_timeout_s > 0 and idle_s > self.stall_timeout_s

    @property
    def is_draining(self) -> bool:
        return self._drain_deadline is not None

    async def submit(
        self, request_id: str, prompts: list[str | list[int]], params: Any, cache_salt: str | None = None
    ) -> RequestGroup:
        """Submit one engine request per prompt under `request_id` (the client's; any string, duplicates
        welcome); raises ValueError (a prompt does not fit, bad params) or APIError (draining / engine dead).
        Abort the group (or iterate it to the end) when done."""
        if self.is_draining or not self.is_alive:
            raise APIError(503, "the server is shutting down" if self.is_draining else ENGINE_DEAD_MESSAGE)
        group = RequestGroup(self, request_id)
        admitted = []
        now = time.monotonic()
        if not self._tracked and not self._admitting:  # an idle engine sends nothing: its clock starts now
            self._last_progress = now
        for i, prompt in enumerate(prompts):
            sub_id = f"{request_id}-{i}-{next(self._serials)}"
            group.add(sub_id)
            self._tracked[sub_id] = _Tracked(group.out, arrival=now)
            token_ids = self._processor.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._processor.add(sub_id, prompt if isinstance(prompt, str) else None, token_ids, params)
            admitted.append(self.loop.create_future())
            self._admitting[sub_id] = admitted[-1]
            prompt_in = (
                token_ids if cache_salt is None else {"prompt_token_ids": token_ids, "cache_salt": cache_salt}
            )
            self._outbox.put(("add", sub_id, prompt_in, params))
        try:
            await asyncio.wait(admitted)
            for future in admitted:
                future.result()  # the engine's ValueError for a prompt that cannot fit
        except BaseException:  # includes the client leaving while the engine admits the requests
            group.abort()
            raise
        return group

    def abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is None:
            return
        self._processor.forget(request_id)
        self._admitting.pop(request_id, None)
        self.metrics.observe_finished("abort")
        self._outbox.put(("abort", request_id))

    def begin_drain(self, timeout_s: float) -> None:
        """Stop accepting requests; running ones may finish within timeout_s, then they fail. Thread-safe."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
            if self.loop is not None:
                self.loop.call_soon_threadsafe(
                    self.loop.call_later,
                    timeout_s,
                    self._fail_all,
                    APIError(503, "the server shut down before this request finished"),
                )

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._fail_all(APIError(503, "the server shut down before this request finished"))
        self._outbox.put(None)
        self.core.shutdown(timeout_s)

    # ---- message threads ---------------------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.core.send(message)
            except (OSError, ValueError):  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        while True:
            try:
                message = self.core.conn.recv()
            except (EOFError, OSError):
                break
            self.loop.call_soon_threadsafe(self._handle, message)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._engine_gone)

    # ---- event loop: messages from the core --------------------------------------------------------------

    def _handle(self, message: tuple) -> None:
        self._last_progress = time.monotonic()
        kind = message[0]
        if kind == "outputs":
            self._dispatch(message[1])
            self.metrics.update_from_stats(message[2])
        elif kind == "added":
            request_id, error = message[1], message[2]
            future = self._admitting.pop(request_id, None)
            if error is not None:
                self._tracked.pop(request_id, None)
                self._processor.forget(request_id)
            if future is not None and not future.done():
                future.set_result(None) if error is None else future.set_exception(ValueError(error))
        elif kind == "step_error":
            self._fail_all(APIError(500, "internal engine error", code="engine_error"))
        elif kind == "dead":  # the core exits next: the reader's end of stream fails every request
            logger.error("%s", message[1])

    def _dispatch(self, deltas: list[Any]) -> None:
        now = time.monotonic()
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            if tracked.first_scheduled is None and delta.first_scheduled_time is not None:
                tracked.first_scheduled = delta.first_scheduled_time
                self.metrics.queue_time.observe(max(0.0, tracked.first_scheduled - tracked.arrival))
            output, stopped = self._processor.process(delta)
            for index, stop_string in stopped:  # a stop string ended it here: the core stops generating it
                self._outbox.put(("finish", delta.request_id, index, stop_string))
            self._observe_latency(tracked, output, now)
            if self._due(tracked, output):
                tracked.num_streamed_tokens = tracked.num_tokens
                tracked.out.put_nowait(output)
            if output.finished:
                del self._tracked[output.request_id]
                self.metrics.e2e.observe(now - tracked.arrival)
                self._observe_phases(tracked, now)
                reasons = {o.finish_reason for o in output.outputs}
                self.metrics.observe_finished("stop" if "stop" in reasons else (reasons.pop() or "unknown"))

    def _due(self, tracked: _Tracked, output: Any) -> bool:
        """Whether this output goes to the stream now (see `stream_interval` above)."""
        if output.finished or tracked.num_streamed_tokens is None:
            return True
        return tracked.num_tokens - tracked.num_streamed_tokens >= self.stream_interval

    def _observe_phases(self, tracked: _Tracked, now: float) -> None:
        """vLLM's per-request phase histograms, once the request finished."""
        if tracked.first_scheduled is not None:
            self.metrics.inference_time.observe(max(0.0, now - tracked.first_scheduled))
            if tracked.first_token_time is not None:
                self.metrics.prefill_time.observe(
                    max(0.0, tracked.first_token_time - tracked.first_scheduled)
                )
        if tracked.first_token_time is not None:
            decode = now - tracked.first_token_time
            self.metrics.decode_time.observe(decode)
            if tracked.num_tokens > 1:
                self.metrics.request_tpot.observe(decode / (tracked.num_tokens - 1))

    def _observe_latency(self, tracked: _Tracked, output: Any, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        num_new = num_tokens - tracked.num_tokens
        if num_new <= 0:
            return
        if tracked.last_token_time is None:
            self.metrics.ttft.observe(now - tracked.arrival)
            tracked.first_token_time = now
            num_new, gap = num_new - 1, 0.0
        else:  # several tokens in one step share the step's time
            gap = (now - tracked.last_token_time) / num_new
        for _ in range(num_new):
            self.metrics.itl.observe(gap)
            self.metrics.tpot.observe(gap)
        tracked.last_token_time = now
        tracked.num_tokens = num_tokens

    def _engine_gone(self) -> None:
        if self._stopping:
            return
        self._dead = True
        logger.error(
            "the engine process died (exit code %s); failing every request and exiting",
            self.core.exitcode,
        )
        self._fail_all(APIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead"))
        if self.on_engine_dead is not None:
            self.on_engine_dead()

    def _fail_all(self, error: APIError) -> None:
        admitting, self._admitting = self._admitting, {}
        for future in admitting.values():
            if not future.done():
                future.set_exception(error)
        for request_id, tracked in list(self._tracked.items()):
            self.abort(request_id)
            tracked.out.put_nowait(error)
