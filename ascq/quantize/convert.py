"""`ascq convert`: a Hugging Face checkpoint + recipes -> a compressed-tensors zoo entry, written
atomically."""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import compressed_tensors
import torch

from ascq.core.errors import AscqError, UnsupportedError
from ascq.core.qmath import source_block_size, source_has_float_min
from ascq.formats.manifest import (
    MANIFEST_NAME,
    check_output,
    group_size_fit_text,
    looks_like_hub_id,
    missing_model,
    new_manifest,
    read_manifest,
    signals_raise,
    staged_entry,
    write_manifest,
)
from ascq.formats.safetensors import CheckpointReader
from ascq.paths import DEFAULT_MAX_EVAL_TOKENS, EVAL_TEXT, portable_name, zoo_root
from ascq.platforms import CALIBRATION_DEVICES, check_device, device_kind
from ascq.quantize.architectures import load_architecture
from ascq.quantize.calibration import CalibrationSet, hub_reachable, load_calibration
from ascq.quantize.ct_writer import ShardWriter, check_library_version, write_config
from ascq.quantize.mixed import check_budget
from ascq.quantize.pipeline import (
    EVAL_SEQ_LEN,
    StreamResult,
    calibration_gemm_dtype,
    check_calibration_dtype,
    stream_convert,
)
from ascq.quantize.recipe import ComposedRecipe, load_recipes

FORMATS = ("compressed-tensors", "msmodelslim")
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    "LICENSE",
    "README.md",
)


@dataclasses.dataclass
class ConvertOptions:
    model: str
    recipes: list[str]
    out: Path | None = None
    calib: str | None = None
    num_samples: int = 64
    seq_len: int = 512
    device: str = "cpu"
    format: str = "compressed-tensors"
    eval_text: Path | None = None
    max_eval_tokens: int | None = (
        DEFAULT_MAX_EVAL_TOKENS  # perplexity before/after on the eval text's first N tokens (None: all of it)
    )
    evaluate: bool = (
        True  # False: no perplexity before/after (two forwards of every layer over the eval tokens)
    )
    max_shard_bytes: int = 1 << 30  # pending output is held in memory up to this size
    progress: bool = True
    overwrite: bool = False  # replace an existing entry at `out` (atomically; never the source)
    calibration_dtype: str = (
        "auto"  # the linears' products in the converter's forwards (`calibration_gemm_dtype`)
    )
    # a bits budget for the recipe's int4 group scheme (`ascq.quantize.mixed`; overrides the recipe's)
    bits_per_weight: float | None = None

    def __post_init__(self) -> None:
        if not self.recipes:
            raise AscqError("give at least one --recipe (see 'ascq recipes')")
        if self.num_samples < 1 or self.seq_len < 2:
            raise AscqError("--num-samples must be >= 1 and --seq-len >= 2")
        if device_kind(self.device) not in CALIBRATION_DEVICES:
            raise AscqError(f"--device {self.device!r}: use one of {', '.join(CALIBRATION_DEVICES)}")
        if self.format not in FORMATS:
            raise UnsupportedError(f"--format {self.format!r}: supported: {', '.join(FORMATS)}")
        if self.max_eval_tokens is not None and self.max_eval_tokens < EVAL_SEQ_LEN:
            raise AscqError(
                f"--max-eval-tokens must be >= {EVAL_SEQ_LEN} (one eval window), or 0 for the whole text"
            )
        check_calibration_dtype(self.calibration_dtype)
        if self.max_shard_bytes < 1:
            raise AscqError("--max-shard-size must be positive")
        if not self.evaluate and (
            self.eval_text is not None or self.max_eval_tokens != DEFAULT_MAX_EVAL_TOKENS
        ):
            raise AscqError("--eval-text / --max-eval-tokens and --no-eval contradict each other: give one")


