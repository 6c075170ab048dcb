"""How long `ascq serve` takes to fail on a port already in use (it must fail before torch or the model
loads).

python benchmarks/busy_port.py --model zoo/tiny-llama --rounds 5
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo/tiny-llama")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    seconds = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        command = [
            sys.executable,
            "-m",
            "ascq.cli",
            "serve",
            args.model,
            "--port",
            str(taken.getsockname()[1]),
        ]
        for _ in range(args.rounds):
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            seconds.append(time.perf_counter() - start)
            assert done.returncode == 1 and "in use" in done.stderr, done.stderr
        anchor = []  # the interpreter alone, same run: what any CLI start costs
        for _ in range(args.rounds):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            anchor.append(time.perf_counter() - start)
    print(
        f"busy port -> exit 1: min {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s "
        f"(bare python: min {min(anchor):.2f} s, median {statistics.median(anchor):.2f} s; {args.rounds} "
        f"rounds)"
    )


if __name__ == "__main__":
    main()
