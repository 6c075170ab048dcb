"""`ascq zoo dummy`: a full-shape synthetic bf16 source checkpoint of an entry's architecture, for conversion
and serving benchmarks at real shape where the real weights cannot be downloaded.

The weights are drawn like a trained model's (`synthetic.write_synthetic_checkpoint(trained_like=True)`), but
they are noise: the manifest and the card say SYNTHETIC, and so do the entries converted from it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ascq.formats.manifest import (
    check_output,
    new_manifest,
    read_manifest,
    resolve_entry,
    staged_entry,
    write_manifest,
)
from ascq.quantize.outlier_stress import DEFAULT_K, DEFAULT_NUM_CHANNELS
from ascq.quantize.synthetic import LAYER_STD_SPREAD, write_synthetic_checkpoint

GIB = 1 << 30
SYNTHETIC_KIND = "random weights drawn like a trained model's; NOT a model: for shape, memory and speed only"


def write_synthetic_source(
    entry: str | Path, out: str | Path, seed: int = 0, overwrite: bool = False, max_shard_gib: float = 4.0
) -> Path:
    """Write the synthetic checkpoint of `entry`'s config.json (a planned entry's config is enough) to
    `out`, atomically; an existing `out` is kept unless `overwrite`."""
    entry_dir, out = resolve_entry(entry), Path(out)
    check_output(out, [entry_dir], overwrite)
    config = json.loads((entry_dir / "config.json").read_text())
    for key in ("quantization_config", "compression_config"):
        config.pop(key, None)
    source = read_manifest(entry_dir) if (entry_dir / "ascq.json").is_file() else {}
    start = time.perf_counter()
    with staged_entry(out, overwrite, [entry_dir]) as staging:
        write_synthetic_checkpoint(
            staging, config, seed=seed, max_shard_bytes=int(max_shard_gib * GIB), trained_like=True
        )
        write_manifest(staging, _manifest(out.name, source, seed, time.perf_counter() - start))
    from ascq.zoo.card import write_card

    write_card(out)
    return out


def _manifest(name: str, source: dict[str, Any], seed: int, seconds: float) -> dict[str, Any]:
    base = source.get("base_model") or (source.get("source") or {}).get("model") or source.get("name")
    return new_manifest(
        name,
        source={"model": source.get("name") or base, "revision": None},
        base_model=base,
        license=source.get("license"),
        format="hf",
        scheme="dense",
        synthetic={
            "kind": SYNTHETIC_KIND,
            "seed": seed,
            "layer_std_spread": LAYER_STD_SPREAD,
            "outlier_channels": DEFAULT_NUM_CHANNELS,
            "outlier_k": DEFAULT_K,
            "write_seconds": round(seconds, 1),
        },
    )