def local_model_dir(model: str) -> Path | None:
    """A local checkpoint folder or zoo entry name; None for a Hub id (`download_model`); anything else is
    the one missing-model error."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise AscqError(f"{model} is not a folder")
    if "/" not in model and (zoo_root() / model).is_dir():  # a zoo entry by name, as serve/generate take it
        return zoo_root() / model
    if not looks_like_hub_id(model):
        raise missing_model(model)
    return None


def download_model(model: str) -> Path:
    """The snapshot of Hub id `model` through huggingface_hub (clear error when offline)."""
    from huggingface_hub import snapshot_download

    if not hub_reachable():
        raise AscqError(f"{model} is not a local folder and the Hugging Face Hub is unreachable (offline?)")
    try:
        return Path(
            snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
        )
    except Exception as exc:  # offline, unknown repo, gated: all mean "cannot get it"
        raise AscqError(
            f"cannot download {model} from the Hugging Face Hub ({type(exc).__name__}); pass a local folder"
        ) from None


def resolve_model_dir(model: str) -> Path:
    """A local checkpoint folder, a zoo entry name, or a Hub id downloaded through huggingface_hub."""
    return local_model_dir(model) or download_model(model)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process. Linux: VmHWM, because getrusage's ru_maxrss survives exec and so
    reports the parent's RSS at fork when that was larger (a pytest parent, a shell that just wrote the
    model)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _source_manifest(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def default_output(model: str | Path, recipe_names: list[str], fmt: str) -> Path:
    """`zoo/NAME-RECIPES-FORMAT`, NAME the model's own (a folder's name, a Hub id's NAME, never a snapshot's
    commit hash): two recipes or two formats of one model never share a folder."""
    return zoo_root() / f"{Path(str(model).rstrip('/')).name}-{'+'.join(recipe_names)}-{fmt}"


def convert(options: ConvertOptions) -> Path:
    """Convert and write the entry; returns its folder. SIGTERM (like Ctrl-C) removes the staging folder."""
    with signals_raise():
        return _convert(options)


def _convert(options: ConvertOptions) -> Path:
    start = time.perf_counter()
    check_library_version()
    # everything that can be checked without the weights is, before a Hub id is downloaded
    local_dir = local_model_dir(options.model)
    recipe = load_recipes(list(options.recipes))
    if options.bits_per_weight is not None:
        set_bits_per_weight(recipe, options.bits_per_weight)
    _check_format(options.format, recipe)
    named_after = local_dir.resolve() if local_dir else options.model
    target = Path(options.out) if options.out else default_output(named_after, recipe.names, options.format)
    check_output(target, [local_dir] if local_dir else [], options.overwrite)
    device = check_device(options.device)
    gemm_dtype = calibration_gemm_dtype(options.calibration_dtype, device, recipe)
    model_dir = local_dir or download_model(options.model)
    check_output(target, [model_dir], options.overwrite)
    arch = load_architecture(model_dir)
    reader = CheckpointReader(model_dir)
    tokenizer = _tokenizer(model_dir)
    calib = load_calibration(options.calib, tokenizer, options.num_samples, options.seq_len)
    source = _source_manifest(model_dir)
    eval_path = options.eval_text or (EVAL_TEXT if source is not None and options.evaluate else None)
    eval_ids = None
    if eval_path is not None:
        from ascq.evaluate import load_eval_token_ids

        eval_ids = load_eval_token_ids(tokenizer, eval_path)[: options.max_eval_tokens]
    with staged_entry(target, options.overwrite, [model_dir]) as staging:
        writer = _writer(options, staging, reader, arch.config)
        result = stream_convert(
            reader,
            arch,
            recipe,
            calib.input_ids,
            staging,
            device,
            options.max_shard_bytes,
            eval_ids,
            options.progress,
            writer,
            source_block_size(source),
            source_has_float_min(source),
            gemm_dtype,
        )
        if options.format == "msmodelslim":
            writer.write_config(staging, arch.config)
        else:
            # a quantized head of a tied model is written as its own (untied) lm_head
            untie = (result.lm_head or {}).get("untied_from_embedding")
            untied = {"tie_word_embeddings": False} if untie else {}
            write_config(staging, {**arch.config, **untied}, result.qconfig)
        for file in COPIED_FILES:
            if (model_dir / file).is_file():
                shutil.copy2(model_dir / file, staging / file)
        metrics = _metrics(result, calib, eval_ids, eval_path, int(arch.config["vocab_size"]))
        conversion = {
            "seconds": round(time.perf_counter() - start, 2),
            "peak_rss_bytes": peak_rss_bytes(),
            "device": device,
            "calibration_dtype": str(gemm_dtype).removeprefix("torch."),
            "num_layers": arch.num_layers,
            "source_bytes": reader.num_bytes,
        }
        write_manifest(
            staging,
            build_manifest(
                target.name, options, model_dir, source, recipe, calib, result, metrics, conversion
            ),
        )
    return target


def set_bits_per_weight(recipe: ComposedRecipe, bits_per_weight: float) -> None:
    """`--bits-per-weight`: a budget on the recipe's weight scheme (its own mixed_schemes kept, if any)."""
    owners = [s for s in recipe.schemes() if s.config_groups]
    if not owners:
        raise AscqError(f"--bits-per-weight: recipe {'+'.join(recipe.names)} quantizes no weights")
    (scheme,) = owners  # ComposedRecipe: one weight owner
    candidates = scheme.budget.candidates if scheme.budget is not None else None
    scheme.set_budget(check_budget("--bits-per-weight", bits_per_weight, candidates))


def _metrics(
    result: StreamResult,
    calib: CalibrationSet,
    eval_ids: torch.Tensor | None,
    eval_path: Path | None,
    vocab_size: int,
) -> dict[str, Any]:
    if result.perplexity is None:
        return {}
    from ascq.evaluate import unigram_perplexity

    return {
        "perplexity": result.perplexity,
        "perplexity_base": result.perplexity_base,
        "unigram_perplexity": unigram_perplexity(calib.input_ids, eval_ids, vocab_size),
        "eval_text": portable_name(eval_path),
        "num_eval_tokens": int(eval_ids.numel()),
    }


