"""Write compressed-tensors checkpoints exactly as the pinned compressed-tensors library does.

Each quantized linear goes through `ascq.formats.compressed_tensors.compress_linear` (the library's own
compressor for its format), so bytes and tensor names follow the installed version. `config.json` gets its
`quantization_config` from `ModelCompressor.update_config`. Tensors are written shard by shard as the layers
stream through.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file

from ascq.formats import QuantizedLinear
from ascq.formats import compressed_tensors as ct
from ascq.formats.safetensors import INDEX_SUFFIX
from ascq.quantize.schemes import LinearTarget, RecipeScheme, compression_format

log = logging.getLogger(__name__)
TESTED_COMPRESSED_TENSORS = "0.20.1"


def check_library_version() -> None:
    if compressed_tensors.__version__ != TESTED_COMPRESSED_TENSORS:
        log.warning(
            "compressed-tensors %s is installed; ascq's checkpoints are tested with %s (formats differ "
            "between "
            "releases, e.g. asymmetric zero-point packing)",
            compressed_tensors.__version__,
            TESTED_COMPRESSED_TENSORS,
        )


class ShardWriter:
    """Collects tensors and writes a shard whenever `max_shard_bytes` is reached; `finish` names them
    HF-style."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.shards):
            raise ValueError(f"tensor {name} written twice")
        tensor = tensor.detach().to("cpu").contiguous()
        self.pending[name] = tensor
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_shard_bytes:
            self.flush()

    def add_linear(
        self, name: str, target: LinearTarget, ql: QuantizedLinear, bias: torch.Tensor | None
    ) -> None:
        """A quantized linear's tensors under `name.` (the format hook: msmodelslim.MsModelSlimWriter
        overrides it)."""
        for key, tensor in ct.compress_linear(target.weights, target.input_activations, ql, bias).items():
            self.add(f"{name}.{key}", tensor)

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"part-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, self.out_dir / file, metadata={"format": "pt"})
        self.shards.append((file, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self, stem: str = "model") -> list[str]:
        """Rename shards to `{stem}.safetensors` or `{stem}-0000i-of-0000n.safetensors` (+ index); the file
        names."""
        self.flush()
        single = len(self.shards) == 1
        weight_map, files = {}, []
        for i, (file, names) in enumerate(self.shards, start=1):
            final = (
                f"{stem}.safetensors" if single else f"{stem}-{i:05d}-of-{len(self.shards):05d}.safetensors"
            )
            (self.out_dir / file).rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
            files.append(final)
        if not single:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.out_dir / f"{stem}{INDEX_SUFFIX}").write_text(json.dumps(index, indent=2) + "\n")
        return files


def quantization_config(
    schemes: list[RecipeScheme], fallback_targets: dict[str, LinearTarget], ignore: list[str]
) -> QuantizationConfig:
    """The checkpoint's quantization_config: the recipe's groups, one exact-name group per fallback,
    `ignore`."""
    groups: dict[str, QuantizationScheme] = {}
    for recipe_scheme in schemes:
        for scheme in recipe_scheme.config_groups.values():
            groups[f"group_{len(groups)}"] = scheme
    by_args: dict[str, list[str]] = {}
    for name, target in fallback_targets.items():
        by_args.setdefault(target.weights.model_dump_json(), []).append(name)
    for names in by_args.values():
        target = fallback_targets[names[0]]
        groups[f"group_{len(groups)}"] = QuantizationScheme(
            targets=names, weights=target.weights, input_activations=target.input_activations
        )
    formats = set()
    for scheme in groups.values():
        fmt = compression_format(LinearTarget(scheme.weights, scheme.input_activations, schemes[0]))
        scheme.format = fmt
        formats.add(fmt)
    kv = next((s.kv_cache_scheme for s in schemes if s.kv_cache_scheme is not None), None)
    return QuantizationConfig(
        config_groups=groups,
        format=formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense"),
        ignore=ignore,
        kv_cache_scheme=kv,
        quantization_status="compressed",
    )


def write_config(out_dir: Path, source_config: dict, qconfig: QuantizationConfig) -> None:
    """config.json = the source config + quantization_config, written by compressed-tensors itself."""
    (out_dir / "config.json").write_text(json.dumps(source_config, indent=2) + "\n")
    ModelCompressor(quantization_config=qconfig).update_config(str(out_dir))
