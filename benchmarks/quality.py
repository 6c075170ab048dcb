"""Perplexity, conversion time and peak RSS of the W4/W8 recipes on the fixtures and their outlier-stress
variants.

    python benchmarks/quality.py        # both fixtures, all recipes (about 15 minutes on 2 cores)
    python benchmarks/quality.py --fixtures zoo/tiny-llama --recipes w4a16-rtn awq-int4

Each conversion runs as its own `ascq convert` process (so peak RSS is that conversion's), with the
converter's default calibration (64 x 512 tokens of the bundled calib slice); perplexity is the manifest's
(held-out `ascq/data/eval.txt`, `ascq.evaluate` protocol), FP is the manifest's `perplexity_base`. The
outlier-stress variant (`ascq.quantize.outlier_stress`, k = 30 on 4 channels) is a stress test, not a real
model. "recovered" is (ppl_rtn - ppl) / (ppl_rtn - ppl_fp): the share of round-to-nearest int4's loss that the
recipe wins back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
RECIPES = ("w4a16-rtn", "awq-int4", "w4a16-gptq", "w4a8-dynamic", "w8a8")


def convert(source: Path, recipe: str, out: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "ascq.cli",
        "convert",
        str(source),
        "--recipe",
        recipe,
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=None)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "ascq.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--fixtures",
        nargs="+",
        default=[str(PROJECT / "zoo" / "tiny-llama"), str(PROJECT / "zoo" / "tiny-deepseek-moe")],
    )
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--work", default="/tmp/ascq-quality")
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--no-stress", action="store_true")
    args = parser.parse_args()

    from ascq.quantize.outlier_stress import write_outlier_stress

    extra = [
        *(["--num-samples", str(args.num_samples)] if args.num_samples else []),
        *(["--seq-len", str(args.seq_len)] if args.seq_len else []),
    ]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for fixture in map(Path, args.fixtures):
        sources = [fixture]
        if not args.no_stress:
            sources.append(write_outlier_stress(fixture, work / f"{fixture.name}-outlier-stress"))
        for source in sources:
            results = {}
            for recipe in args.recipes:
                manifest = convert(source, recipe, work / f"{source.name}-{recipe}", extra)
                results[recipe] = manifest
                print(
                    f"{source.name} {recipe}: ppl {manifest['metrics']['perplexity']:.3f} "
                    f"({manifest['conversion']['seconds']:.1f} s)",
                    flush=True,
                )
            fp = next(iter(results.values()))["metrics"]["perplexity_base"]
            rtn = results.get("w4a16-rtn", {}).get("metrics", {}).get("perplexity")
            rows.append((source.name, "FP", fp, None, None, None))
            for recipe, manifest in results.items():
                ppl = manifest["metrics"]["perplexity"]
                recovered = (
                    (rtn - ppl) / (rtn - fp)
                    if rtn and recipe.startswith(("awq", "w4a16-gptq")) and rtn != fp
                    else None
                )
                conv = manifest["conversion"]
                rows.append((source.name, recipe, ppl, recovered, conv["seconds"], conv["peak_rss_bytes"]))

    print("\n| model | recipe | ppl | vs FP | recovered | convert s | peak RSS MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    fps = {name: ppl for name, recipe, ppl, *_ in rows if recipe == "FP"}
    for name, recipe, ppl, recovered, seconds, rss in rows:
        delta = f"{100 * (ppl / fps[name] - 1):+.2f}%"
        rec = f"{100 * recovered:.0f}%" if recovered is not None else ""
        sec = f"{seconds:.1f}" if seconds is not None else ""
        mem = f"{rss / 2**20:.0f}" if rss else ""
        print(f"| {name} | {recipe} | {ppl:.3f} | {delta} | {rec} | {sec} | {mem} |")
    (work / "quality.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
