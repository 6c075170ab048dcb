"""`ascq zoo verify`: an entry's files match its manifest, its config and tokenizer load, and its tensor names
are what its format says (compressed-tensors: each config group's compressor's parameter names; msModelSlim:
the description JSON; hf: plain float weights). Every check raises AscqError naming the first mismatch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.formats import compressed_tensors as ct
from ascq.formats import msmodelslim as ms
from ascq.formats.manifest import read_manifest, verify_files
from ascq.formats.safetensors import CheckpointReader
from ascq.zoo.planned import require_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def verify_entry(entry_dir: Path) -> list[str]:
    """Run every check; returns one line per check passed, raises AscqError at the first failure."""
    entry_dir = Path(entry_dir)
    manifest = read_manifest(entry_dir)
    verify_files(entry_dir, manifest)
    passed = [f"{len(manifest.get('files') or {})} files match the manifest (size + sha256)"]
    require_weights(entry_dir)
    config = _check_config(entry_dir)
    passed.append(f"config.json loads (model_type {config['model_type']})")
    passed.append(f"tokenizer loads ({_check_tokenizer(entry_dir)})")
    reader = CheckpointReader(entry_dir)
    tensors = {name: reader.tensor_info(name) for name in reader}
    passed.append(_check_format(entry_dir.name, manifest.get("format", "hf"), config, tensors, reader))
    return passed


def _check_config(entry_dir: Path) -> dict[str, Any]:
    path = entry_dir / "config.json"
    if not path.is_file():
        raise AscqError(f"{entry_dir.name}: config.json is missing")
    try:
        config = json.loads(path.read_text())
        if config.get("model_type") == "deepseek":  # no transformers class; ascq's own reference config
            from ascq.core.families.deepseek import DeepseekConfig

            DeepseekConfig.from_dict(config)
        else:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(entry_dir, trust_remote_code=False)
    except Exception as exc:  # any failure to load is the entry's fault
        raise AscqError(
            f"{entry_dir.name}: config.json does not load: {' '.join(str(exc).split())[:300]}"
        ) from None
    return config


def _check_tokenizer(entry_dir: Path) -> str:
    if not any((entry_dir / name).is_file() for name in TOKENIZER_FILES):
        raise AscqError(f"{entry_dir.name}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(entry_dir, trust_remote_code=False)
        tokenizer("verify")
    except Exception as exc:
        raise AscqError(
            f"{entry_dir.name}: tokenizer does not load: {' '.join(str(exc).split())[:300]}"
        ) from None
    return f"{type(tokenizer).__name__}, vocab {len(tokenizer)}"


def read_tensor_infos(entry_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) over every shard (the reader checks the shard index)."""
    reader = CheckpointReader(entry_dir)
    return {name: reader.tensor_info(name) for name in reader}


