"""`ascq zoo verify`: an entry's files match its manifest, its config and tokenizer load, and its tensor names are
what its format says (compressed-tensors: each config group's compressor's parameter names; msModelSlim: the
description JSON; hf: plain float weights). Every check raises AscqError naming the first mismatch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ascq.errors import AscqError
from ascq.zoo.manifest import read_manifest, verify_files
from ascq.zoo.planned import require_weights

TENSOR_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
QUANTIZED_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
# dtype of the main quantized tensor per compressed-tensors format
MAIN_TENSOR_DTYPES = {"pack-quantized": ("weight_packed", "I32"), "int-quantized": ("weight", "I8"),
                      "float-quantized": ("weight", "F8_E4M3")}


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
    tensors = read_tensor_infos(entry_dir)
    passed.append(_check_format(entry_dir.name, manifest.get("format", "hf"), config, tensors, entry_dir))
    return passed


def _check_config(entry_dir: Path) -> dict[str, Any]:
    path = entry_dir / "config.json"
    if not path.is_file():
        raise AscqError(f"{entry_dir.name}: config.json is missing")
    try:
        config = json.loads(path.read_text())
        if config.get("model_type") == "deepseek":  # no transformers class; ascq's own reference config
            from ascq.models.deepseek_config import DeepseekConfig

            DeepseekConfig.from_dict(config)
        else:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(entry_dir, trust_remote_code=False)
    except Exception as exc:  # any failure to load is the entry's fault
        raise AscqError(f"{entry_dir.name}: config.json does not load: {' '.join(str(exc).split())[:300]}") from None
    return config


def _check_tokenizer(entry_dir: Path) -> str:
    if not any((entry_dir / name).is_file() for name in TOKENIZER_FILES):
        raise AscqError(f"{entry_dir.name}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(entry_dir, trust_remote_code=False)
        tokenizer("verify")
    except Exception as exc:
        raise AscqError(f"{entry_dir.name}: tokenizer does not load: {' '.join(str(exc).split())[:300]}") from None
    return f"{type(tokenizer).__name__}, vocab {len(tokenizer)}"


def read_tensor_infos(entry_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) over every shard; checks the shard index when there is one."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    location: dict[str, str] = {}
    for shard in sorted(entry_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise AscqError(f"{entry_dir.name}: tensor {name} is in both {location[name]} and {shard.name}")
                piece = f.get_slice(name)
                tensors[name], location[name] = (piece.get_dtype(), tuple(piece.get_shape())), shard.name
    index_path = entry_dir / TENSOR_INDEX
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        for name in sorted(set(weight_map) | set(location)):
            if weight_map.get(name) != location.get(name):
                raise AscqError(f"{entry_dir.name}: {TENSOR_INDEX} maps {name} to {weight_map.get(name)}, "
                                f"but it is in {location.get(name)}")
    return tensors


def _modules(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    modules: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = defaultdict(dict)
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        modules[module][param] = info
    return modules


def _linear_modules(modules: dict[str, dict[str, Any]]) -> list[str]:
    """Modules holding a 2-D (or packed) weight, except embeddings."""
    return sorted(
        m for m, params in modules.items()
        if ("weight_packed" in params or ("weight" in params and len(params["weight"][1]) == 2)) and not m.endswith("embed_tokens")
    )


def _check_format(name: str, fmt: str, config: dict[str, Any], tensors: dict, entry_dir: Path) -> str:
    if fmt == "compressed-tensors":
        return _check_compressed_tensors(name, config, tensors)
    if fmt == "msmodelslim":
        return _check_msmodelslim(name, tensors, entry_dir)
    if fmt == "hf":
        for tensor, (dtype, _) in sorted(tensors.items()):
            if tensor.rpartition(".")[2] in QUANTIZED_PARAMS or not dtype.startswith(("F", "BF")):
                raise AscqError(f"{name}: tensor {tensor} ({dtype}) is quantized, but the manifest says format hf")
        return f"{len(tensors)} tensors are plain float weights (format hf)"
    raise AscqError(f"{name}: unknown format '{fmt}' in the manifest (hf, compressed-tensors, msmodelslim)")


def _check_compressed_tensors(name: str, config: dict[str, Any], tensors: dict) -> str:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    qc_dict = config.get("quantization_config") or {}
    if qc_dict.get("quant_method") != "compressed-tensors":
        raise AscqError(f"{name}: config.json has no quantization_config with quant_method compressed-tensors")
    try:
        qc = QuantizationConfig.model_validate(qc_dict)
    except Exception as exc:  # pydantic's validation error
        raise AscqError(f"{name}: quantization_config is invalid: {' '.join(str(exc).split())[:300]}") from None
    modules = _modules(tensors)
    num_quantized = 0
    for module in _linear_modules(modules):
        params = modules[module]
        ignored = any(match_name(module, target) for target in qc.ignore or [])
        scheme = next((s for s in qc.config_groups.values()
                       if any(t == "Linear" or match_name(module, t) for t in s.targets)), None)
        if ignored or scheme is None:
            if "weight" not in params or set(params) & set(QUANTIZED_PARAMS):
                why = "is in the ignore list" if ignored else "matches no config group"
                raise AscqError(f"{name}: {module} {why} but is stored quantized ({', '.join(sorted(params))})")
            continue
        fmt = scheme.format or qc.format
        required = set(BaseCompressor.load_from_registry(fmt).compression_param_names(scheme))
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            required.add("input_scale")
        missing = sorted(required - set(params))
        if missing:
            raise AscqError(f"{name}: {module} lacks {', '.join(missing)} required by format {fmt} (has {', '.join(sorted(params))})")
        main, dtype = MAIN_TENSOR_DTYPES.get(fmt, (None, None))
        if main and params[main][0] != dtype:
            raise AscqError(f"{name}: {module}.{main} is {params[main][0]}, format {fmt} stores {dtype}")
        num_quantized += 1
    if qc.kv_cache_scheme is not None:
        for module in sorted(m for m in modules if m.endswith("self_attn")):
            missing = sorted({"k_scale", "v_scale"} - set(modules[module]))
            if missing:
                raise AscqError(f"{name}: kv_cache_scheme is set but {module} lacks {', '.join(missing)}")
    if num_quantized == 0:
        raise AscqError(f"{name}: quantization_config is set but no linear is quantized")
    return f"tensor names match compressed-tensors ({num_quantized} quantized linears, format {qc.format})"


def _check_msmodelslim(name: str, tensors: dict, entry_dir: Path) -> str:
    descriptions = sorted(entry_dir.glob("quant_model_description*.json"))
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
