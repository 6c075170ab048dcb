"""ascq's awq-int4 / w4a16-gptq / w8a8 against llm-compressor's AWQ, GPTQ and SmoothQuant + W8A8 on the same model
and calibration tokens.

llm-compressor lives in its own virtual environment (it pins compressed-tensors 0.19, ascq pins 0.20.1):

    python3 -m venv .venv-llmc
    .venv-llmc/bin/pip install "torch==2.13.0" "transformers==5.17.0" "compressed-tensors==0.19.0" \
        "llmcompressor==0.14.0.1" safetensors
    python benchmarks/compare_llmcompressor.py --fixture zoo/tiny-llama          # from ascq's own venv
    python benchmarks/compare_llmcompressor.py --fixture zoo/smollm2-135m-instruct \
        --eval-text /usr/share/common-licenses/GPL-3 --algorithms awq gptq smoothquant

What it does: ascq's calibration blocks (`ascq.quantize.calibration`, the bundled calib slice) are written to a
file; ascq converts with `w4a16-rtn`, `awq-int4`, `w4a16-gptq`; a worker in `.venv-llmc` (this same file,
`--worker`) runs llm-compressor's `oneshot` with `AWQModifier + QuantizationModifier(W4A16_ASYM)` and with
`GPTQModifier(W4A16_ASYM, actorder static)` and with `SmoothQuantModifier(0.8) + QuantizationModifier(W8A8)` (ascq's
w8a8 recipe) on the same token blocks, saves the compressed checkpoint (format of
compressed-tensors 0.19) and, beside it, a dequantized plain checkpoint made by compressed-tensors 0.19's own
`fake_quantize` with the modifier's scales/zero points (a 0.19 asymmetric pack-quantized checkpoint does not load
under 0.20.1, so it is not read across versions). Every model is then scored by the same `ascq.evaluate.perplexity`
(ascq entries via `reference_logits`, llm-compressor's W4A16 via transformers on the dequantized weights; its W8A8
checkpoint, symmetric int8 which both versions store alike, via the same `reference_logits`, so both W8A8 models are
scored with the same served dynamic per-token activation quantizer). Time ratio = ascq's convert wall time (reading,
calibration, writing included) / llm-compressor's `oneshot` time, in the same run.

llm-compressor 0.14's AWQ pins its activation cache (`Tensor.pin_memory`), which raises on a host without an
accelerator; the worker records that error and, unless `--no-pin-patch`, reruns with pinning disabled (a no-op
patch of `IntermediatesCache.pin_memory`; pinning only speeds host->device copies) to get its numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
LLMC_PYTHON = PROJECT / ".venv-llmc" / "bin" / "python"
ASCQ_RECIPE = {"awq": "awq-int4", "gptq": "w4a16-gptq", "smoothquant": "w8a8"}  # llm-compressor algorithm -> ascq recipe


# ---- worker: runs inside .venv-llmc, imports nothing from ascq ------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    # benchmarks/ holds scripts (e.g. kernels.py) that would shadow packages transformers probes for
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import resource

    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = load_file(args.calib)["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    result: dict = {"algorithm": args.algorithm}
    if args.algorithm == "awq":
        try:
            result.update(_oneshot(args, dataset, AutoModelForCausalLM))
        except Exception as exc:  # the accelerator-only pin_memory, reported as it is
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if args.no_pin_patch:
                raise SystemExit(_emit(result)) from None
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *a, **k: None
            result["pin_memory_patched"] = True
            result.update(_oneshot(args, dataset, AutoModelForCausalLM))
    else:
        result.update(_oneshot(args, dataset, AutoModelForCausalLM))
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _emit(result)


def _emit(result: dict) -> int:
    print("RESULT " + json.dumps(result))
    return 0


def _recipe(algorithm: str):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    ignore = ["lm_head"]
    if algorithm == "awq":
        return [AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(targets=["Linear"], ignore=ignore, scheme="W4A16_ASYM")]
    if algorithm == "smoothquant":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=0.8), QuantizationModifier(targets=["Linear"], ignore=ignore, scheme="W8A8")]
    return [GPTQModifier(targets=["Linear"], ignore=ignore, scheme="W4A16_ASYM", actorder="static", block_size=128, dampening_frac=0.01)]


def _oneshot(args: argparse.Namespace, dataset, model_class) -> dict:
    import torch
    from llmcompressor import oneshot

    model = model_class.from_pretrained(args.model, dtype=torch.float32)
    start = time.perf_counter()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=_recipe(args.algorithm),
        num_calibration_samples=len(dataset),
        max_seq_length=len(dataset[0]["input_ids"]),
    )
    seconds = time.perf_counter() - start
    out = Path(args.out)
    _save_dequantized(model, out / "dequantized")
    model.save_pretrained(out / "compressed", save_compressed=True)
    return {"seconds": seconds, "dequantized": str(out / "dequantized"), "compressed": str(out / "compressed")}


def _save_dequantized(model, out: Path) -> None:
    """Replace each quantized linear's weight by compressed-tensors 0.19's fake_quantize of it; save plain fp32."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    state = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None or not hasattr(module, "weight_scale"):
            continue
        zero = getattr(module, "weight_zero_point", None)
        state[name + ".weight"] = fake_quantize(module.weight.data, module.weight_scale.data, zero.data if zero is not None else None, scheme.weights)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model.config._name_or_path)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
    full.update(state)
    plain.load_state_dict(full, strict=True)
    plain.save_pretrained(out)