def _modules(
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    modules: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = defaultdict(dict)
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        modules[module][param] = info
    return modules


def _linear_modules(modules: dict[str, dict[str, Any]]) -> list[str]:
    """Modules holding a 2-D (or packed) weight, except embeddings."""
    return sorted(
        m for m, params in modules.items() if ct.is_linear_module(params) and not m.endswith("embed_tokens")
    )


def _check_format(
    name: str, fmt: str, config: dict[str, Any], tensors: dict, reader: CheckpointReader
) -> str:
    if fmt == "compressed-tensors":
        return _check_compressed_tensors(name, config, tensors, reader)
    if fmt == "msmodelslim":
        return _check_msmodelslim(name, tensors, reader.model_dir)
    if fmt == "hf":
        for tensor, (dtype, _) in sorted(tensors.items()):
            if tensor.rpartition(".")[2] in ct.QUANTIZED_PARAMS or not dtype.startswith(("F", "BF")):
                raise AscqError(
                    f"{name}: tensor {tensor} ({dtype}) is quantized, but the manifest says format hf"
                )
        return f"{len(tensors)} tensors are plain float weights (format hf)"
    raise AscqError(f"{name}: unknown format '{fmt}' in the manifest (hf, compressed-tensors, msmodelslim)")


def _check_compressed_tensors(
    name: str, config: dict[str, Any], tensors: dict, reader: CheckpointReader
) -> str:
    from compressed_tensors.quantization import QuantizationConfig

    qc_dict = config.get("quantization_config") or {}
    if qc_dict.get("quant_method") != "compressed-tensors":
        raise AscqError(
            f"{name}: config.json has no quantization_config with quant_method compressed-tensors"
        )
    try:
        qc = QuantizationConfig.model_validate(qc_dict)
    except Exception as exc:  # pydantic's validation error
        raise AscqError(
            f"{name}: quantization_config is invalid: {' '.join(str(exc).split())[:300]}"
        ) from None
    modules = _modules(tensors)
    num_quantized = 0
    for module in _linear_modules(modules):
        params = modules[module]
        ignored = ct.is_ignored(module, list(qc.ignore or []))
        scheme = ct.match_scheme(module, qc.config_groups.values(), list(qc.ignore or []))
        if scheme is None:
            if "weight" not in params or set(params) & set(ct.QUANTIZED_PARAMS):
                why = "is in the ignore list" if ignored else "matches no config group"
                raise AscqError(
                    f"{name}: {module} {why} but is stored quantized ({', '.join(sorted(params))})"
                )
            continue
        fmt = scheme.format or qc.format
        _check_linear(name, module, params, scheme, fmt, reader)
        num_quantized += 1
    if qc.kv_cache_scheme is not None:
        for module in sorted(m for m in modules if m.endswith("self_attn")):
            missing = sorted({"k_scale", "v_scale"} - set(modules[module]))
            if missing:
                raise AscqError(f"{name}: kv_cache_scheme is set but {module} lacks {', '.join(missing)}")
    if num_quantized == 0:
        raise AscqError(f"{name}: quantization_config is set but no linear is quantized")
    return f"tensor names match compressed-tensors ({num_quantized} quantized linears, format {qc.format})"


def _check_linear(
    name: str, module: str, params: dict, scheme: Any, fmt: str, reader: CheckpointReader
) -> None:
    """The linear's tensors are the names (and, for the formats ascq writes, the dtypes and shapes) it
    stores."""
    required = ct.required_params(scheme, fmt)
    missing = sorted(required - set(params))
    if missing:
        raise AscqError(
            f"{name}: {module} lacks {', '.join(missing)} required by format {fmt} (has "
            f"{', '.join(sorted(params))})"
        )
    if fmt not in ct.SUPPORTED_FORMATS:
        return
    out_features, in_features = ct.stored_shape(params, lambda param: reader.get(f"{module}.{param}"))
    expected = ct.linear_tensor_specs(
        scheme.weights, scheme.input_activations, out_features, in_features, params["weight_scale"][0]
    )
    for param, (dtype, shape) in expected.items():
        if params.get(param, (dtype, shape)) != (dtype, shape):
            raise AscqError(
                f"{name}: {module}.{param} is {params[param][0]} {list(params[param][1])}, "
                f"format {fmt} stores {dtype} {list(shape)}"
            )


def _check_msmodelslim(name: str, tensors: dict, entry_dir: Path) -> str:
    descriptions = sorted(entry_dir.glob(f"{Path(ms.DESCRIPTION_NAME).stem}*.json"))
    if not descriptions:
        raise AscqError(f"{name}: format msmodelslim needs a quant_model_description*.json")
    description = json.loads(descriptions[0].read_text())
    described = {k for k in description if "." in k}  # the rest is metadata (model_quant_type, version)
    for tensor in sorted(set(tensors) | described):
        if tensor not in described:
            raise AscqError(f"{name}: tensor {tensor} is not in {descriptions[0].name}")
        if tensor not in tensors:
            raise AscqError(f"{name}: {descriptions[0].name} lists {tensor}, which no shard holds")
    return f"{len(tensors)} tensors match {descriptions[0].name} (format msmodelslim)"
