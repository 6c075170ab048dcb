"""ascq's int4 recipes against the int4 a user would otherwise make, on one source checkpoint (issue 34):
llm-compressor's AWQ and GPTQ, and llama.cpp's Q4_0 and Q4_K_M, every row scored by one implementation.

Rows: FP (the source); ascq `w4a16-rtn`, `awq-int4`, `w4a16-gptq` (the default recipes: int4, asymmetric,
integer zero points, group 128 narrowed to what divides every width, the size actually used read from the
entry's config); llm-compressor 0.14's AWQ and GPTQ with W4A16 asym at that same group size on the same
calibration blocks (run by `benchmarks/compare_llmcompressor.py --worker` in llm-compressor's venv, which also
writes the dequantized plain checkpoint scored here); llama.cpp's `convert_hf_to_gguf.py --outtype f32`
on the source, then `llama-quantize` to Q4_0 and Q4_K_M, both as llama-quantize makes them by default (it
quantizes the tied token embedding, which is also the output matrix, too: its type is in the note column) and
with the token embedding left in F32, which quantizes the same parameters as the ascq and llm-compressor rows
(their embedding and `lm_head` stay FP).
The F32 GGUF itself is scored too: it must give the FP perplexity, which checks the GGUF read-back path.

Scorer: transformers in fp32 on dequantized weights for every row (`ascq.evaluate.perplexity` over
non-overlapping windows of `--window` tokens of GPL-3, as `benchmarks/smollm2_quality.py`): ascq entries
through transformers' compressed-tensors loader, llm-compressor's through its dequantized checkpoint, GGUF
files through `from_pretrained(gguf_file=...)`, which dequantizes.

Bits per weight: stored bits of weights + scales + zero points over the quantized linear parameters
(`ascq.zoo.card.quantized_weight_bits` on ascq's and llm-compressor's compressed checkpoints; for GGUF the
bytes of the same linears' tensors in the file). Conversion wall time: the whole `ascq convert` process's own
measure (manifest `conversion.seconds`, run with `--no-eval`), llm-compressor's `oneshot` call, and for GGUF
`llama-quantize` (the F32 GGUF export is timed once, on its own row).

llama.cpp is never an ascq dependency; build it outside the repository (see `benchmarks/vs_llamacpp.py`):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && cmake --build build --target llama-quantize -j2

`convert_hf_to_gguf.py` runs under `--gguf-python` (default: llm-compressor's venv, which has its torch,
transformers, numpy and sentencepiece; it imports the tree's own `gguf-py`).

    OMP_NUM_THREADS=2 python benchmarks/quality_vs_anchors.py --model zoo/smollm2-135m-instruct \
        --llama-cpp LLAMA_CPP_TREE --llmc-python .venv-llmc/bin/python [--num-samples 16 --seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_llmcompressor as llmc  # noqa: E402

from ascq.evaluate import load_eval_token_ids, perplexity  # noqa: E402
from ascq.formats.manifest import read_manifest  # noqa: E402
from ascq.zoo.card import quantized_weight_bits  # noqa: E402

EVAL_TEXT = Path("/usr/share/common-licenses/GPL-3")
ASCQ_RECIPES = ("w4a16-rtn", "awq-int4", "w4a16-gptq")
LLMC_ALGORITHMS = {"awq": "awq-int4", "gptq": "w4a16-gptq"}  # llm-compressor algorithm -> ascq recipe
GGUF_TYPES = ("Q4_0", "Q4_K_M")
# the GGUF tensors of the linears ascq quantizes (q, k, v, o, gate, up, down)
GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
SLACK_VS_LLMC = 0.01
MARKER = ".quality_vs_anchors"
ROW_KINDS = ("fp", "ascq", "llmc-awq", "llmc-gptq", "gguf")


@dataclass
class Row:
    name: str
    ppl: float
    bits: float | None = None
    seconds: float | None = None
    note: str = ""


BOS: int | None = None  # --bos: the id put before every window
SCORE_BATCH = 8  # --score-batch: windows per forward


def hf_perplexity(path: Path, ids: torch.Tensor, window: int, gguf_file: str | None = None) -> float:
    """transformers fp32 perplexity of a checkpoint folder (or of `gguf_file` in it, dequantized); with
    `BOS` set every window is read after that token (its logits are dropped)."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    if BOS is None:
        return perplexity(lambda batch: model(batch).logits, ids, window, SCORE_BATCH)

    def after_bos(batch: torch.Tensor) -> torch.Tensor:
        return model(torch.cat([torch.full_like(batch[:, :1], BOS), batch], 1)).logits[:, 1:]

    return perplexity(after_bos, ids, window, SCORE_BATCH)


