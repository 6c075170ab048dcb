"""Checkpoint loader: unquantized HF checkpoints and compressed-tensors zoo entries -> a runtime model.

Supported compressed-tensors formats: `int-quantized` (int8 weights, W8A8 static/dynamic) and `pack-quantized`
(int4/int8 packed in int32: W4A16 sym/asym, W8A16, W4A8), plus `kv_cache_scheme` (fp8 k/v scales). Which
linear gets which scheme and how its tensors unpack is `ascq.formats.compressed_tensors`. The model is built
on the meta device; tensors are read memory-mapped (`ascq.formats.safetensors.CheckpointReader`) and handed to
the layers' weight loaders.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.heap import trim_heap
from ascq.core.tensors import checkpoint_tensors
from ascq.formats import compressed_tensors as ct
from ascq.formats.byte_tokenizer import dummy_tokenizer
from ascq.formats.safetensors import CheckpointReader
from ascq.kernels import get_backend
from ascq.kernels import torch_device as backend_torch_device
from ascq.runtime.distributed.parallel import tp_world_size
from ascq.runtime.layers.moe import FusedMoE
from ascq.runtime.models import model_class_for
from ascq.runtime.models.weights import finalize_model, finalize_module
from ascq.runtime.worker.dummy import dummy_weights, has_tokenizer

SUPPORTED_SCHEMES = (
    "W8A8 (int8 static or dynamic per-token), W4A16, W8A16 (per-channel or group), W4A8 (dynamic)"
)


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AscqError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc


def served_scheme_name(scheme: Any) -> str:
    """compressed-tensors QuantizationScheme -> the kernels' scheme name, rejecting what no backend serves."""
    weights, acts = scheme.weights, scheme.input_activations
    if (
        weights is None
        or weights.type != "int"
        or weights.num_bits not in (4, 8)
        or scheme.output_activations
    ):
        raise UnsupportedError(
            f"quantization scheme {scheme.model_dump_json()} is not supported; supported: {SUPPORTED_SCHEMES}"
        )
    if weights.strategy not in ("channel", "group"):
        raise UnsupportedError(
            f"weight strategy {weights.strategy!r} is not supported; supported: channel, group"
        )
    if acts is not None and (acts.type != "int" or acts.num_bits != 8):
        raise UnsupportedError(
            f"activation quantization {acts.model_dump_json()} is not supported; supported: "
            f"{SUPPORTED_SCHEMES}"
        )
    name = ct.scheme_name(weights, acts)
    if name == "w4a8_static":
        raise UnsupportedError(
            f"W4A8 with static activations is not supported; supported: {SUPPORTED_SCHEMES}"
        )
    return name


class QuantConfig:
    """Which scheme each checkpoint linear uses, from config.json's `quantization_config`."""

    def __init__(self, raw: dict[str, Any]) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        if raw.get("quant_method") != "compressed-tensors":
            raise UnsupportedError(
                f"quantization method {raw.get('quant_method')!r} is not supported; supported: "
                f"compressed-tensors"
            )
        try:
            self.config = QuantizationConfig.model_validate(raw)
        except Exception as exc:  # pydantic's ValidationError: a malformed quantization_config
            raise AscqError(f"invalid quantization_config: {' '.join(str(exc).split())[:300]}") from exc
        self.groups = []
        for scheme in self.config.config_groups.values():
            fmt = scheme.format or self.config.format
            if scheme.weights is not None and fmt not in ct.SUPPORTED_FORMATS:
                raise UnsupportedError(
                    f"compressed-tensors format {fmt!r} is not supported; supported: "
                    f"{', '.join(ct.SUPPORTED_FORMATS)}"
                )
            self.groups.append((scheme, served_scheme_name(scheme), fmt))
        self.kv_cache_scheme = self.config.kv_cache_scheme

    def group_for(self, prefix: str) -> tuple[Any, str, str] | None:
        scheme = ct.match_scheme(prefix, self.config.config_groups.values(), list(self.config.ignore or []))
        return None if scheme is None else next(g for g in self.groups if g[0] is scheme)

    def scheme_for(self, prefix: str) -> str:
        group = self.group_for(prefix)
        return "dense" if group is None else group[1]


