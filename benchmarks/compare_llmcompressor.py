"""ascq's awq-int4 / w4a16-gptq / w8a8 against llm-compressor's AWQ, GPTQ and SmoothQuant + W8A8 on the same
model and calibration tokens.

llm-compressor lives in its own virtual environment (it pins compressed-tensors 0.19, ascq pins 0.20.1):

    python3 -m venv .venv-llmc
    .venv-llmc/bin/pip install "torch==2.13.0" "transformers==5.17.0" "compressed-tensors==0.19.0" \
        "llmcompressor==0.14.0.1" safetensors
    python benchmarks/compare_llmcompressor.py --fixture zoo/tiny-llama          # from ascq's own venv
    python benchmarks/compare_llmcompressor.py --fixture zoo/smollm2-135m-instruct \
        --eval-text /usr/share/common-licenses/GPL-3 --algorithms awq gptq smoothquant

What it does: ascq's calibration blocks (`ascq.quantize.calibration`, the bundled calib slice) are written to
a file; ascq converts with `w4a16-rtn`, `awq-int4`, `w4a16-gptq`; a worker in `.venv-llmc` (this same file,
`--worker`) runs llm-compressor's `oneshot` with `AWQModifier + QuantizationModifier(W4A16_ASYM)` and with
`GPTQModifier(W4A16_ASYM, actorder static)` and with `SmoothQuantModifier(0.8) + QuantizationModifier(W8A8)`
(ascq's w8a8 recipe) on the same token blocks, saves the compressed checkpoint (format of compressed-tensors
0.19) and, beside it, a dequantized plain checkpoint made by compressed-tensors 0.19's own `fake_quantize`
with the modifier's scales/zero points (a 0.19 asymmetric pack-quantized checkpoint does not load under
0.20.1, so it is not read across versions). Every model is then scored by the same `ascq.evaluate.perplexity`
(ascq entries via `reference_logits`, llm-compressor's W4A16 via transformers on the dequantized weights; its
W8A8 checkpoint, symmetric int8 which both versions store alike, via the same `reference_logits`, so both W8A8
models are scored with the same served dynamic per-token activation quantizer). Time ratios = ascq's convert
(the whole `ascq convert` process: imports, reading, calibration, writing; with `--no-eval`, as its default
perplexity before/after, two more forwards of every layer, is work `oneshot` does not do and this script
scores both models afterwards) / llm-compressor's `oneshot` call (model loading and saving excluded), in the
same run, as wall time and as CPU time (user + system: on a shared machine whose timing runs pause background
jobs, CPU time is what a paused or preempted process did not inflate). Both run one process at a time with the
caller's OMP_NUM_THREADS. W4A16 group size: llm-compressor gets the group size ascq's checkpoint uses
(SmolLM2's 576 = 9 · 64: ascq fits the recipe's 128 to 64, compressed-tensors 0.19 alone would use a ragged
last group of 64 per row).

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
# llm-compressor algorithm -> ascq recipe
ASCQ_RECIPE = {
    "awq": "awq-int4",
    "gptq": "w4a16-gptq",
    "smoothquant": "w8a8",
}


# ---- worker: runs inside .venv-llmc, imports nothing from ascq
# ------------------------------------------------


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


def _w4a16_asym(group_size: int | None) -> dict:
    """W4A16_ASYM at ascq's group size for this model (the preset's 128 when None): compressed-tensors 0.19
    would quantize a width 128 does not divide (SmolLM2's 576) with a ragged last group, ascq with one fitted
    size."""
    if group_size is None:
        return {"scheme": "W4A16_ASYM"}
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size
    )
    return {"config_groups": {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}}


def _recipe(algorithm: str, group_size: int | None = None):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    ignore = ["lm_head"]
    if algorithm == "awq":
        return [
            AWQModifier(duo_scaling=True, n_grid=20),
            QuantizationModifier(targets=["Linear"], ignore=ignore, **_w4a16_asym(group_size)),
        ]
    if algorithm == "smoothquant":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            QuantizationModifier(targets=["Linear"], ignore=ignore, scheme="W8A8"),
        ]
    return [
        GPTQModifier(
            targets=["Linear"],
            ignore=ignore,
            actorder="static",
            block_size=128,
            dampening_frac=0.01,
            **_w4a16_asym(group_size),
        )
    ]


def _oneshot(args: argparse.Namespace, dataset, model_class) -> dict:
    import torch
    from llmcompressor import oneshot

    model = model_class.from_pretrained(args.model, dtype=torch.float32)
    start, cpu_start = time.perf_counter(), time.process_time()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=_recipe(args.algorithm, args.group_size),
        num_calibration_samples=len(dataset),
        max_seq_length=len(dataset[0]["input_ids"]),
    )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    out = Path(args.out)
    _save_dequantized(model, out / "dequantized")
    model.save_pretrained(out / "compressed", save_compressed=True)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "dequantized": str(out / "dequantized"),
        "compressed": str(out / "compressed"),
    }


def _save_dequantized(model, out: Path) -> None:
    """Replace each quantized linear's weight by compressed-tensors 0.19's fake_quantize of it; save plain
    fp32."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    state = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None or not hasattr(module, "weight_scale"):
            continue
        zero = getattr(module, "weight_zero_point", None)
        state[name + ".weight"] = fake_quantize(
            module.weight.data,
            module.weight_scale.data,
            zero.data if zero is not None else None,
            scheme.weights,
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model.config._name_or_path)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full = {k: v for k, v in model.state_dict().items() if k in plain.state_dict()}
    full.update(state)
    plain.load_state_dict(full, strict=True)
    plain.save_pretrained(out)


def _as_float32(model_dir: Path) -> None:
    """The copied fixture's weights in float32 (bf16 -> fp32 is exact): the precision llm-compressor loads it
    in (`from_pretrained(dtype=float32)`) and writes its norms and scales in, so ascq gets the same weights
    and writes its checkpoint in the same dtype. From a bf16 source ascq writes bf16 norms and scales: on
    SmolLM2's AWQ that rounding alone cost 1.3 % perplexity (33.20 vs 32.78, same converter)."""
    from safetensors.torch import load_file, save_file

    for shard in model_dir.glob("*.safetensors"):
        tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        {k: "float32" for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": "float32"}
    )
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


# ---- driver: runs in ascq's venv
# --------------------------------------------------------------------------------


def driver(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascq.evaluate import load_eval_token_ids, perplexity
    from ascq.formats.manifest import read_manifest
    from ascq.quantize.calibration import load_calibration
    from ascq.quantize.reference_forward import reference_logits

    fixture = Path(args.fixture)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "source"  # the fixture without its manifest: ascq then skips its own before/after eval
    # this script's scratch folder: only then is its old source replaced
    marker = work / ".compare_llmcompressor"
    if any(work.iterdir()) and not marker.exists():
        sys.exit(f"--work {work} is not empty and was not made by this script; give an empty or new folder")
    marker.touch()
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(fixture, source, ignore=shutil.ignore_patterns("ascq.json"))
    _as_float32(source)
    tokenizer = AutoTokenizer.from_pretrained(fixture)
    calib = load_calibration(None, tokenizer, args.num_samples, args.seq_len)
    save_file({"input_ids": calib.input_ids.contiguous()}, work / "calib.safetensors")
    eval_ids = (
        load_eval_token_ids(fixture, args.eval_text) if args.eval_text else load_eval_token_ids(fixture)
    )

    def hf_ppl(path: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return perplexity(lambda b: model(b).logits, eval_ids)

    if json.loads((fixture / "config.json").read_text())["model_type"] == "deepseek":  # no transformers class
        from ascq.reference.deepseek_moe import load_deepseek

        reference = load_deepseek(fixture)
        fp_ppl = perplexity(lambda b: reference(b), eval_ids)
    else:
        fp_ppl = hf_ppl(fixture)
    rows = [("FP (bf16 fixture)", fp_ppl, None, None, None, "")]
    group_sizes: dict[str, int | None] = {}

    def ascq_row(recipe: str) -> None:  # one process each: its own peak RSS
        entry = work / f"ascq-{recipe}"
        cmd = ascq_convert_command(source, recipe, entry, args.num_samples, args.seq_len)
        cpu_before = _children_cpu_seconds()
        subprocess.run(cmd, check=True, capture_output=True)
        cpu_seconds = _children_cpu_seconds() - cpu_before
        ppl = perplexity(lambda b, e=entry: reference_logits(e, b), eval_ids)
        conversion = read_manifest(entry)["conversion"]
        group_sizes[recipe] = _group_size(entry)
        note = f"g{group_sizes[recipe]}" if group_sizes[recipe] else ""
        rows.append(
            (f"ascq {recipe}", ppl, conversion["seconds"], cpu_seconds, conversion["peak_rss_bytes"], note)
        )
        print("row", json.dumps(rows[-1]), flush=True)

    def llmc_row(algorithm: str) -> None:
        cmd = [
            str(args.llmc_python),
            __file__,
            "--worker",
            "--algorithm",
            algorithm,
            "--model",
            str(fixture),
            "--calib",
            str(work / "calib.safetensors"),
            "--out",
            str(work / f"llmc-{algorithm}"),
        ]
        group_size = group_sizes.get(ASCQ_RECIPE[algorithm])
        if group_size:  # the same group size as ascq's checkpoint
            cmd += ["--group-size", str(group_size)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            rows.append(
                (f"llm-compressor {algorithm}", float("nan"), None, None, None, f"failed: {last[:200]}")
            )
            return
        result = json.loads(lines[-1][len("RESULT ") :])
        note = f"g{group_size}" if group_size else ""
        if result.get("error"):
            note += f"; unpatched run raised {result['error']}" + (
                "; numbers with pin_memory disabled" if result.get("pin_memory_patched") else ""
            )
        if algorithm == "smoothquant" and "compressed" in result:
            ppl = perplexity(lambda b, e=Path(result["compressed"]): reference_logits(e, b), eval_ids)
        else:
            ppl = hf_ppl(Path(result["dequantized"])) if "dequantized" in result else float("nan")
        rows.append(
            (
                f"llm-compressor {algorithm}",
                ppl,
                result.get("seconds"),
                result.get("cpu_seconds"),
                result.get("peak_rss_bytes"),
                note,
            )
        )
        print("row", json.dumps(rows[-1]), flush=True)

    if not args.skip_rtn:
        ascq_row("w4a16-rtn")
    for algorithm in args.algorithms:  # each pair back to back, so that both see the same machine
        ascq_row(ASCQ_RECIPE[algorithm])
        llmc_row(algorithm)
    print(
        f"fixture {fixture.name}; calibration {args.num_samples} x {args.seq_len} tokens (ascq's calib "
        f"slice); "
        f"eval: {args.eval_text or 'ascq/data/eval.txt'}"
    )
    print(f"{'model':28} {'ppl':>9} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>13}  note")
    for name, ppl, seconds, cpu, rss, note in rows:
        t = f"{seconds:8.1f}" if seconds is not None else f"{'-':>8}"
        c = f"{cpu:8.1f}" if cpu is not None else f"{'-':>8}"
        r = f"{rss / 2**20:13.0f}" if rss else f"{'-':>13}"
        print(f"{name:28} {ppl:9.3f} {t} {c} {r}  {note}")
    by_name = {name: (ppl, seconds, cpu) for name, ppl, seconds, cpu, _, _ in rows}
    for algorithm in args.algorithms:
        ours, theirs = (
            by_name.get(f"ascq {ASCQ_RECIPE[algorithm]}"),
            by_name.get(f"llm-compressor {algorithm}"),
        )
        if ours and theirs and theirs[1] and theirs[2]:
            print(
                f"{algorithm}: ppl ascq/llm-compressor {ours[0] / theirs[0]:.4f}, wall time "
                f"ascq/llm-compressor "
                f"{ours[1] / theirs[1]:.2f}, CPU time {ours[2] / theirs[2]:.2f}"
            )
    (work / "results.json").write_text(json.dumps(rows, indent=1))


def ascq_convert_command(source: Path, recipe: str, out: Path, num_samples: int, seq_len: int) -> list[str]:
    """`ascq convert` as both benchmarks run it: no perplexity pass (scored afterwards), over a previous
    output of the benchmark's own work folder."""
    return [
        *(sys.executable, "-m", "ascq.cli", "convert", str(source), "--recipe", recipe, "--out", str(out)),
        *("--num-samples", str(num_samples), "--seq-len", str(seq_len), "--no-eval", "--overwrite"),
    ]


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of the finished child processes (a paused or preempted child adds none)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _group_size(entry: Path) -> int | None:
    """The weight group size of an ascq entry's quantization_config (None: not grouped)."""
    config = json.loads((entry / "config.json").read_text()).get("quantization_config") or {}
    sizes = {(g.get("weights") or {}).get("group_size") for g in (config.get("config_groups") or {}).values()}
    sizes.discard(None)
    return sizes.pop() if len(sizes) == 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", default=str(PROJECT / "zoo" / "tiny-llama"))
    parser.add_argument("--work", default="/tmp/ascq-vs-llmcompressor")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--llmc-python", default=str(LLMC_PYTHON), help="python of llm-compressor's venv")
    parser.add_argument("--eval-text", help="held-out text file (default: ascq/data/eval.txt)")
    parser.add_argument("--algorithms", nargs="+", default=["awq", "gptq"], choices=sorted(ASCQ_RECIPE))
    parser.add_argument("--skip-rtn", action="store_true", help="no ascq w4a16-rtn baseline row")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", choices=sorted(ASCQ_RECIPE))
    parser.add_argument("--model")
    parser.add_argument("--calib")
    parser.add_argument("--out")
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-pin-patch", action="store_true", help="report llm-compressor AWQ's CPU failure only"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