def build_manifest(
    name: str,
    options: ConvertOptions,
    model_dir: Path,
    source: dict[str, Any] | None,
    recipe: ComposedRecipe,
    calib: CalibrationSet,
    result: StreamResult,
    metrics: dict[str, Any],
    conversion: dict[str, Any],
) -> dict[str, Any]:
    """The converted entry's `ascq.json` (files are hashed in by `write_manifest`); no absolute local
    paths."""
    import transformers

    model = (source or {}).get("name") if source else portable_name(options.model)
    return new_manifest(
        name,
        source={"model": model or portable_name(model_dir), "revision": None},
        base_model=(source or {}).get("base_model") or (source or {}).get("name") or model,
        license=(source or {}).get("license"),
        format=options.format,
        scheme=result.scheme,
        recipe={"names": recipe.names, "text": "\n---\n".join(r.text.strip() + "\n" for r in recipe.recipes)},
        calibration={"dataset": calib.dataset, "num_samples": calib.num_samples, "seq_len": calib.seq_len},
        metrics=metrics,
        conversion={
            **conversion,
            "num_quantized_linears": result.num_quantized_linears,
            "group_size_fits": [fit.record() for fit in result.group_size_fits],
            "group_size_fallbacks": result.fallbacks,
            "modifiers": [{"name": m.name, **m.summary()} for m in recipe.modifiers],
            "layers": result.layers,
            **({"mixed_precision": result.mixed.record()} if result.mixed is not None else {}),
            **({"lm_head": result.lm_head} if result.lm_head is not None else {}),
            "compressed_tensors_version": compressed_tensors.__version__,
            "transformers_version": transformers.__version__,
        },
        **({"synthetic": source["synthetic"]} if source and source.get("synthetic") else {}),
    )


def _writer(options: ConvertOptions, staging: Path, reader: CheckpointReader, config: dict) -> ShardWriter:
    """The output format's shard writer: compressed-tensors, or msModelSlim for vllm-ascend."""
    if options.format == "msmodelslim":
        from ascq.quantize.msmodelslim import MsModelSlimWriter

        return MsModelSlimWriter(staging, options.max_shard_bytes, reader.dtype(), config)
    return ShardWriter(staging, options.max_shard_bytes)


def _check_format(fmt: str, recipe: ComposedRecipe) -> None:
    """Reject recipe/format pairs that cannot be written, before any calibration work."""
    if fmt != "msmodelslim" and any(m.name == "KVCacheInt8Modifier" for m in recipe.modifiers):
        raise UnsupportedError("the kv-int8-c8 recipe (vllm-ascend C8 KV cache) needs --format msmodelslim")
    if fmt == "msmodelslim":
        from ascq.quantize.msmodelslim import check_recipe_schemes

        check_recipe_schemes(recipe.schemes())


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as exc:  # missing/broken tokenizer files
        raise AscqError(
            f"{model_dir}: cannot load its tokenizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def parse_size(text: str) -> int:
    """Bytes of '2GB', '500MB', '64KB' or a plain number (powers of 1024)."""
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "B": 1}
    upper = text.strip().upper().replace("IB", "B")
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise AscqError(f"size {text!r}: use a number of bytes or e.g. 500MB, 2GB")


def format_summary(entry: Path) -> str:
    manifest = read_manifest(entry)
    conv, metrics = manifest["conversion"], manifest.get("metrics") or {}
    size = sum(f["size"] for f in manifest["files"].values())
    lines = [
        f"wrote {entry} ({manifest['scheme']}, {size / 2**20:.1f} MiB, {len(manifest['files'])} files)",
        f"time {conv['seconds']:.1f} s, peak RSS {conv['peak_rss_bytes'] / 2**30:.2f} GiB, "
        f"{conv['num_quantized_linears']} linears quantized",
    ]
    if metrics.get("perplexity"):
        delta = 100 * (metrics["perplexity"] / metrics["perplexity_base"] - 1)
        lines.append(
            f"perplexity {metrics['perplexity_base']:.3f} -> {metrics['perplexity']:.3f} ({delta:+.2f}%)"
        )
    if mixed := conv.get("mixed_precision"):
        counts = ", ".join(f"{n} x {c}" for c, n in mixed["num_linears"].items())
        lines.append(
            f"mixed precision: {mixed['bits_per_weight']:.3f} bits per weight "
            f"(budget {mixed['target_bits_per_weight']}): {counts}"
        )
    if head := conv.get("lm_head"):
        lines.append(
            f"LM head: {head['scheme']}" + (" (untied copy)" if head["untied_from_embedding"] else "")
        )
    lines += [group_size_fit_text(fit) for fit in conv.get("group_size_fits", []) if fit["group_size"]]
    if conv["group_size_fallbacks"]:
        lines.append(f"{len(conv['group_size_fallbacks'])} linears fell back to per-channel (see ascq.json)")
    return "\n".join(lines)
