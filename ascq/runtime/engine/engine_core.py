"""The engine core in its own process (vLLM v1's EngineCoreProc): scheduler, model executor and sampler.

The serving process talks to it over one duplex `multiprocessing` pipe of pickled tuples (measured against
ZeroMQ in benchmarks/ipc.py; docs/benchmarks.md "Serving" has the numbers):

    to the core:   ("add", request_id, prompt_token_ids, params) | ("abort", request_id)
                   | ("finish", request_id, index, stop_string) | ("shutdown",)
    from the core: ("ready", info) | ("failed", message) | ("added", request_id, error | None)
                   | ("outputs", [OutputDelta], stats) | ("step_error", message)

Outputs cross as token-id deltas (the tokens since the last step), so a message's size does not grow with the
output length. The core does not detokenise: the serving process's `OutputProcessor` (output_processor.py)
turns the deltas into vLLM's cumulative `RequestOutput` with text, checks stop strings, and sends "finish" for
a sequence a stop string ended. The core exits when the serving process dies (it watches its parent), so it is
never left behind.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ascq.runtime.engine.outputs import RequestOutput

logger = logging.getLogger("ascq.engine_core")
IDLE_POLL_S = 0.5


@dataclass
class CompletionDelta:
    index: int
    token_ids: list[int]  # new since the last delta
    logprobs: list[dict[int, float]] | None  # one per new token
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class OutputDelta:
    request_id: str
    finished: bool
    num_cached_tokens: int
    completions: list[CompletionDelta]
    # sent once, with the first delta that has them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_scheduled_time: float | None = None  # time.monotonic(): comparable across the server's processes
    prompt_embedding: list[float] | None = None  # sent once, like prompt_logprobs


class DeltaEncoder:
    """Core side: cumulative `RequestOutput`s -> the tokens not sent yet."""

    def __init__(self) -> None:
        self.sent: dict[
            str, dict[int, int]
        ] = {}  # request id -> index -> number of tokens sent (-1: prompt logprobs, -2: prompt embedding)

    def encode(self, output: RequestOutput) -> OutputDelta:
        sent = self.sent.setdefault(output.request_id, {})
        completions = []
        for o in output.outputs:
            num_tokens = sent.get(o.index, 0)
            completions.append(
                CompletionDelta(
                    o.index,
                    o.token_ids[num_tokens:],
                    None if o.logprobs is None else o.logprobs[num_tokens:],
                    o.finish_reason,
                    o.stop_reason,
                )
            )
            sent[o.index] = len(o.token_ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and -1 not in sent:
            prompt_logprobs = output.prompt_logprobs
            sent[-1] = 0
        prompt_embedding = None
        if output.prompt_embedding is not None and -2 not in sent:
            prompt_embedding = output.prompt_embedding
            sent[-2] = 0
        if output.finished:
            del self.sent[output.request_id]
        return OutputDelta(
            output.request_id,
            output.finished,
            output.num_cached_tokens,
            completions,
            prompt_logprobs,
            output.first_scheduled_time,
            prompt_embedding,
        )


# ---- the core process ------------------------------------------------------------------------------------


def run_engine_core(
    engine_args: Any,
    conn: Connection,
    parent_pid: int,
    describe: Callable[[Any], dict[str, Any]] | None = None,
) -> None:
    """Process entry point: build the engine, report ready with `describe(engine)` (or the one-line reason it
    could not: `describe` may raise AscqError too), serve."""
    from ascq.core.errors import AscqError
    from ascq.runtime.distributed.process_watch import exit_with_parent

    exit_with_parent(parent_pid)
    # Ctrl-C reaches the whole group; the server drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ascq.runtime.engine.llm_engine import LLMEngine

    engine = None
    try:
        engine = LLMEngine(engine_args, detokenize=False)
        info = describe(engine) if describe is not None else {}
    except (AscqError, ValueError, OSError) as exc:
        conn.send(("failed", str(exc)))
        if engine is not None:
            engine.shutdown()
        raise SystemExit(1) from None
    conn.send(
        (
            "ready",
            {
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size,
                "eos_token_ids": sorted(engine.eos_token_ids),
                **info,
            },
        )
    )
    try:
        EngineCore(engine, conn).run()
    finally:
        engine.shutdown()


class EngineCore:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.encoder = DeltaEncoder()
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished_requests()
            if self.conn.poll(0 if busy else IDLE_POLL_S):
                self._apply_commands()
                continue
            if busy:
                self._step()

    def _apply_commands(self) -> None:
        while self.running and self.conn.poll(0):
            try:
                command = self.conn.recv()
            except EOFError:  # the serving process is gone
                self.running = False
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "finish":
                self.engine.finish_sequence(*command[1:])
            elif kind == "shutdown":
                self.running = False

    def _add(self, request_id: str, prompt: Any, params: Any) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:
            self.conn.send(("added", request_id, str(exc)))
        else:
            self.conn.send(("added", request_id, None))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # an engine bug must not kill the server: fail what was in flight, keep serving
            logger.exception("engine step failed; failing the requests in flight")
            dead = self.engine.dead_ranks()
            if dead:  # ... unless a rank is gone: no step can run again, so this process stops
                self.conn.send(("dead", f"the engine stopped: {dead}"))
                self.running = False
                return
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
            self.engine.step()  # drops the aborts' outputs
            self.encoder.sent.clear()
            self.conn.send(("step_error", "internal engine error"))
            return
        deltas = [self.encoder.encode(o) for o in outputs]
        self.conn.send(("outputs", deltas, self.engine.get_stats()))


class EngineCoreProcess:
    """Serving-process handle: starts the core (`python -m ascq.runtime.engine.core_main`, its arguments
    pickled on stdin, the duplex pipe one end of a socketpair it inherits), waits until it is ready, sends and
    receives messages."""

    def __init__(
        self,
        engine_args: Any,
        describe: Callable[[Any], dict[str, Any]] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        import os

        from ascq.core.errors import AscqError
        from ascq.runtime.distributed.module_process import ModuleProcess

        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        try:
            self.process = ModuleProcess(
                "ascq-engine-core",
                "ascq.runtime.engine.core_main",
                (engine_args, theirs.fileno(), os.getpid(), describe),
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        deadline = time.monotonic() + startup_timeout_s
        while not self.conn.poll(0.2):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.kill()
                raise AscqError(
                    f"the engine process exited while loading the model (exit code {self.process.exitcode})"
                )
        try:
            message = self.conn.recv()
        except EOFError:
            self.kill()
            raise AscqError("the engine process exited while loading the model") from None
        if message[0] == "failed":
            self.process.join(10)
            self.kill()
            raise AscqError(message[1])
        self.info: dict[str, Any] = message[1]

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        try:
            self.conn.send(("shutdown",))
        except (OSError, ValueError):  # already gone
            pass
        self.process.join(timeout_s)
        self.kill()
        self.conn.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
