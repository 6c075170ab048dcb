"""Checkpoint loader: unquantized HF checkpoints and compressed-tensors zoo entries -> a runtime model.

Supported compressed-tensors formats: `int-quantized` (int8 weights, W8A8 static/dynamic) and `pack-quantized`
(int4/int8 packed in int32: W4A16 sym/asym, W8A16, W4A8), plus `kv_cache_scheme` (fp8 k/v scales). Packed weights
are unpacked with compressed-tensors' own `unpack_from_int32`. The model is built on the meta device; tensors are
read memory-mapped from safetensors one at a time and handed to the layers' weight loaders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ascq.errors import AscqError, UnsupportedError
from ascq.kernels import get_backend
from ascq.kernels import torch_device as backend_torch_device
from ascq.runtime.models import model_class_for
from ascq.runtime.models.weights import finalize_model

SUPPORTED_FORMATS = ("int-quantized", "pack-quantized")
SUPPORTED_SCHEMES = "W8A8 (int8 static or dynamic per-token), W4A16, W8A16 (per-channel or group), W4A8 (dynamic)"


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AscqError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc


def scheme_name(scheme: Any) -> str:
    """compressed-tensors QuantizationScheme -> the kernels' scheme name."""
    weights, acts = scheme.weights, scheme.input_activations
    if weights is None or weights.type != "int" or weights.num_bits not in (4, 8) or scheme.output_activations:
        raise UnsupportedError(f"quantization scheme {scheme.model_dump_json()} is not supported; supported: {SUPPORTED_SCHEMES}")
    if weights.strategy not in ("channel", "group"):
        raise UnsupportedError(f"weight strategy {weights.strategy!r} is not supported; supported: channel, group")
    if acts is None:
        return f"w{weights.num_bits}a16"
    if acts.type != "int" or acts.num_bits != 8:
        raise UnsupportedError(f"activation quantization {acts.model_dump_json()} is not supported; supported: {SUPPORTED_SCHEMES}")
    if weights.num_bits == 8:
        return "w8a8_dynamic" if acts.dynamic else "w8a8_static"
    if acts.dynamic:
        return "w4a8_dynamic"
    raise UnsupportedError(f"W4A8 with static activations is not supported; supported: {SUPPORTED_SCHEMES}")


def _matches(prefix: str, patterns: list[str], linear_class_names: tuple[str, ...] = ()) -> bool:
    for pattern in patterns:
        if pattern in linear_class_names:
            return True
        if pattern.startswith("re:"):
            if re.match(pattern[3:], prefix):
                return True
        elif prefix == pattern or prefix.endswith("." + pattern):
            return True
    return False


class QuantConfig:
    """Which scheme each checkpoint linear uses, from config.json's `quantization_config`."""

    def __init__(self, raw: dict[str, Any]) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        if raw.get("quant_method") != "compressed-tensors":
            raise UnsupportedError(
                f"quantization method {raw.get('quant_method')!r} is not supported; supported: compressed-tensors"
            )
        try:
            self.config = QuantizationConfig.model_validate(raw)
        except Exception as exc:  # pydantic's ValidationError: a malformed quantization_config
            raise AscqError(f"invalid quantization_config: {' '.join(str(exc).split())[:300]}") from exc
        self.groups = []
        for scheme in self.config.config_groups.values():
            fmt = scheme.format or self.config.format
            if scheme.weights is not None and fmt not in SUPPORTED_FORMATS:
                raise UnsupportedError(
                    f"compressed-tensors format {fmt!r} is not supported; supported: {', '.join(SUPPORTED_FORMATS)}"
                )
            self.groups.append((scheme, scheme_name(scheme), fmt))
        self.kv_cache_scheme = self.config.kv_cache_scheme

    def group_for(self, prefix: str) -> tuple[Any, str, str] | None:
        if _matches(prefix, self.config.ignore or []):
            return None
        for group in self.groups:
            if _matches(prefix, group[0].targets, ("Linear",)):
                return group
        return None

    def scheme_for(self, prefix: str) -> str:
        group = self.group_for(prefix)
        return "dense" if group is None else group[1]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise AscqError(f"{model_dir} has no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def iter_checkpoint(model_dir: Path, quant: QuantConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight, memory-mapped; packed int weights come out unpacked as int8 `*.weight`.

    A linear's tensors may sit in different shards, so every shard stays open while iterating.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt", device="cpu")) for path in checkpoint_files(model_dir)]
        owner = {name: f for f in handles for name in f.keys()}
        for name in sorted(owner):
            if name.endswith(".weight_shape"):
                continue
            prefix = name.rsplit(".", 1)[0]
            group = quant.group_for(prefix) if quant is not None else None
            packed = group is not None and group[2] == "pack-quantized" and f"{prefix}.weight_packed" in owner
            tensor = owner[name].get_tensor(name)
            if packed and name.endswith((".weight_packed", ".weight_zero_point")):
                shape = owner[f"{prefix}.weight_shape"].get_tensor(f"{prefix}.weight_shape").tolist()
                num_bits = group[0].weights.num_bits
                if name.endswith(".weight_packed"):
                    yield f"{prefix}.weight", unpack_from_int32(tensor, num_bits, shape)
                    continue
                num_groups = owner[f"{prefix}.weight_scale"].get_slice(f"{prefix}.weight_scale").get_shape()[-1]
                yield name, unpack_from_int32(tensor, num_bits, [shape[0], num_groups], packed_dim=0)
                continue
            yield name, tensor


def load_model(
    model_dir: Path, device: str, dtype: torch.dtype, config: dict[str, Any] | None = None,
    prepare: Callable[[torch.nn.Module], Callable[[str], bool]] | None = None,
) -> tuple[torch.nn.Module, QuantConfig | None]:
    """Build the model on the meta device, stream the checkpoint into it, prepare the kernels' weights.

    `prepare(meta_model) -> keep(name)`: a pipeline stage drops the modules other stages own and loads only the
    tensors `keep` accepts."""
    config = config or read_config(model_dir)
    raw_quant = config.get("quantization_config") or config.get("compression_config")
    quant = QuantConfig(raw_quant) if raw_quant else None
    scheme_for = quant.scheme_for if quant is not None else (lambda prefix: "dense")
    torch_device = backend_torch_device(device)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    keep = prepare(model) if prepare is not None else (lambda name: True)
    weights = ((name, t.to(torch_device)) for name, t in iter_checkpoint(model_dir, quant) if keep(name))
    model.load_weights(weights, scheme_for)
    finalize_model(model, get_backend(device), dtype, torch_device)
    return model.eval(), quant
