"""Every shipped recipe on one real model: `ascq convert`, then the result loaded by ascq's runtime and asked
for a few greedy tokens (issue 34: "all recipes convert and load", Gemma 3 270M). Prints, per recipe: convert
wall seconds (the manifest's), peak RSS, perplexity before -> after on the fixture eval text (the converter's
own measure), load seconds, and the greedy continuation. `kv-int8-c8` is an addition to a weight recipe in
vllm-ascend's format (served on NPU only): it is converted with `w8a8` as msModelSlim and not loaded.

    OMP_NUM_THREADS=2 python benchmarks/recipes_on_model.py --model zoo/gemma3-270m \
        [--num-samples 16 --seq-len 256 --max-eval-tokens 2048] [--recipes w8a8 ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ascq.paths import shipped_recipes

COMPOSED = {"kv-int8-c8": (["w8a8", "kv-int8-c8"], "msmodelslim")}  # recipe -> (recipes, format)
PROMPT = "The capital of France is Paris. The capital of Germany is"


def convert(model: Path, recipe: str, out: Path, args: argparse.Namespace) -> tuple[dict, str]:
    recipes, fmt = COMPOSED.get(recipe, ([recipe], "compressed-tensors"))
    cmd = [sys.executable, "-m", "ascq.cli", "convert", str(model), "--out", str(out), "--overwrite"]
    cmd += [arg for r in recipes for arg in ("--recipe", r)] + ["--format", fmt]
    cmd += ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
    cmd += ["--max-eval-tokens", str(args.max_eval_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "ascq.json").read_text()), fmt


def load_and_generate(entry: Path) -> tuple[float, str]:
    from ascq import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(entry), device="cpu", max_model_len=1024)
    seconds = time.perf_counter() - start
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))
    return seconds, out[0].outputs[0].text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--recipes", nargs="+", default=sorted(shipped_recipes()))
    parser.add_argument("--work", default="/tmp/ascq-recipes-on-model")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-eval-tokens", type=int, default=2048)
    args = parser.parse_args()
    model = Path(args.model)
    print("| recipe | format | convert s | peak RSS GiB | perplexity before -> after | load s | greedy |")
    print("|---|---|---:|---:|---|---:|---|")
    for recipe in args.recipes:
        out = Path(args.work) / f"{model.name}-{recipe}"
        manifest, fmt = convert(model, recipe, out, args)
        metrics, conversion = manifest["metrics"], manifest["conversion"]
        ppl = f"{metrics['perplexity_base']:.3f} -> {metrics['perplexity']:.3f}"
        load, text = ("-", "(NPU format)") if fmt == "msmodelslim" else load_and_generate(out)
        load = load if isinstance(load, str) else f"{load:.1f}"
        rss = f"{conversion['peak_rss_bytes'] / 2**30:.2f}"
        row = [recipe, fmt, f"{conversion['seconds']:.1f}", rss, ppl, load]
        print("| " + " | ".join([*row, repr(text)]) + " |", flush=True)


if __name__ == "__main__":
    main()
