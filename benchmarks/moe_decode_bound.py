"""The physical limit of batch-1 decode of a (MoE) zoo entry on this machine: weight bytes a token reads over
the measured memory bandwidth, and the fraction of it a measured decode speed reaches.

    OMP_NUM_THREADS=2 python benchmarks/moe_decode_bound.py ENTRY [--tok-s 11.9]

Bytes per token, from the entry's own safetensors (as stored: packed int4, scales, zero points): every
tensor of the decoder layers, except that a routed expert's tensors count num_experts_per_tok /
n_routed_experts of their bytes (a token reads its top-k experts; at batch 1 no other); the LM head whole; of
the embedding one row. KV cache reads are left out (small at short contexts). Bandwidth: the copy probe
of benchmarks/decode.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import measure_bandwidth_gbs  # noqa: E402

ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def tensor_bytes(entry: Path) -> dict[str, int]:
    sizes = {}
    for path in sorted(entry.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for dim in piece.get_shape():
                    numel *= dim
                sizes[name] = numel * _element_size(piece.get_dtype())
    return sizes


def _element_size(dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I8": 1, "U8": 1, "I64": 8, "F8_E4M3": 1}[dtype]


def bytes_per_token(entry: Path) -> dict[str, float]:
    config = json.loads((entry / "config.json").read_text())
    routed_share = config.get("num_experts_per_tok", 0) / max(config.get("n_routed_experts") or 1, 1)
    parts = {"routed experts": 0.0, "other layers": 0.0, "lm head": 0.0, "embedding row": 0.0}
    for name, nbytes in tensor_bytes(entry).items():
        if name.startswith("model.embed_tokens."):
            parts["embedding row"] += nbytes / config["vocab_size"]
        elif name.startswith("lm_head."):
            parts["lm head"] += nbytes
        elif ROUTED_EXPERT.search(name):
            parts["routed experts"] += nbytes * routed_share
        else:
            parts["other layers"] += nbytes
    if config.get("tie_word_embeddings"):
        parts["lm head"] += parts["embedding row"] * config["vocab_size"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("entry", type=Path)
    parser.add_argument("--tok-s", type=float, help="a measured batch-1 decode speed to compare")
    args = parser.parse_args()
    parts = bytes_per_token(args.entry)
    total = sum(parts.values())
    bandwidth = measure_bandwidth_gbs()
    bound = bandwidth * 1e9 / total
    print("\n".join(f"{name}: {value / 1e6:.0f} MB" for name, value in parts.items()))
    print(f"bytes per token {total / 1e9:.3f} GB; copy bandwidth {bandwidth:.1f} GB/s: {bound:.1f} tok/s")
    if args.tok_s:
        print(f"measured {args.tok_s:.2f} tok/s = {args.tok_s / bound:.0%} of the bound")


if __name__ == "__main__":
    main()
