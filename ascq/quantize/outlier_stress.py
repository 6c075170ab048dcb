"""Outlier-stress variant of a checkpoint: a STRESS TEST for quantizers, not a real model.

Real LLMs carry a few activation channels 20-100x larger than the rest (Dettmers et al. 2022; Sun et al.
2024); small trained fixtures may not. This transform plants such channels without changing the model's
function: for a few chosen hidden channels c, every RMSNorm weight (`input_layernorm`,
`post_attention_layernorm`) is multiplied by k at c and the matching input columns of the linears that read
that norm (q/k/v; gate/up of the MLP, of every routed and shared expert, and the MoE router) are divided by k.
In exact arithmetic the logits are unchanged; the norm outputs now hold k-times-larger channels, which is what
activation-aware quantizers handle.

    python -m ascq.quantize.outlier_stress zoo/tiny-llama /tmp/tiny-llama-outlier-stress
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ascq.core.errors import AscqError
from ascq.formats.manifest import new_manifest, staged_entry, write_manifest
from ascq.reference.deepseek_moe import load_state_dict_files

DEFAULT_K = 30.0
DEFAULT_NUM_CHANNELS = 4
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ATTN_CONSUMERS = re.compile(r"^self_attn\.[qkv]_proj\.weight$")
_MLP_CONSUMERS = re.compile(r"^mlp\.(gate\.weight|(.+\.)?(gate|up)_proj\.weight)$")


def choose_channels(hidden_size: int, num_channels: int = DEFAULT_NUM_CHANNELS, seed: int = 0) -> list[int]:
    """A fixed, seeded set of hidden channels (the same in every layer, as real outlier channels are)."""
    if not 0 < num_channels <= hidden_size:
        raise AscqError(f"outlier stress: num_channels must be in 1..{hidden_size}, got {num_channels}")
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(hidden_size, generator=generator)[:num_channels].tolist())


def _scaled(tensor: torch.Tensor, channels: list[int], factor: float, columns: bool) -> torch.Tensor:
    out = tensor.float().clone()
    if columns:
        out[:, channels] *= factor
    else:
        out[channels] *= factor
    return out.to(tensor.dtype)


def with_outlier_channels(name: str, tensor: torch.Tensor, channels: list[int], k: float) -> torch.Tensor:
    """One checkpoint tensor under the transform: a decoder norm's weight x k at `channels`, a linear that
    reads that norm with those input columns / k, any other tensor as it is (the same object)."""
    match = _LAYER.match(name)
    if not match:
        return tensor
    local = match.group(2)
    if local in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return _scaled(tensor, channels, k, columns=False)
    if _ATTN_CONSUMERS.match(local) or _MLP_CONSUMERS.match(local):
        return _scaled(tensor, channels, 1.0 / k, columns=True)
    return tensor


def add_outlier_channels(
    state: dict[str, torch.Tensor], channels: list[int], k: float = DEFAULT_K
) -> dict[str, torch.Tensor]:
    """A new state dict with norm weights x k at `channels` and the consuming linears' columns / k."""
    if k <= 0:
        raise AscqError(f"outlier stress: k must be positive, got {k}")
    out = dict(state)
    num_norms = 0
    for name, tensor in state.items():
        out[name] = with_outlier_channels(name, tensor, channels, k)
        num_norms += out[name] is not tensor and name.endswith("layernorm.weight")
    if num_norms == 0:
        raise AscqError("outlier stress: no model.layers.N.{input,post_attention}_layernorm weights found")
    return out


def write_outlier_stress(
    src: str | Path,
    out: str | Path,
    k: float = DEFAULT_K,
    num_channels: int = DEFAULT_NUM_CHANNELS,
    seed: int = 0,
) -> Path:
    """Write the stress variant of the checkpoint folder `src` to `out` (a zoo entry with its manifest)."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise AscqError(f"{src}: config.json is missing (not a checkpoint folder)")
    config = json.loads((src / "config.json").read_text())
    channels = choose_channels(config["hidden_size"], num_channels, seed)
    state = add_outlier_channels(load_state_dict_files(src), channels, k)
    with staged_entry(out) as staging:
        for path in src.iterdir():
            if path.is_file() and not path.name.endswith(
                (".safetensors", ".safetensors.index.json", ".json.lock")
            ):
                if path.name != "ascq.json":
                    shutil.copy2(path, staging / path.name)
        save_file(
            {n: t.contiguous() for n, t in state.items()},
            staging / "model.safetensors",
            metadata={"format": "pt"},
        )
        manifest = new_manifest(
            out.name,
            source={"model": str(src), "revision": None},
            base_model=src.name,
            format="hf",
            scheme="dense",
            stress_test={
                "kind": "outlier-stress (function-preserving; NOT a real model)",
                "k": k,
                "channels": channels,
            },
        )
        write_manifest(staging, manifest)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--k", type=float, default=DEFAULT_K)
    parser.add_argument("--num-channels", type=int, default=DEFAULT_NUM_CHANNELS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(write_outlier_stress(args.src, args.out, args.k, args.num_channels, args.seed))
    except AscqError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
