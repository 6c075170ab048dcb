"""A Hugging Face checkpoint -> llama.cpp Q4_0 GGUF of the same weights, with llama.cpp's own tools:
`convert_hf_to_gguf.py --outtype q8_0`, then `llama-quantize --allow-requantize Q8_0 -> Q4_0` (the issue's
route; llama.cpp's converter writes no Q4_0 itself), deleting the Q8_0 intermediate to keep the disk budget.

    python benchmarks/llamacpp_gguf.py SOURCE --out DIR/model-Q4_0.gguf --llama-cpp PATH/llama.cpp \
        --python PATH/venv/bin/python [--tokenizer-from zoo/smollm2-135m-instruct] [--delete-source]

llama.cpp's converter names a BPE tokenizer by a hash of its pre-tokenizer's output and refuses one it does
not know, such as the byte-level tokenizer of `ascq zoo dummy`'s synthetic sources. `--tokenizer-from` takes
another checkpoint's tokenizer files instead (padded to the model's vocabulary by the converter): the weights
are the source's, only the GGUF's text vocabulary differs, which speed benchmarks driven with token ids (see
vs_llamacpp.py) never read. `--delete-source` removes SOURCE once the Q8_0 file is written (only with the
flag: a full-shape bf16 source, the Q8_0 and the Q4_0 may not fit the disk together).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def staged_source(source: Path, staging: Path, tokenizer_from: Path | None) -> Path:
    """A folder of links to the source's config and tensors, and the tokenizer files to convert with."""
    staging.mkdir(parents=True)
    for path in source.iterdir():
        if path.name == "config.json" or path.name.endswith((".safetensors", ".safetensors.index.json")):
            (staging / path.name).symlink_to(path.resolve())
    tokenizer_dir = tokenizer_from or source
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, staging / name)
    return staging


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the Q4_0 .gguf to write (must not exist)")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree, built")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch for the converter")
    parser.add_argument("--tokenizer-from", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--delete-source", action="store_true")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; remove it first")
    llama_quantize = args.llama_cpp / "build/bin/llama-quantize"
    if not llama_quantize.is_file():  # checked first: the Q8_0 conversion takes minutes
        parser.error(f"{llama_quantize} not found; build it (cmake --build build --target llama-quantize)")
    q8 = args.out.with_name(args.out.stem + ".Q8_0-intermediate.gguf")
    staging = args.out.with_name(args.out.stem + ".hf-staging")
    try:
        staged_source(args.source, staging, args.tokenizer_from)
        convert = [args.python, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(staging)]
        convert_s = timed(convert + ["--outtype", "q8_0", "--outfile", str(q8)])
        q8_bytes = q8.stat().st_size
        shutil.rmtree(staging)
        if args.delete_source:
            shutil.rmtree(args.source)
        quantize = [str(llama_quantize), "--allow-requantize", str(q8)]
        quantize_s = timed(quantize + [str(args.out), "Q4_0", str(args.threads)])
    finally:
        q8.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    q4_gib = args.out.stat().st_size / 2**30
    print(f"Q8_0 {q8_bytes / 2**30:.2f} GiB, {convert_s:.0f} s; Q4_0 {q4_gib:.2f} GiB, {quantize_s:.0f} s")


if __name__ == "__main__":
    main()
