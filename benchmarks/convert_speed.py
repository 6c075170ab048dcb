"""Wall time of the same `ascq convert` command under two source trees (anchor first), alternating, several
rounds.

    git archive OLD | tar -x -C /tmp/before; git archive HEAD | tar -x -C /tmp/after
    OMP_NUM_THREADS=2 python benchmarks/convert_speed.py --trees /tmp/before /tmp/after --rounds 3 -- \
        zoo/smollm2-135m-instruct --recipe w8a8 --num-samples 16 --seq-len 512 --max-eval-tokens 256

Each run is its own process (`python -m ascq.cli convert ... --out TMP --overwrite`, PYTHONPATH = the tree),
so imports and peak RSS are its own. Reports min / median wall and CPU (user + system) seconds per tree and
the candidate / anchor ratios; on a shared machine the CPU seconds are the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(tree: Path, convert_args: list[str], out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one convert process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "ascq.cli", "convert", *convert_args, "--out", str(out), "--overwrite"]
    cpu, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, type=Path, required=True, metavar=("ANCHOR", "CANDIDATE"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument(
        "convert_args", nargs=argparse.REMAINDER, help="after --: the model and convert options"
    )
    args = parser.parse_args()
    convert_args = [a for a in args.convert_args if a != "--"]
    convert_args[0] = (
        str(Path(convert_args[0]).resolve()) if Path(convert_args[0]).exists() else convert_args[0]
    )
    times: dict[str, dict[str, list[float]]] = {str(t): {"wall": [], "cpu": []} for t in args.trees}
    with tempfile.TemporaryDirectory(prefix="ascq-convert-speed-") as tmp:
        for round_index in range(args.rounds):
            for tree in args.trees:
                wall, cpu = run_once(tree.resolve(), convert_args, Path(tmp) / "out")
                times[str(tree)]["wall"].append(wall)
                times[str(tree)]["cpu"].append(cpu)
                print(f"round {round_index + 1} {tree}: wall {wall:.1f} s, cpu {cpu:.1f} s", flush=True)
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}; convert {' '.join(convert_args)}")
    for tree, kinds in times.items():
        print(
            tree
            + ": "
            + ", ".join(
                f"{k} min {min(v):.1f} s median {statistics.median(v):.1f} s" for k, v in kinds.items()
            )
        )
    anchor, candidate = (times[str(t)] for t in args.trees)
    for kind in ("wall", "cpu"):
        print(
            f"candidate/anchor {kind}: min {min(candidate[kind]) / min(anchor[kind]):.3f}, "
            f"median {statistics.median(candidate[kind]) / statistics.median(anchor[kind]):.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"convert_args": convert_args, "times": times}, indent=1))


if __name__ == "__main__":
    main()