def prepare_work(work: Path, model: Path) -> Path:
    """An fp32 copy of the source without its manifest (so convert skips its own before/after eval) in a
    scratch folder this script owns."""
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()) and not (work / MARKER).exists():
        sys.exit(f"--work {work} is not empty and was not made by this script; give an empty or new folder")
    (work / MARKER).touch()
    source = work / "source"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(model, source, ignore=shutil.ignore_patterns("ascq.json"))
    llmc._as_float32(source)
    return source


def ascq_row(source: Path, recipe: str, out: Path, args: argparse.Namespace, ids: torch.Tensor) -> Row:
    cmd = llmc.ascq_convert_command(source, recipe, out, args.num_samples, args.seq_len)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    bits, params = quantized_weight_bits(out)
    group = llmc._group_size(out)
    return Row(
        f"ascq {recipe}",
        hf_perplexity(out, ids, args.window),
        bits / params,
        read_manifest(out)["conversion"]["seconds"],
        f"g{group}, {json.loads((out / 'config.json').read_text())['quantization_config']['format']}",
    )


def llmc_row(
    source: Path, algorithm: str, group: int | None, work: Path, args: argparse.Namespace, ids: torch.Tensor
) -> Row:
    out = work / f"llmc-{algorithm}"
    cmd = [str(args.llmc_python), llmc.__file__, "--worker", "--algorithm", algorithm, "--model", str(source)]
    cmd += ["--calib", str(work / "calib.safetensors"), "--out", str(out)]
    cmd += ["--group-size", str(group)] if group else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines or "dequantized" not in json.loads(lines[-1][len("RESULT ") :]):
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Row(f"llm-compressor {algorithm}", float("nan"), note=f"failed: {last[:200]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    bits, params = quantized_weight_bits(Path(result["compressed"]))
    note = f"g{group}" if group else "g128"
    if result.get("pin_memory_patched"):
        note += "; pin_memory disabled (it raises without an accelerator)"
    return Row(
        f"llm-compressor {algorithm}",
        hf_perplexity(Path(result["dequantized"]), ids, args.window),
        bits / params if params else None,
        result["seconds"],
        note,
    )


def gguf_linear_bits(path: Path) -> tuple[float, str]:
    """Stored bits per parameter of the quantized linears in a GGUF file, and their quant types."""
    from gguf import GGUFReader

    bits = params = 0
    types: set[str] = set()
    token_embd = ""
    for tensor in GGUFReader(path).tensors:
        if tensor.name == "token_embd.weight":
            token_embd = tensor.tensor_type.name
        if GGUF_LINEAR.fullmatch(tensor.name):
            bits += int(tensor.n_bytes) * 8
            params += int(tensor.n_elements)
            types.add(tensor.tensor_type.name)
    return bits / params, f"linears {'+'.join(sorted(types))}, token_embd {token_embd}"


def gguf_rows(source: Path, work: Path, args: argparse.Namespace, ids: torch.Tensor) -> list[Row]:
    tree = Path(args.llama_cpp)
    quantize = tree / "build" / "bin" / "llama-quantize"
    f32 = work / "gguf" / "model-f32.gguf"
    f32.parent.mkdir(exist_ok=True)
    start = time.perf_counter()
    export = [str(args.gguf_python), str(tree / "convert_hf_to_gguf.py"), str(source)]
    subprocess.run([*export, "--outtype", "f32", "--outfile", str(f32)], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    bits, _ = gguf_linear_bits(f32)
    rows = [
        Row(
            "GGUF F32 (read-back check)", hf_perplexity(f32.parent, ids, args.window, f32.name), bits, seconds
        )
    ]
    variants = [("", []), (", embedding F32", ["--token-embedding-type", "f32"])]
    if args.gguf_embedding != "both":
        variants = [variants[args.gguf_embedding == "f32"]]
    for quant_type in GGUF_TYPES:
        for label, flags in variants:
            out = f32.parent / f"model-{quant_type}{'-embf32' if flags else ''}.gguf"
            start = time.perf_counter()
            cmd = [str(quantize), *flags, str(f32), str(out), quant_type, str(args.threads)]
            subprocess.run(cmd, check=True, capture_output=True)
            seconds = time.perf_counter() - start
            bits, types = gguf_linear_bits(out)
            ppl = hf_perplexity(out.parent, ids, args.window, out.name)
            rows.append(Row(f"llama.cpp {quant_type}{label}", ppl, bits, seconds, types))
            print("row", json.dumps(asdict(rows[-1])), flush=True)
    return rows


def bound_lines(rows: dict[str, Row]) -> list[str]:
    """The issue's bounds as PASS / FAIL lines, and the gap to Q4_K_M with both bit widths."""

    def check(label: str, left: Row | None, right: Row | None, factor: float = 1.0) -> str:
        if left is None or right is None:
            return f"SKIP {label}: row missing"
        verdict = "PASS" if left.ppl <= factor * right.ppl else "FAIL"
        return (
            f"{verdict} {label}: {left.name} {left.ppl:.3f} vs {right.name} {right.ppl:.3f}"
            f"{f' x {factor:g}' if factor != 1 else ''} (ratio {left.ppl / right.ppl:.4f})"
        )

    awq, gptq, rtn = (rows.get(f"ascq {r}") for r in ("awq-int4", "w4a16-gptq", "w4a16-rtn"))
    lines = [
        check("ascq AWQ <= ascq RTN", awq, rtn),
        check("ascq GPTQ <= ascq RTN", gptq, rtn),
        check(
            "ascq AWQ <= 1.01 x llm-compressor AWQ", awq, rows.get("llm-compressor awq"), 1 + SLACK_VS_LLMC
        ),
        check(
            "ascq GPTQ <= 1.01 x llm-compressor GPTQ",
            gptq,
            rows.get("llm-compressor gptq"),
            1 + SLACK_VS_LLMC,
        ),
    ]
    best = min((r for r in (awq, gptq) if r is not None), key=lambda r: r.ppl, default=None)
    for suffix in (", embedding F32", ""):
        lines.append(check("min(ascq AWQ, ascq GPTQ) <= Q4_0", best, rows.get(f"llama.cpp Q4_0{suffix}")))
    for suffix in (", embedding F32", ""):
        k_quant = rows.get(f"llama.cpp Q4_K_M{suffix}")
        if best is not None and k_quant is not None and best.bits and k_quant.bits:
            lines.append(
                f"GAP {best.name} {best.ppl:.3f} at {best.bits:.3f} bits vs {k_quant.name} {k_quant.ppl:.3f} "
                f"at {k_quant.bits:.3f} bits: {100 * (best.ppl / k_quant.ppl - 1):+.2f} % perplexity"
            )
    return lines


def print_table(rows: list[Row]) -> None:
    fp = rows[0].ppl
    print("\n| row | ppl | vs FP | bits per weight | conversion s | note |")
    print("|---|---:|---:|---:|---:|---|")
    for row in rows:
        bits = f"{row.bits:.3f}" if row.bits is not None else "-"
        seconds = f"{row.seconds:.1f}" if row.seconds is not None else "-"
        print(f"| {row.name} | {row.ppl:.3f} | {row.ppl / fp:.4f} | {bits} | {seconds} | {row.note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="source checkpoint folder (FP)")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp tree with build/bin/llama-quantize")
    parser.add_argument(
        "--llmc-python", default=str(llmc.LLMC_PYTHON), help="python of llm-compressor's venv"
    )
    parser.add_argument("--gguf-python", help="python for convert_hf_to_gguf.py (default: --llmc-python)")
    parser.add_argument("--work", default="/tmp/ascq-quality-vs-anchors")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    parser.add_argument("--json")
    parser.add_argument(
        "--bos",
        action="store_true",
        help="read every window after the tokenizer's bos token (models trained with one, as Gemma)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=ROW_KINDS,
        help="score only these rows (repeatable; default: all), e.g. the slow ones in parallel processes, "
        "each with its own --work and --json; --merge prints them together",
    )
    parser.add_argument("--group-size", type=int, default=128, help="llm-compressor's, without ascq rows")
    parser.add_argument(
        "--gguf-embedding",
        choices=("both", "f32", "default"),
        default="both",
        help="llama.cpp rows with the token embedding in F32, as llama-quantize makes it by default, or both",
    )
    parser.add_argument(
        "--score-batch", type=int, default=8, help="windows per scoring forward (1 for a large vocabulary)"
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print the rows of --json files together")
    args = parser.parse_args()
    if args.merge:
        rows = [Row(**r) for path in args.merge for r in json.loads(Path(path).read_text())["rows"]]
        print_table(sorted(rows, key=lambda r: not r.name.startswith("FP")))  # the FP row first
        print("\n" + "\n".join(bound_lines({row.name: row for row in rows})))
        return
    kinds = set(args.only or ROW_KINDS)
    args.gguf_python = args.gguf_python or args.llmc_python
    model, work = Path(args.model), Path(args.work)
    for path in (Path(args.llama_cpp) / "build" / "bin" / "llama-quantize", Path(args.llmc_python)):
        if not path.exists():
            sys.exit(f"{path} does not exist")
    source = prepare_work(work, model)

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ascq.quantize.calibration import load_calibration

    tokenizer = AutoTokenizer.from_pretrained(model)
    global BOS, SCORE_BATCH
    SCORE_BATCH = args.score_batch
    if args.bos:
        BOS = tokenizer.bos_token_id
    calib = load_calibration(None, tokenizer, args.num_samples, args.seq_len)
    save_file({"input_ids": calib.input_ids.contiguous()}, work / "calib.safetensors")
    ids = load_eval_token_ids(model, EVAL_TEXT)
    print(f"eval: {EVAL_TEXT}, {ids.numel()} tokens, windows of {args.window}, bos {BOS}", flush=True)
    rows = [Row(f"FP ({model.name})", hf_perplexity(source, ids, args.window))] if "fp" in kinds else []
    groups: dict[str, int | None] = {}
    for recipe in ASCQ_RECIPES if "ascq" in kinds else ():
        rows.append(ascq_row(source, recipe, work / f"ascq-{recipe}", args, ids))
        groups[recipe] = llmc._group_size(work / f"ascq-{recipe}")
        print("row", json.dumps(asdict(rows[-1])), flush=True)
    for algorithm, recipe in LLMC_ALGORITHMS.items():
        if f"llmc-{algorithm}" in kinds:
            rows.append(llmc_row(source, algorithm, groups.get(recipe, args.group_size), work, args, ids))
            print("row", json.dumps(asdict(rows[-1])), flush=True)
    rows += gguf_rows(source, work, args, ids) if "gguf" in kinds else []
    print(
        f"\nmodel {model}; calibration {args.num_samples} x {args.seq_len} tokens (ascq's calib slice, "
        f"the same blocks for llm-compressor); eval {EVAL_TEXT} ({ids.numel()} tokens, "
        f"windows of {args.window})"
    )
    if "fp" in kinds:
        print_table(rows)
    bounds = bound_lines({row.name: row for row in rows})
    print("\n" + "\n".join(bounds))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "bounds": bounds}, indent=1)
        )


if __name__ == "__main__":
    main()
