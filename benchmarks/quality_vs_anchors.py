"""ascq's int4 recipes against the int4 a user would otherwise make, on one source checkpoint (issue 34):
llm-compressor's AWQ and GPTQ, and llama.cpp's Q4_0 and Q4_K_M, every row scored by one implementation.

Rows: FP (the source); ascq `w4a16-rtn`, `awq-int4`, `w4a16-gptq` (the default recipes: int4, asymmetric,
integer zero points, group 128 narrowed to what divides every width, the size actually used read from the
entry's config); llm-compressor 0.14's AWQ and GPTQ with W4A16 asym at that same group size on the same
calibration blocks (run by `benchmarks/compare_llmcompressor.py --worker` in llm-compressor's venv, which also
writes the dequantized plain checkpoint scored here); llama.cpp's `convert_hf_to_gguf.py --outtype f32`
on the source, then `llama-quantize` to Q4_0, Q4_K_M and Q5_K_M, as llama-quantize makes them by default (it
quantizes the tied token embedding, which is also the output matrix, too: its type is in the note column) and
with the token embedding left in F32, which quantizes the same parameters as the ascq and llm-compressor rows
(their embedding and `lm_head` stay FP).
and Q4_K_M once more with `llama-imatrix`'s importance matrix of the calibration blocks (decoded to text).
The F32 GGUF itself is scored too: it must give the FP perplexity, which checks the GGUF read-back path.
`--entry NAME=PATH` adds ascq entries converted beforehand (any recipe, e.g. a mixed one) as rows.

Scorer: transformers in fp32 on dequantized weights for every row (`ascq.evaluate.perplexity` over
non-overlapping windows of `--window` tokens of GPL-3, as `benchmarks/smollm2_quality.py`): ascq entries
through transformers' compressed-tensors loader, llm-compressor's through its dequantized checkpoint, GGUF
files through `from_pretrained(gguf_file=...)`, which dequantizes. Answer retention (issue 44,
`benchmarks/answer_retention.py`): greedy chat answers to the questions of `benchmarks/data/
factual_questions.jsonl`; of those FP (the `--model` checkpoint served by ascq in bf16) answers correctly, how
many the row still does: ascq rows served by ascq in bf16, GGUF rows by `llama-server` on the same prompt
token ids. MiB: the row's weight files (safetensors shards, or the GGUF file,
which also holds its vocabulary).

Bits per weight: stored bits of weights + scales + zero points over the quantized linear parameters
(`ascq.zoo.card.quantized_weight_bits` on ascq's and llm-compressor's compressed checkpoints; for GGUF the
bytes of the same linears' tensors in the file). Conversion wall time: the whole `ascq convert` process's own
measure (manifest `conversion.seconds`, run with `--no-eval`), llm-compressor's `oneshot` call, and for GGUF
`llama-quantize` (the F32 GGUF export is timed once, on its own row).

llama.cpp is never an ascq dependency; build it outside the repository (see `benchmarks/vs_llamacpp.py`):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build --target llama-quantize llama-imatrix llama-server -j2

(its llama-quantize has no `--target-bpw`). `convert_hf_to_gguf.py` runs under `--gguf-python` (default:
llm-compressor's venv where it exists, else this Python; it needs torch, transformers, numpy and sentencepiece
and imports the tree's own `gguf-py`).

    OMP_NUM_THREADS=2 python benchmarks/quality_vs_anchors.py --model zoo/smollm2-135m-instruct \
        --llama-cpp LLAMA_CPP_TREE --llmc-python .venv-llmc/bin/python [--num-samples 16 --seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import answer_retention as answers  # noqa: E402
import compare_llmcompressor as llmc  # noqa: E402

from ascq.evaluate import load_eval_token_ids, perplexity  # noqa: E402
from ascq.formats.manifest import read_manifest  # noqa: E402
from ascq.zoo.card import quantized_weight_bits  # noqa: E402

EVAL_TEXT = Path("/usr/share/common-licenses/GPL-3")
ASCQ_RECIPES = ("w4a16-rtn", "awq-int4", "w4a16-gptq")
LLMC_ALGORITHMS = {"awq": "awq-int4", "gptq": "w4a16-gptq"}  # llm-compressor algorithm -> ascq recipe
GGUF_TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M")
IMATRIX_TYPES = ("Q4_K_M",)  # also quantized with llama-imatrix's importance matrix of the calibration text
# the GGUF tensors of the linears ascq quantizes (q, k, v, o, gate, up, down)
GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
SLACK_VS_LLMC = 0.01
MARKER = ".quality_vs_anchors"
ROW_KINDS = ("fp", "ascq", "entry", "llmc-awq", "llmc-gptq", "gguf")
MIB = 1 << 20


@dataclass
class Row:
    name: str
    ppl: float
    bits: float | None = None
    seconds: float | None = None
    note: str = ""
    mib: float | None = None  # total size of the weight files (safetensors shards, or the GGUF file)
    correct: int | None = None  # questions answered correctly
    retained: int | None = None  # of the questions FP answers correctly, how many this row does too
    fp_correct: int | None = None  # how many questions FP answers correctly (retention's denominator)


BOS: int | None = None  # --bos: the id put before every window
SCORE_BATCH = 8  # --score-batch: windows per forward
SKIP_PERPLEXITY = False  # --no-perplexity: answers and sizes only


def hf_perplexity(path: Path, ids: torch.Tensor, window: int, gguf_file: str | None = None) -> float:
    """transformers fp32 perplexity of a checkpoint folder (or of `gguf_file` in it, dequantized); with
    `BOS` set every window is read after that token (its logits are dropped); NaN under --no-perplexity."""
    if SKIP_PERPLEXITY:
        return float("nan")
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    if BOS is None:
        return perplexity(lambda batch: model(batch).logits, ids, window, SCORE_BATCH)

    def after_bos(batch: torch.Tensor) -> torch.Tensor:
        return model(torch.cat([torch.full_like(batch[:, :1], BOS), batch], 1)).logits[:, 1:]

    return perplexity(after_bos, ids, window, SCORE_BATCH)


def weight_mib(path: Path) -> float:
    """Total size of a row's weight files: a GGUF file, or a checkpoint folder's safetensors shards (the
    tokenizer files, which a GGUF file holds too, are not counted)."""
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / MIB


@dataclass
class AnswerScorer:
    """Answer retention of every row against FP's answers (`benchmarks/answer_retention.py`): ascq rows are
    served by ascq in bf16, GGUF rows by `llama-server`, both given the same chat-template prompt ids."""

    questions: list[answers.Question]
    prompts: list[list[int]]
    max_tokens: int
    llama_server: Path
    threads: int
    fp_answers: Path | None = None  # FP's answers kept for other processes of the same run (--fp-answers)
    reference: set[str] | None = None  # the questions FP answers correctly, set by the first `fp` call

    def fp(self, row: Row, source: Path) -> Row:
        """FP's answers: read from `fp_answers` when that file exists and was written for the same source,
        prompts and answer length, else generated (and written there)."""
        key = {"source": str(source.resolve()), "prompts": self.prompts, "max_tokens": self.max_tokens}
        if self.fp_answers and self.fp_answers.exists():
            saved = json.loads(self.fp_answers.read_text())
            if {k: saved.get(k) for k in key} != key:
                sys.exit(
                    f"--fp-answers {self.fp_answers} was written for another source, question set or length"
                )
            texts = saved["answers"]
        else:
            texts = answers.ascq_answers(source, self.prompts, self.max_tokens)
            if self.fp_answers:
                self.fp_answers.write_text(json.dumps({**key, "answers": texts}))
        self.reference = answers.correct_ids(self.questions, texts)
        return self._fill(row, self.reference)

    def ascq(self, row: Row, entry: Path) -> Row:
        texts = answers.ascq_answers(entry, self.prompts, self.max_tokens)
        return self._fill(row, answers.correct_ids(self.questions, texts))

    def gguf(self, row: Row, gguf: Path) -> Row:
        texts = answers.llama_cpp_answers(
            self.llama_server, gguf, self.prompts, self.max_tokens, self.threads
        )
        return self._fill(row, answers.correct_ids(self.questions, texts))

    def _fill(self, row: Row, correct: set[str]) -> Row:
        assert self.reference is not None, "FP's answers come first"
        row.correct = len(correct)
        row.retained, row.fp_correct = answers.retention(self.reference, correct)
        return row


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
    return entry_row(f"ascq {recipe}", out, args, ids)


def entry_row(name: str, entry: Path, args: argparse.Namespace, ids: torch.Tensor) -> Row:
    """A converted ascq entry: perplexity through transformers' compressed-tensors loader (fp32), answers
    served by ascq in bf16."""
    bits, params = quantized_weight_bits(entry)
    group = llmc._group_size(entry)
    config = json.loads((entry / "config.json").read_text()).get("quantization_config") or {}
    seconds = (read_manifest(entry).get("conversion") or {}).get("seconds")
    row = Row(
        name,
        hf_perplexity(entry, ids, args.window),
        bits / params if params else None,
        seconds,
        f"{f'g{group}' if group else 'mixed groups'}, {config.get('format', 'not quantized')}",
        weight_mib(entry),
    )
    return args.answer_scorer.ascq(row, entry) if args.answer_scorer else row


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


def gguf_row(name: str, gguf: Path, seconds: float, args: argparse.Namespace, ids: torch.Tensor) -> Row:
    """A GGUF file: perplexity by transformers on its dequantized weights, answers by llama-server."""
    bits, types = gguf_linear_bits(gguf)
    row = Row(
        name, hf_perplexity(gguf.parent, ids, args.window, gguf.name), bits, seconds, types, weight_mib(gguf)
    )
    row = args.answer_scorer.gguf(row, gguf) if args.answer_scorer else row
    print("row", json.dumps(asdict(row)), flush=True)
    return row


def llama_imatrix(f32: Path, calib_text: Path, args: argparse.Namespace) -> Path:
    """llama-imatrix's importance matrix of the calibration text (chunks of --seq-len tokens, --num-samples
    of them, as the ascq rows' calibration blocks)."""
    out = f32.parent / "imatrix.gguf"
    cmd = [
        str(Path(args.llama_cpp) / "build" / "bin" / "llama-imatrix"),
        "-m",
        str(f32),
        "-f",
        str(calib_text),
    ]
    cmd += [
        "-o",
        str(out),
        "-c",
        str(args.seq_len),
        "--chunks",
        str(args.num_samples),
        "-t",
        str(args.threads),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def gguf_rows(source: Path, work: Path, args: argparse.Namespace, ids: torch.Tensor) -> list[Row]:
    tree = Path(args.llama_cpp)
    quantize = tree / "build" / "bin" / "llama-quantize"
    f32 = work / "gguf" / "model-f32.gguf"
    f32.parent.mkdir(exist_ok=True)
    start = time.perf_counter()
    export = [str(args.gguf_python), str(tree / "convert_hf_to_gguf.py"), str(source)]
    subprocess.run([*export, "--outtype", "f32", "--outfile", str(f32)], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    rows = [] if args.no_read_back else [gguf_row("GGUF F32 (read-back check)", f32, seconds, args, ids)]
    variants = [("", []), (", embedding F32", ["--token-embedding-type", "f32"])]
    if args.gguf_embedding != "both":
        variants = [variants[args.gguf_embedding == "f32"]]
    runs = [(t, label, flags) for t in args.gguf_types for label, flags in variants]
    if args.imatrix_types:
        start = time.perf_counter()
        imatrix = llama_imatrix(f32, work / "calib.txt", args)
        print(f"llama-imatrix: {time.perf_counter() - start:.1f} s", flush=True)
        runs += [(t, ", imatrix", ["--imatrix", str(imatrix)]) for t in args.imatrix_types]
    for quant_type, label, flags in runs:
        suffix = "-embf32" if "--token-embedding-type" in flags else "-imatrix" if flags else ""
        out = f32.parent / f"model-{quant_type}{suffix}.gguf"
        start = time.perf_counter()
        cmd = [str(quantize), *flags, str(f32), str(out), quant_type, str(args.threads)]
        subprocess.run(cmd, check=True, capture_output=True)
        rows.append(gguf_row(f"llama.cpp {quant_type}{label}", out, time.perf_counter() - start, args, ids))
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


def retention_cell(row: Row) -> str:
    if row.retained is None or not row.fp_correct:
        return "-"
    return f"{row.retained}/{row.fp_correct} ({100 * row.retained / row.fp_correct:.0f} %)"


def issue44_lines(rows: list[Row]) -> list[str]:
    """Issue 44's bounds on the ascq rows: at most Q4_K_M's file size with at most the perplexity of Q4_K_M
    and of Q4_K_M with imatrix; at most 4.6 bits with at most 1.08x FP's perplexity; answer retention of at
    least 95 % for mixed entries (`mixed` in the row name) and 85 % for `awq-int4`."""
    by_name = {row.name: row for row in rows}
    fp = next((row for row in rows if row.name.startswith("FP")), None)
    k_quant, k_imatrix = by_name.get("llama.cpp Q4_K_M"), by_name.get("llama.cpp Q4_K_M, imatrix")
    lines = []
    for row in (r for r in rows if r.name.startswith("ascq ")):
        anchors = [a for a in (k_quant, k_imatrix) if a is not None and not math.isnan(a.ppl)]
        if (
            k_quant
            and k_quant.mib
            and row.mib
            and row.mib <= k_quant.mib
            and anchors
            and not math.isnan(row.ppl)
        ):
            verdict = "PASS" if all(row.ppl <= a.ppl for a in anchors) else "FAIL"
            lines.append(
                f"{verdict} {row.name} ({row.mib:.1f} MiB <= Q4_K_M's {k_quant.mib:.1f}) perplexity "
                f"{row.ppl:.3f} <= {' and '.join(f'{a.name} {a.ppl:.3f}' for a in anchors)}"
            )
        if fp and row.bits is not None and row.bits <= 4.6 and not math.isnan(row.ppl + fp.ppl):
            verdict = "PASS" if row.ppl <= 1.08 * fp.ppl else "FAIL"
            lines.append(
                f"{verdict} {row.name} at {row.bits:.3f} bits: perplexity {row.ppl:.3f} <= 1.08 x FP "
                f"(ratio {row.ppl / fp.ppl:.4f})"
            )
        floor = 0.95 if "mixed" in row.name else 0.85 if row.name.endswith("awq-int4") else None
        if floor is not None and row.retained is not None and row.fp_correct:
            verdict = "PASS" if row.retained >= floor * row.fp_correct else "FAIL"
            lines.append(f"{verdict} {row.name} retains >= {100 * floor:.0f} %: {retention_cell(row)}")
    return lines


def print_table(rows: list[Row], num_questions: int | None = None) -> None:
    fp = rows[0].ppl
    print(
        f"\n| row | ppl | vs FP | bits per weight | MiB | correct of {num_questions} | retained "
        "| conversion s | note |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        bits = f"{row.bits:.3f}" if row.bits is not None else "-"
        seconds = f"{row.seconds:.1f}" if row.seconds is not None else "-"
        mib = f"{row.mib:.1f}" if row.mib is not None else "-"
        correct = str(row.correct) if row.correct is not None else "-"
        print(
            f"| {row.name} | {row.ppl:.3f} | {row.ppl / fp:.4f} | {bits} | {mib} | {correct} | "
            f"{retention_cell(row)} | {seconds} | {row.note} |"
        )


def quant_types(value: str) -> tuple[str, ...]:
    """A comma-separated list of llama-quantize type names (checked by llama-quantize itself)."""
    types = tuple(t.strip() for t in value.split(",") if t.strip())
    if not all(re.fullmatch(r"[A-Za-z0-9_]+", t) for t in types):
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of llama-quantize types")
    return types


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="source checkpoint folder (FP)")
    parser.add_argument(
        "--llama-cpp",
        required=True,
        help="llama.cpp tree with build/bin/llama-quantize, llama-imatrix, llama-server",
    )
    parser.add_argument(
        "--entry",
        action="append",
        metavar="NAME=PATH",
        help="an ascq entry converted beforehand, scored as the row `ascq NAME` (repeatable; kind `entry`)",
    )
    parser.add_argument("--questions", default=str(answers.QUESTIONS), help="answer-retention question set")
    parser.add_argument(
        "--answer-tokens", type=int, default=answers.MAX_TOKENS, help="greedy tokens per answer"
    )
    parser.add_argument("--no-answers", action="store_true", help="perplexity only (no answer retention)")
    parser.add_argument("--no-perplexity", action="store_true", help="answer retention and sizes only")
    parser.add_argument(
        "--fp-answers",
        help="JSON file of FP's answers: read when it exists (same source, questions, length), else written; "
        "lets processes of one run (--only ...) share them",
    )
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
    parser.add_argument(
        "--gguf-types",
        type=quant_types,
        default=GGUF_TYPES,
        help=f"llama-quantize types (default {','.join(GGUF_TYPES)})",
    )
    parser.add_argument(
        "--imatrix-types",
        type=quant_types,
        default=IMATRIX_TYPES,
        help=f"types also quantized with llama-imatrix (default {','.join(IMATRIX_TYPES)}; '' for none)",
    )
    parser.add_argument(
        "--no-read-back", action="store_true", help="skip the F32 GGUF row (it reproduces FP's perplexity)"
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="print the rows of --json files together")
    args = parser.parse_args()
    if args.merge:
        rows = [Row(**r) for path in args.merge for r in json.loads(Path(path).read_text())["rows"]]
        num_questions = len(answers.load_questions(Path(args.questions)))
        print_table(sorted(rows, key=lambda r: not r.name.startswith("FP")), num_questions)  # FP first
        print("\n" + "\n".join(bound_lines({row.name: row for row in rows}) + issue44_lines(rows)))
        return
    kinds = set(args.only or ROW_KINDS)
    entries = answers.named_paths(args.entry, "--entry")
    if entries and "entry" not in kinds:
        sys.exit("--entry given but --only leaves out the `entry` rows")
    args.gguf_python = args.gguf_python or (
        args.llmc_python if Path(args.llmc_python).exists() else sys.executable
    )
    model, work = Path(args.model), Path(args.work)
    needed = [
        Path(args.llama_cpp) / "build" / "bin" / f"llama-{tool}" for tool in ("quantize", "imatrix", "server")
    ]
    needed = needed if "gguf" in kinds else []
    needed += [Path(args.llmc_python)] if kinds & {"llmc-awq", "llmc-gptq"} else []
    for path in needed:
        if not path.exists():
            sys.exit(f"{path} does not exist")
    source = prepare_work(work, model)

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ascq.quantize.calibration import load_calibration

    tokenizer = AutoTokenizer.from_pretrained(model)
    global BOS, SCORE_BATCH, SKIP_PERPLEXITY
    SCORE_BATCH, SKIP_PERPLEXITY = args.score_batch, args.no_perplexity
    if args.bos:
        BOS = tokenizer.bos_token_id
    calib = load_calibration(None, tokenizer, args.num_samples, args.seq_len)
    save_file({"input_ids": calib.input_ids.contiguous()}, work / "calib.safetensors")
    # the same blocks as text, for llama-imatrix (which tokenizes it again with the GGUF's vocabulary)
    (work / "calib.txt").write_text("".join(tokenizer.decode(block) for block in calib.input_ids))
    ids = load_eval_token_ids(model, EVAL_TEXT)
    print(f"eval: {EVAL_TEXT}, {ids.numel()} tokens, windows of {args.window}, bos {BOS}", flush=True)
    questions = answers.load_questions(Path(args.questions))
    args.answer_scorer = None
    if not args.no_answers:
        prompts = answers.chat_prompt_ids(tokenizer, questions)
        server = Path(args.llama_cpp) / "build" / "bin" / "llama-server"
        fp_answers = Path(args.fp_answers) if args.fp_answers else None
        args.answer_scorer = AnswerScorer(
            questions, prompts, args.answer_tokens, server, args.threads, fp_answers
        )
    # FP is answered by the bf16 source as users serve it (its perplexity is the fp32 copy's)
    rows = []
    if "fp" in kinds or args.answer_scorer:
        fp_row = Row(f"FP ({model.name})", hf_perplexity(source, ids, args.window), mib=weight_mib(model))
        fp_row = args.answer_scorer.fp(fp_row, model) if args.answer_scorer else fp_row
        print("row", json.dumps(asdict(fp_row)), flush=True)
        rows = [fp_row] if "fp" in kinds else []
    for name, entry in entries:
        rows.append(entry_row(f"ascq {name}", entry, args, ids))
        print("row", json.dumps(asdict(rows[-1])), flush=True)
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
        print_table(rows, len(questions))
    bounds = bound_lines({row.name: row for row in rows}) + issue44_lines(rows)
    print("\n" + "\n".join(bounds))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "bounds": bounds}, indent=1)
        )


if __name__ == "__main__":
    main()
