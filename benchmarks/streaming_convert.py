"""Peak RSS of `ascq convert` against checkpoint size, on a synthetic deepseek-moe-16b-shaped checkpoint.

    python benchmarks/streaming_convert.py --num-layers 2 4   # each: build the checkpoint, convert, report
    python benchmarks/streaming_convert.py --num-layers 28 --recipe w8a8 --workdir /big/disk

The checkpoint has deepseek-ai/deepseek-moe-16b-base's tensor names and shapes (hidden 2048, 64 routed experts
x 1408 + 2 shared, top-6, vocab 102400; config from `ascq.zoo.deepseek_moe_16b`) with random bf16 weights,
written shard by shard. Each convert runs in its own process (`ascq convert`), so the peak RSS (VmHWM, from
the entry's manifest) is the converter's alone. The baseline of the ratio is the checkpoint's own size,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ascq.quantize.synthetic import write_synthetic_checkpoint
from ascq.zoo.deepseek_moe_16b import CONFIG

GIB = 1 << 30


def run(num_layers: int, recipe: list[str], workdir: Path, num_samples: int, seq_len: int) -> dict:
    model, entry = workdir / f"synthetic-deepseek-moe-16b-{num_layers}l", workdir / f"entry-{num_layers}l"
    start = time.perf_counter()
    size = write_synthetic_checkpoint(
        model, dict(CONFIG, num_hidden_layers=num_layers), max_shard_bytes=4 * GIB
    )
    write_seconds = time.perf_counter() - start
    cmd = [
        sys.executable,
        "-m",
        "ascq.cli",
        "convert",
        str(model),
        "--out",
        str(entry),
        "--num-samples",
        str(num_samples),
        "--seq-len",
        str(seq_len),
    ] + [arg for r in recipe for arg in ("--recipe", r)]
    subprocess.run(cmd, check=True, env=dict(os.environ, TQDM_DISABLE="1"))
    manifest = json.loads((entry / "ascq.json").read_text())
    out_size = sum(f["size"] for f in manifest["files"].values())
    shutil.rmtree(model)
    shutil.rmtree(entry)
    return {
        "layers": num_layers,
        "checkpoint_gib": size / GIB,
        "output_gib": out_size / GIB,
        "peak_rss_gib": manifest["conversion"]["peak_rss_bytes"] / GIB,
        "convert_s": manifest["conversion"]["seconds"],
        "write_s": write_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--recipe", action="append", default=None, help="repeatable (default: w8a8)")
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the synthetic checkpoints go (default: a tmp dir)"
    )
    args = parser.parse_args()
    recipe = args.recipe or ["w8a8"]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ascq-streaming-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [run(n, recipe, workdir, args.num_samples, args.seq_len) for n in args.num_layers]
    print(f"\nrecipe {'+'.join(recipe)}, {args.num_samples} x {args.seq_len} calibration tokens")
    print(
        f"{'layers':>6} {'checkpoint GiB':>14} {'output GiB':>10} {'peak RSS GiB':>12} {'RSS/ckpt':>8} "
        f"{'convert s':>9}"
    )
    for r in rows:
        print(
            f"{r['layers']:>6} {r['checkpoint_gib']:>14.2f} {r['output_gib']:>10.2f} "
            f"{r['peak_rss_gib']:>12.2f} "
            f"{r['peak_rss_gib'] / r['checkpoint_gib']:>8.2f} {r['convert_s']:>9.1f}"
        )
    if len(rows) > 1:
        print(
            f"peak RSS {rows[-1]['layers']} vs {rows[0]['layers']} layers: "
            f"x{rows[-1]['peak_rss_gib'] / rows[0]['peak_rss_gib']:.2f}"
        )


if __name__ == "__main__":
    main()