# ---- driver: runs in ascq's venv --------------------------------------------------------------------------------


def driver(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascq.evaluate import load_eval_token_ids, perplexity
    from ascq.quantize.calibration import load_calibration
    from ascq.quantize.reference_forward import reference_logits
    from ascq.zoo.manifest import read_manifest

    fixture = Path(args.fixture)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "source"  # the fixture without its manifest: ascq then skips its own before/after eval
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(fixture, source, ignore=shutil.ignore_patterns("ascq.json"))
    tokenizer = AutoTokenizer.from_pretrained(fixture)
    calib = load_calibration(None, tokenizer, args.num_samples, args.seq_len)
    save_file({"input_ids": calib.input_ids.contiguous()}, work / "calib.safetensors")
    eval_ids = load_eval_token_ids(fixture, args.eval_text) if args.eval_text else load_eval_token_ids(fixture)

    def hf_ppl(path: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return perplexity(lambda b: model(b).logits, eval_ids)

    if json.loads((fixture / "config.json").read_text())["model_type"] == "deepseek":  # no transformers class
        from ascq.models.deepseek_moe import load_deepseek

        reference = load_deepseek(fixture)
        fp_ppl = perplexity(lambda b: reference(b), eval_ids)
    else:
        fp_ppl = hf_ppl(fixture)
    rows = [("FP (bf16 fixture)", fp_ppl, None, None, "")]
    recipes = ["w4a16-rtn", *(ASCQ_RECIPE[a] for a in args.algorithms)]
    for recipe in recipes:  # one process each: its own peak RSS
        entry = work / f"ascq-{recipe}"
        cmd = [sys.executable, "-m", "ascq.cli", "convert", str(source), "--recipe", recipe, "--out", str(entry),
               "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        ppl = perplexity(lambda b, e=entry: reference_logits(e, b), eval_ids)
        conversion = read_manifest(entry)["conversion"]
        rows.append((f"ascq {recipe}", ppl, conversion["seconds"], conversion["peak_rss_bytes"], ""))
    for algorithm in args.algorithms:
        cmd = [str(args.llmc_python), __file__, "--worker", "--algorithm", algorithm, "--model", str(fixture),
               "--calib", str(work / "calib.safetensors"), "--out", str(work / f"llmc-{algorithm}")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            rows.append((f"llm-compressor {algorithm}", float("nan"), None, None, f"failed: {last[:200]}"))
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        note = ""
        if result.get("error"):
            note = f"unpatched run raised {result['error']}" + ("; numbers with pin_memory disabled" if result.get("pin_memory_patched") else "")
        if algorithm == "smoothquant" and "compressed" in result:
            ppl = perplexity(lambda b, e=Path(result["compressed"]): reference_logits(e, b), eval_ids)
        else:
            ppl = hf_ppl(Path(result["dequantized"])) if "dequantized" in result else float("nan")
        rows.append((f"llm-compressor {algorithm}", ppl, result.get("seconds"), result.get("peak_rss_bytes"), note))
    print(f"fixture {fixture.name}; calibration {args.num_samples} x {args.seq_len} tokens (ascq's calib slice); "
          f"eval: {args.eval_text or 'ascq/data/eval.txt'}")
    print(f"{'model':28} {'ppl':>9} {'time s':>8} {'peak RSS MiB':>13}  note")
    for name, ppl, seconds, rss, note in rows:
        t = f"{seconds:8.1f}" if seconds is not None else f"{'-':>8}"
        r = f"{rss / 2**20:13.0f}" if rss else f"{'-':>13}"
        print(f"{name:28} {ppl:9.3f} {t} {r}  {note}")
    by_name = {name: (ppl, seconds) for name, ppl, seconds, _, _ in rows}
    for algorithm in args.algorithms:
        ours, theirs = by_name.get(f"ascq {ASCQ_RECIPE[algorithm]}"), by_name.get(f"llm-compressor {algorithm}")
        if ours and theirs and theirs[1]:
            print(f"{algorithm}: ppl ascq/llm-compressor {ours[0] / theirs[0]:.4f}, time ascq/llm-compressor {ours[1] / theirs[1]:.2f}")
    (work / "results.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", default=str(PROJECT / "zoo" / "tiny-llama"))
    parser.add_argument("--work", default="/tmp/ascq-vs-llmcompressor")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--llmc-python", default=str(LLMC_PYTHON), help="python of llm-compressor's venv")
    parser.add_argument("--eval-text", help="held-out text file (default: ascq/data/eval.txt)")
    parser.add_argument("--algorithms", nargs="+", default=["awq", "gptq"], choices=sorted(ASCQ_RECIPE))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", choices=sorted(ASCQ_RECIPE))
    parser.add_argument("--model")
    parser.add_argument("--calib")
    parser.add_argument("--out")
    parser.add_argument("--no-pin-patch", action="store_true", help="report llm-compressor AWQ's CPU failure only")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