def iter_checkpoint(model_dir: Path, quant: QuantConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight; quantized linears come out in the signed-int convention
    (`ascq.formats.compressed_tensors.decompress_linear`: int8 `weight`, `weight_scale`, `zero_point`,
    ...). Each tensor in memory of its own: a view of the memory-mapped shard that the model kept (a norm, a
    scale) kept every page of the shard that the load read mapped and counted in the process's RSS after the
    load (deepseek-moe-16b awq-int4: 8.2 GiB of file pages beside 10.3 GiB of the model's own); the shards are
    read one at a time for the same reason (all of them mapped, the load peaked at 19.7 GiB)."""
    reader = CheckpointReader(model_dir)
    modules: dict[str, list[str]] = {}
    for name in sorted(reader):
        modules.setdefault(name.rpartition(".")[0], []).append(name)
    by_shard: dict[str, list[str]] = {}  # modules by the first shard holding them
    for prefix, names in modules.items():
        by_shard.setdefault(min(reader.file_of[n] for n in names), []).append(prefix)
    for shard in sorted(by_shard):
        # one shard mapped at a time (with what its modules spill into): the pages read stay counted in the
        # RSS while a file is mapped
        files = {reader.file_of[n] for prefix in by_shard[shard] for n in modules[prefix]}
        with reader.opened(files):
            for prefix in by_shard[shard]:
                yield from _module_tensors(reader, prefix, modules[prefix], quant)


def _module_tensors(
    reader: CheckpointReader, prefix: str, names: list[str], quant: QuantConfig | None
) -> Iterator[tuple[str, torch.Tensor]]:
    params = [n.rpartition(".")[2] for n in names]
    group = quant.group_for(prefix) if quant is not None else None
    if group is None or not ct.is_quantized(params):
        for name in names:
            yield name, reader.get(name).clone()
        return
    tensors = {param: reader.get(name) for param, name in zip(params, names, strict=True)}
    mapped = {t.untyped_storage().data_ptr() for t in tensors.values()}
    for param, tensor in ct.decompress_linear(tensors, group[0].weights.num_bits).items():
        # what decompress_linear passes through (scales, float zero points) is still the file's
        own = tensor.untyped_storage().data_ptr() not in mapped
        yield f"{prefix}.{param}", tensor if own else tensor.clone()


def load_model(
    model_dir: Path,
    device: str,
    dtype: torch.dtype,
    config: dict[str, Any] | None = None,
    prepare: Callable[[torch.nn.Module], Callable[[str], bool]] | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[torch.nn.Module, QuantConfig | None]:
    """Build the model on the meta device, stream the checkpoint into it (each linear's kernel weights are
    prepared as soon as its tensors are in), prepare the rest.

    `prepare(meta_model) -> keep(name)`: a pipeline stage drops the modules other stages own and loads only
    the tensors `keep` accepts. `load_format="dummy"`: random weights in the checkpoint's format
    (`dummy.dummy_weights`, seeded: every rank makes the same)."""
    config = config or read_config(model_dir)
    raw_quant = config.get("quantization_config") or config.get("compression_config")
    quant = QuantConfig(raw_quant) if raw_quant else None
    scheme_for = quant.scheme_for if quant is not None else (lambda prefix: "dense")
    torch_device = backend_torch_device(device)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    keep = prepare(model) if prepare is not None else (lambda name: True)
    source = (
        dummy_weights(config, quant, seed) if load_format == "dummy" else iter_checkpoint(model_dir, quant)
    )
    weights = ((name, t.to(torch_device)) for name, t in source if keep(name))
    backend = get_backend(device)

    def loaded(module: torch.nn.Module) -> None:
        finalize_module(module, backend, dtype, torch_device)
        if isinstance(module, FusedMoE):  # a MoE layer's unpacked experts were just freed
            trim_heap()

    copies_for = getattr(backend, "bf16_copies_for", None)  # the CPU backend's bf16 weight copies
    with copies_for(linear_bf16_bytes(config)) if copies_for else contextlib.nullcontext():
        model.load_weights(weights, scheme_for, loaded)
        finalize_model(model, backend, dtype, torch_device)
    return model.eval(), quant


def linear_bf16_bytes(config: dict[str, Any]) -> int:
    """The bytes this rank's projection linears (attention, MLP, experts) would take in bf16 (an even split
    across the tensor-parallel group)."""
    tensors = checkpoint_tensors(config)
    numel = sum(math.prod(shape) for name, shape in tensors if name.endswith("_proj.weight"))
    return 2 * numel // tp_world_size()


def load_tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise AscqError(f"cannot load a tokenizer from {path}: {' '.join(str(exc).split())[:200]}") from exc


def engine_tokenizer(args: Any) -> Any:
    """The tokenizer an engine serves with: `args.tokenizer`, else the model folder's; with load_format dummy
    and a folder that has none, `byte_tokenizer.dummy_tokenizer` over the config's vocabulary."""
    if args.tokenizer is None and args.load_format == "dummy" and not has_tokenizer(args.model):
        return dummy_tokenizer(int(read_config(args.model)["vocab_size"]))
    return load_tokenizer(args.tokenizer or args.model)
