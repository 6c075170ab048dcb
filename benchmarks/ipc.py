"""Engine-core transport: one step's outputs (32 requests, one new token each) sent to the serving process and
an acknowledgement back, over a multiprocessing Pipe vs ZeroMQ (pyzmq, ipc://, pickled frames). Rounds
alternate.

    python benchmarks/ipc.py --rounds 5 --messages 2000
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import tempfile
import time

from ascq.runtime.engine.engine_core import CompletionDelta, OutputDelta


def step_message(num_requests: int) -> tuple:
    deltas = [
        OutputDelta(f"cmpl-{i:024x}", False, 0, [CompletionDelta(0, [1234], None, None, None)])
        for i in range(num_requests)
    ]
    stats = {
        "num_running": num_requests,
        "num_waiting": 0,
        "num_free_blocks": 100,
        "num_total_blocks": 512,
        "kv_cache_usage": 0.8,
        "num_preemptions": 0,
        "num_prompt_tokens": 4096,
        "num_generation_tokens": 2048,
        "num_cached_prompt_tokens": 0,
        "num_computed_tokens": 6144,
    }
    return ("outputs", deltas, stats)


def pipe_echo(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(len(message[1]))


def zmq_echo(address: str) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.PAIR)
    socket.connect(address)
    while (message := pickle.loads(socket.recv())) is not None:
        socket.send(pickle.dumps(len(message[1])))


def time_pipe(context, message: tuple, count: int) -> float:
    parent, child = context.Pipe()
    process = context.Process(target=pipe_echo, args=(child,))
    process.start()
    parent.send(message), parent.recv()
    start = time.perf_counter()
    for _ in range(count):
        parent.send(message)
        parent.recv()
    elapsed = time.perf_counter() - start
    parent.send(None)
    process.join()
    return elapsed / count


def time_zmq(context, message: tuple, count: int) -> float:
    import zmq

    address = f"ipc://{tempfile.mkdtemp()}/engine.sock"
    socket = zmq.Context().socket(zmq.PAIR)
    socket.bind(address)
    process = context.Process(target=zmq_echo, args=(address,))
    process.start()
    socket.send(pickle.dumps(message)), socket.recv()
    start = time.perf_counter()
    for _ in range(count):
        socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(socket.recv())
    elapsed = time.perf_counter() - start
    socket.send(pickle.dumps(None))
    process.join()
    return elapsed / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    message = step_message(args.requests)
    print(f"message: {len(pickle.dumps(message))} bytes pickled")
    results: dict[str, list[float]] = {"pipe": [], "zmq": []}
    for _ in range(args.rounds):
        results["pipe"].append(time_pipe(context, message, args.messages))
        results["zmq"].append(time_zmq(context, message, args.messages))
    for name, values in results.items():
        us = sorted(v * 1e6 for v in values)
        print(f"{name:>5}: round trip min {us[0]:.1f} us, median {statistics.median(us):.1f} us")


if __name__ == "__main__":
    main()
