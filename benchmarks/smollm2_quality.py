"""Real-text quality of every shipped recipe on SmolLM2-135M-Instruct (issue 13): perplexity, greedy
key-answer agreement with full precision on 20 short prompts, convert wall time and peak RSS.

Eval text: `/usr/share/common-licenses/GPL-3` (the GNU GPL v3 text from Debian's `base-files` package, on
every Debian/Ubuntu machine; real English prose, not ours, and not the calibration text
`ascq/data/calib.txt`), cut into non-overlapping windows of `--window` tokens (all full windows of the file).

Perplexity is measured by transformers (fp32, compressed-tensors decompressing the checkpoint) where it can
load the entry, and for every quantized entry by ascq's reference backend (`reference_logits`: the served
quantizer, incl. fp8 KV); the bound check uses transformers' number where there is one. Agreement: each of the
20 prompts has a key answer (e.g. "Paris"); among the prompts whose full-precision greedy answer (ascq
runtime, fp32, chat template, 48 tokens) contains its key, the share where the quantized entry's answer
contains it too.

    OMP_NUM_THREADS=2 python benchmarks/smollm2_quality.py --model zoo/smollm2-135m-instruct [--recipes ...] \
        [--num-samples 64 --seq-len 512] [--convert-eval-tokens 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from ascq import LLM, SamplingParams
from ascq.evaluate import load_eval_token_ids, perplexity
from ascq.quantize.reference_forward import reference_logits

EVAL_TEXT = Path("/usr/share/common-licenses/GPL-3")
RECIPES = ("w8a8", "w8a8-static", "w8a16", "w4a16-rtn", "awq-int4", "w4a16-gptq", "w4a8-dynamic", "fp8-kv")
BOUNDS = {  # recipe: (other recipe or "fp", allowed relative excess)
    "w8a8": ("fp", 0.03),
    "w8a16": ("fp", 0.01),
    "awq-int4": ("fp", 0.08),
}
RELATIVE_BOUNDS = (("awq-int4", "w4a16-rtn"), ("w4a16-gptq", "w4a16-rtn"))
PROMPTS = [  # (question, key answer)
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the chemical symbol for water?", "H2O"),
    ("How many days are there in a week?", "seven|7"),
    ("How many legs does a spider have?", "eight|8"),
    ("What is 2 plus 2?", "4|four"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the freezing point of water in Celsius?", "0|zero"),
    ("What language is mainly spoken in Brazil?", "Portuguese"),
    ("What is the opposite of hot?", "cold"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What gas do plants absorb from the air?", "carbon dioxide|CO2"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("Which ocean is the largest?", "Pacific"),
    ("What do bees make?", "honey"),
    ("In which continent is Egypt?", "Africa"),
]


def has_key(answer: str, key: str) -> bool:
    return re.search(rf"\b({key})\b", answer, flags=re.IGNORECASE) is not None


def convert(model: Path, recipe: str, out: Path, extra: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one `ascq convert` process."""
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "ascq.cli",
        "convert",
        str(model),
        "--recipe",
        recipe,
        "--out",
        str(out),
        "--overwrite",
        "--eval-text",
        str(EVAL_TEXT),
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return seconds, rss_kib / 2**20


def transformers_perplexity(entry: Path, ids: torch.Tensor, window: int) -> float | None:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a format transformers cannot load: reported, not fatal
        print(f"  transformers cannot load {entry.name}: {type(exc).__name__}: {str(exc)[:120]}")
        return None
    with torch.no_grad():
        return perplexity(lambda batch: model(batch).logits, ids, window)


def answers(entry: Path) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM(str(entry), dtype="float32") as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q, _ in PROMPTS], params)
    return [o.outputs[0].text for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="zoo/smollm2-135m-instruct")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--work", default="/tmp/ascq-smollm2-quality")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument(
        "--num-samples", type=int, default=None, help="calibration blocks (convert's default)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="calibration block length (convert's default)"
    )
    parser.add_argument(
        "--convert-eval-tokens",
        type=int,
        default=None,
        help="convert's own before/after perplexity tokens (--max-eval-tokens; this script measures its own)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    model, work = Path(args.model), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    extra = [
        *(["--num-samples", str(args.num_samples)] if args.num_samples else []),
        *(["--seq-len", str(args.seq_len)] if args.seq_len else []),
        *(["--max-eval-tokens", str(args.convert_eval_tokens)] if args.convert_eval_tokens else []),
    ]
    ids = load_eval_token_ids(model, EVAL_TEXT)
    print(f"eval: {EVAL_TEXT}, {ids.numel()} tokens, windows of {args.window}")

    fp_answers = answers(model)
    scored = [i for i, (_, key) in enumerate(PROMPTS) if has_key(fp_answers[i], key)]
    print(f"FP answers {len(scored)}/{len(PROMPTS)} prompts with the key answer")
    # reference_forward reads quantized entries only
    rows = {
        "fp": {"ppl_transformers": transformers_perplexity(model, ids, args.window), "ppl_reference": None}
    }
    for recipe in args.recipes:
        out = work / recipe
        seconds, rss = convert(model, recipe, out, extra)
        got = answers(out)
        rows[recipe] = {
            "convert_s": seconds,
            "peak_rss_gib": rss,
            "ppl_transformers": transformers_perplexity(out, ids, args.window),
            "ppl_reference": perplexity(lambda b, out=out: reference_logits(out, b), ids, args.window),
            "agreement": sum(has_key(got[i], PROMPTS[i][1]) for i in scored) / max(len(scored), 1),
        }
        print(recipe, json.dumps(rows[recipe]), flush=True)

    def ppl(name: str) -> float:
        row = rows[name]
        return row["ppl_transformers"] if row["ppl_transformers"] is not None else row["ppl_reference"]

    print(
        "\n| recipe | ppl (transformers) | ppl (ascq reference) | vs FP | key-answer agreement | convert s "
        "| peak RSS GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        hf = f"{row['ppl_transformers']:.3f}" if row["ppl_transformers"] is not None else "cannot load"
        excess = f"{100 * (ppl(name) / ppl('fp') - 1):+.2f} %"
        extras = (
            f"{row['agreement']:.2f} | {row['convert_s']:.0f} | {row['peak_rss_gib']:.2f}"
            if name != "fp"
            else f"{len(scored)}/{len(PROMPTS)} keyed | - | -"
        )
        ref = f"{row['ppl_reference']:.3f}" if row["ppl_reference"] is not None else "-"
        print(f"| {name} | {hf} | {ref} | {excess} | {extras} |")
    failures = []
    for name, (anchor, slack) in BOUNDS.items():
        if name in rows and ppl(name) > ppl(anchor) * (1 + slack):
            failures.append(f"{name} {ppl(name):.3f} > {anchor} {ppl(anchor):.3f} + {100 * slack:.0f} %")
    for name, anchor in RELATIVE_BOUNDS:
        if name in rows and anchor in rows and ppl(name) > ppl(anchor):
            failures.append(f"{name} {ppl(name):.3f} > {anchor} {ppl(anchor):.3f}")
    print("\nbounds:", "all hold" if not failures else "; ".join(failures))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"eval_text": str(EVAL_TEXT), "rows": rows, "failures": failures}, indent=1)
        )


if __name__ == "__main__":
    main()
