"""Runs an `LLMEngine` in its own thread and lets asyncio code submit requests and stream their outputs.

Every engine call happens on the engine thread (the engine is not thread-safe): the event loop sends commands
through a queue and wakes the thread; the thread steps the engine and hands each request's outputs to that
request's asyncio queue with `loop.call_soon_threadsafe`. Draining (SIGTERM) lets running requests finish until a
deadline and then fails the rest, so shutdown time is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ascq.runtime.server.metrics import ServerMetrics
from ascq.runtime.server.protocol import APIError

logger = logging.getLogger("ascq.serve")
IDLE_WAIT_S = 0.5


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one request: where its outputs go and its latency clock."""

    out: asyncio.Queue
    arrival: float
    last_token_time: float | None = None
    num_tokens: int = 0
    done: bool = False


@dataclass
class RequestGroup:
    """The asyncio side of the engine requests of one HTTP request (one per prompt), sharing one queue."""

    engine: AsyncEngine
    request_ids: list[str] = field(default_factory=list)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        """Yields (prompt index, cumulative RequestOutput) until every request finished."""
        while self.unfinished:
            for item in await self._latest():
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield self.request_ids.index(item.request_id), item

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
    def __init__(self, engine: Any, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping = False
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ascq-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_draining(self) -> bool:
        return self._drain_deadline is not None

    async def submit(self, request_id: str, prompts: list[str | list[int]], params: Any) -> RequestGroup:
        """Submit one engine request per prompt; raises ValueError (a prompt does not fit, bad params) or
        APIError (draining / engine dead). Abort the group (or iterate it to the end) when done."""
        if self.is_draining or not self.is_alive:
            raise APIError(503, "the server is shutting down" if self.is_draining else "the engine is not running")
        group = RequestGroup(self)
        admitted = []
        for i, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            group.request_ids.append(sub_id)
            group.unfinished.add(sub_id)
            admitted.append(self.loop.create_future())
            self._send(("add", sub_id, prompt, params, group.out, admitted[-1]))
        try:
            await asyncio.wait(admitted)
            for future in admitted:
                future.result()  # the engine's ValueError for a prompt that cannot fit
        except BaseException:  # includes the client leaving while the engine admits the requests
            group.abort()
            raise
        return group

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def begin_drain(self, timeout_s: float) -> None:
        """Stop accepting requests; running ones may finish within timeout_s, then they fail. Thread-safe."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout_s
            self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception:  # an engine bug must not kill the server: fail what was in flight, keep serving
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(APIError(500, "internal engine error", code="engine_error"))
        self._fail_all(APIError(503, "the server shut down before this request finished"))

    def _iterate(self) -> None:
        self._wake.clear()
        self._apply_commands()
        if self._drain_deadline is not None and time.monotonic() > self._drain_deadline and self._tracked:
            self._fail_all(APIError(503, "the server shut down before this request finished"))
        if not self.engine.has_unfinished_requests():
            self._wake.wait(IDLE_WAIT_S)
            return
        self._dispatch(self.engine.step())
        self.metrics.update_from_stats(self.engine.get_stats())

    def _apply_commands(self) -> None:
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            changed = True
            if command[0] == "add":
                self._add(*command[1:])
            elif command[1] in self._tracked:
                self._tracked.pop(command[1])
                self.engine.abort_request(command[1])
                self.metrics.observe_finished("abort")
        if changed:
            self.metrics.update_from_stats(self.engine.get_stats())

    def _add(self, request_id: str, prompt: str | list[int], params: Any, out: asyncio.Queue,
             accepted: asyncio.Future) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # ValueError: the request cannot be served (a 400); anything else is ours
            if not isinstance(exc, ValueError):
                logger.exception("engine.add_request failed")
                exc = APIError(500, "internal engine error", code="engine_error")
            self.loop.call_soon_threadsafe(_settle, accepted, exc)
            return
        self._tracked[request_id] = _Tracked(out, arrival=time.monotonic())
        self.loop.call_soon_threadsafe(_settle, accepted, None)

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            self._observe_latency(tracked, output, now)
            deliveries.append((tracked.out, output))
            if output.finished:
                del self._tracked[output.request_id]
                self.metrics.e2e.observe(now - tracked.arrival)
                reasons = {o.finish_reason for o in output.outputs}
                self.metrics.observe_finished("stop" if "stop" in reasons else (reasons.pop() or "unknown"))
        if deliveries:  # one wake-up of the event loop per step, not one per request
            self.loop.call_soon_threadsafe(_deliver, deliveries)

    def _observe_latency(self, tracked: _Tracked, output: Any, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        num_new = num_tokens - tracked.num_tokens
        if num_new <= 0:
            return
        if tracked.last_token_time is None:
            self.metrics.ttft.observe(now - tracked.arrival)
            num_new, gap = num_new - 1, 0.0
        else:  # several tokens in one step share the step's time
            gap = (now - tracked.last_token_time) / num_new
        for _ in range(num_new):
            self.metrics.itl.observe(gap)
        tracked.last_token_time = now
        tracked.num_tokens = num_tokens

    def _fail_all(self, error: APIError) -> None:
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("engine.abort_request failed")
            self.metrics.observe_finished("abort")
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(tracked.out.put_nowait, error)
        self._tracked.clear()


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for out, output in deliveries:
        out.put_nowait(output)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
