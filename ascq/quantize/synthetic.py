"""Synthetic checkpoints with real tensor names and shapes and random weights, for streaming tests and
benchmarks.

Written tensor by tensor into shards (never a whole model in memory), with a byte-level tokenizer, so
`ascq convert` runs on them exactly as on a downloaded checkpoint. Not a model: the weights are noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ascq.core.tensors import checkpoint_tensors
from ascq.formats.byte_tokenizer import byte_level_tokenizer
from ascq.quantize.ct_writer import ShardWriter

EOS = "<|endoftext|>"


def write_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with no merges (257 tokens: 256 bytes + `<|endoftext|>` = id 256)."""
    byte_level_tokenizer([EOS], eos=EOS, bos=EOS).save_pretrained(out_dir)


def write_synthetic_checkpoint(
    out_dir: Path,
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 2 << 30,
) -> int:
    """Write config.json, tokenizer and random-weight shards; returns the checkpoint's size in bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_byte_tokenizer(out_dir)
    generator = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, shape in checkpoint_tensors(config):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
        writer.add(name, tensor)
    writer.finish()
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))
