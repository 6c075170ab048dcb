"""Synthetic checkpoints with real tensor names and shapes and random weights, for streaming tests and
benchmarks.

Written tensor by tensor into shards (never a whole model in memory), with a byte-level tokenizer, so
`ascq convert` runs on them exactly as on a downloaded checkpoint. Not a model: the weights are noise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ascq.core.tensors import DUMMY_WEIGHT_STD, checkpoint_tensors
from ascq.formats.byte_tokenizer import byte_level_tokenizer, dummy_tokenizer
from ascq.quantize.ct_writer import ShardWriter
from ascq.quantize.outlier_stress import DEFAULT_K as OUTLIER_K
from ascq.quantize.outlier_stress import choose_channels, with_outlier_channels

EOS = "<|endoftext|>"
LAYER_STD_SPREAD = 0.3
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def write_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with no merges (257 tokens: 256 bytes + `<|endoftext|>` = id 256)."""
    byte_level_tokenizer([EOS], eos=EOS, bos=EOS).save_pretrained(out_dir)


def write_synthetic_checkpoint(
    out_dir: Path,
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 2 << 30,
    trained_like: bool = False,
) -> int:
    """Write config.json, tokenizer and random-weight shards; returns the checkpoint's size in bytes.

    `trained_like`: weights drawn like a trained model's instead of one N(0, 0.02): each layer its own
    scale, and a few hidden channels carry activation outliers (`outlier_stress`: the norms x k there, the
    linears that read them / k), so AWQ and GPTQ have something to correct; the tokenizer then covers the
    whole vocabulary and has a chat template, so the converted entry serves chat requests."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if trained_like:
        dummy_tokenizer(int(config["vocab_size"])).save_pretrained(out_dir)
    else:
        write_byte_tokenizer(out_dir)
    generator = torch.Generator().manual_seed(seed)
    layer_std = _layer_stds(int(config["num_hidden_layers"]), generator) if trained_like else None
    channels = choose_channels(int(config["hidden_size"]), seed=seed) if trained_like else []
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, shape in checkpoint_tensors(config):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        else:
            layer = _LAYER_INDEX.match(name)
            std = layer_std[int(layer.group(1))] if layer_std is not None and layer else DUMMY_WEIGHT_STD
            tensor = (torch.randn(shape, generator=generator) * std).to(dtype)
        writer.add(name, with_outlier_channels(name, tensor, channels, OUTLIER_K) if channels else tensor)
    writer.finish()
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


def _layer_stds(num_layers: int, generator: torch.Generator) -> list[float]:
    """Per-layer weight scales spread around DUMMY_WEIGHT_STD (log-normal, sigma LAYER_STD_SPREAD)."""
    spread = torch.randn(num_layers, generator=generator) * LAYER_STD_SPREAD
    return (DUMMY_WEIGHT_STD * spread.exp()).tolist()
