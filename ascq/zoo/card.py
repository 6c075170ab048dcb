"""`ascq zoo card`: an entry's README.md model card, metadata in the Hub's conventions for quantized models
(base_model, base_model_relation, library_name, pipeline_tag, tags, license inherited from the base model),
built and parsed back with huggingface_hub's `ModelCard` / `ModelCardData`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ascq.atomic_file import atomic_write
from ascq.core.architecture import head_dim_of
from ascq.core.families import gemma3
from ascq.core.families.gemma3 import GEMMA3
from ascq.core.tensors import tie_word_embeddings
from ascq.formats.compressed_tensors import BITS_COUNTED
from ascq.formats.manifest import MANIFEST_NAME, group_size_fit_text, read_manifest
from ascq.formats.safetensors import DTYPE_BYTES, CheckpointReader
from ascq.paths import RECIPES_DIR, zoo_root

CARD_NAME = "README.md"
LOADERS = {  # who reads each compressed-tensors format
    "pack-quantized": ", read by vLLM's compressed-tensors int4 (W4A16) path, transformers and ascq",
    "int-quantized": ", read by vLLM, transformers and ascq",
    "naive-quantized": ", transformers and ascq only (vLLM's int4 kernels need pack-quantized)",
}
# a quantized LM head: vLLM's compressed-tensors path quantizes linear, attention and MoE layers, not its
# LM head
HEAD_LOADERS = ", ascq and transformers only (vLLM's compressed-tensors path does not quantize an LM head)"
HUB_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
SCHEME_TEXT = {
    "dense": "unquantized weights",
    "w8a8_dynamic": "int8 weights (per output channel, symmetric) and int8 activations quantized per token "
    "at run time",
    "w8a8_static": "int8 weights (per output channel, symmetric) and int8 activations with a calibrated "
    "static scale",
    "w4a16": "int4 weights (grouped along the input dimension), 16-bit activations (weight-only)",
    "w8a16": "int8 weights (per output channel), 16-bit activations (weight-only)",
    "w4a8_dynamic": "int4 weights (per output channel, symmetric) and int8 activations quantized per token "
    "at run time",
}


def render_card(entry_dir: Path, repo_id: str | None = None) -> str:
    """The model card text; `repo_id` (ORG/NAME) is used in the serving commands, else the entry's zoo
    name."""
    entry_dir = Path(entry_dir)
    manifest = read_manifest(entry_dir)
    config = _read_json(entry_dir / "config.json")
    quantized = quantized_from(manifest)
    license_fields = _license(manifest)
    data = ModelCardData(
        base_model=(manifest.get("base_model") or None) if quantized else None,  # a fixture is its own base
        library_name="vllm" if manifest.get("format") == "msmodelslim" else "transformers",
        pipeline_tag="text-generation",
        tags=_tags(manifest, config),
        **license_fields,
        **({"base_model_relation": "quantized"} if quantized and manifest.get("base_model") else {}),
    )
    body = "\n".join(
        [
            f"# {manifest['name']}\n",
            _summary(manifest, config, entry_dir),
            _recipe_section(manifest),
            *([section] if (section := _mixed_section(manifest)) else []),
            *([_plan_section(manifest["planned"])] if manifest.get("planned") else []),
            _quality_section(manifest),
            _serve_section(manifest, config, repo_id or _local_ref(entry_dir), from_hub=repo_id is not None),
            "## Files\n",
            f"`ascq.json` lists every file with its size and sha256; "
            f"`ascq zoo verify {_entry_ref(entry_dir, repo_id)}` checks them, that the config and tokenizer "
            "load, and that the tensor names match the format.\n",
        ]
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")
    ModelCard(str(card))  # parse back: fails on metadata the library cannot read
    return str(card)


def carded_manifest(entry_dir: Path, card: bytes) -> dict[str, Any]:
    """The entry's manifest with README.md recorded as `card` (only that record changes, so a tampered file
    elsewhere still fails verify)."""
    manifest = read_manifest(entry_dir)
    files = dict(manifest.get("files") or {})
    files[CARD_NAME] = {"size": len(card), "sha256": hashlib.sha256(card).hexdigest()}
    manifest["files"] = dict(sorted(files.items()))
    return manifest


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()


def write_card(entry_dir: Path, repo_id: str | None = None) -> Path:
    """Write README.md into the entry and record it in the manifest (`carded_manifest`)."""
    entry_dir = Path(entry_dir)
    card = render_card(entry_dir, repo_id).encode()
    manifest = carded_manifest(entry_dir, card)
    atomic_write(entry_dir / CARD_NAME, card)
    atomic_write(entry_dir / MANIFEST_NAME, manifest_bytes(manifest))
    return entry_dir / CARD_NAME


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _entry_ref(entry_dir: Path, repo_id: str | None) -> str:
    """How the card's zoo commands name the entry: as `ascq zoo pull` names it from the Hub, else locally."""
    return repo_id.split("/")[1] if repo_id else _local_ref(entry_dir)


def _local_ref(entry_dir: Path) -> str:
    """`zoo/NAME` for an entry of the zoo, else the folder's own name: a card never holds a local absolute
    path."""
    try:
        return f"zoo/{entry_dir.resolve().relative_to(zoo_root().resolve())}"
    except ValueError:
        return entry_dir.resolve().name


def _license(manifest: dict[str, Any]) -> dict[str, str]:
    """The entry's license, else the base entry's when the base is in the zoo (inherited), else "unknown"."""
    source = manifest
    base = manifest.get("base_model")
    if not manifest.get("license") and base and (zoo_root() / Path(str(base)).name / MANIFEST_NAME).is_file():
        source = read_manifest(zoo_root() / Path(str(base)).name)
    fields = {k: source[k] for k in ("license", "license_name", "license_link") if source.get(k)}
    return fields or {"license": "unknown"}


def _tags(manifest: dict[str, Any], config: dict[str, Any]) -> list[str]:
    tags = ["ascq", manifest.get("format") or "hf"]
    if manifest.get("recipe"):
        tags += ["quantized", manifest.get("scheme") or "dense", *manifest["recipe"].get("names", [])]
    if config.get("model_type"):
        tags.append(config["model_type"])
    return list(dict.fromkeys(t for t in tags if t))


def _base_link(base: str | None) -> str:
    if not base:
        return "-"
    return f"[{base}](https://huggingface.co/{base})" if HUB_REPO_ID.match(base) else f"`{base}`"


def quantized_weight_bits(entry_dir: Path) -> tuple[int, int]:
    """(stored bits of the quantized decoder linears' weights + scales + zero points, their parameter count)
    over the entry's safetensors files, a quantized LM head left out; (0, 0) for an entry without quantized
    linears."""
    if not any(Path(entry_dir).glob("*.safetensors")):
        return 0, 0
    reader = CheckpointReader(Path(entry_dir))  # headers checked against their files (an untrusted entry)
    bits = params = 0
    for name in reader:
        module, _, local = name.rpartition(".")
        if local != "weight_scale" or module == "lm_head":  # the head is stated on its own
            continue
        for part in BITS_COUNTED:
            if f"{module}.{part}" in reader:
                dtype, shape = reader.tensor_info(f"{module}.{part}")
                bits += math.prod(shape) * 8 * DTYPE_BYTES[dtype]
        if f"{module}.weight_shape" in reader:
            params += math.prod(int(d) for d in reader.get(f"{module}.weight_shape").tolist())
        else:
            params += math.prod(reader.tensor_info(f"{module}.weight")[1])
    return bits, params


def _bits_per_weight_text(entry_dir: Path) -> str | None:
    bits, params = quantized_weight_bits(entry_dir)
    if not params:
        return None
    return (
        f"{bits / params:.2f} (weights + scales + zero points over the {params / 1e6:.1f} M quantized "
        "linear parameters)"
    )


def _summary(manifest: dict[str, Any], config: dict[str, Any], entry_dir: Path) -> str:
    scheme = manifest.get("scheme") or "dense"
    files = {rel: f for rel, f in (manifest.get("files") or {}).items() if rel != CARD_NAME}  # the card's own
    size = sum(f["size"] for f in files.values())  # size would make it change each time it is recorded
    if manifest.get("planned"):
        intro = (
            f"A planned ascq zoo entry for {_base_link(manifest.get('base_model'))}: the weights are not "
            f"produced "
            f"yet; `{manifest['planned']['commands']['convert']}` produces them.\n"
        )
    elif manifest.get("synthetic"):
        intro = (
            f"**SYNTHETIC**: {manifest['synthetic']['kind']}. The shape of "
            f"{_base_link(manifest.get('base_model'))}"
            + (f", quantized by ascq (`{scheme}`)" if manifest.get("recipe") else ", bf16")
            + ".\n"
        )
    elif gguf := _gguf_source(manifest):
        package = (
            f" shipped by the PyPI package `{gguf['package']}` {gguf.get('package_version') or ''}".rstrip()
            if gguf.get("package")
            else ""
        )
        intro = (
            f"{_base_link(manifest.get('base_model'))} imported by `ascq zoo import-gguf` from the GGUF file "
            f"`{gguf['file']}`{package} ({gguf['quantization_type']}): "
            f"llama.cpp's quantized tensors dequantized into {gguf.get('dtype', 'bfloat16')} weights, a "
            "Hugging Face checkpoint that ascq converts and serves.\n"
        )
    elif not manifest.get("recipe"):
        intro = (
            "A fixture model trained by ascq for its tests and examples. No quantization recipe was applied: "
            "these are the original bf16 weights.\n"
        )
    else:
        intro = f"A `{scheme}` quantization of {_base_link(manifest.get('base_model'))} made with ascq.\n"
    calibration = manifest.get("calibration") or {}
    rows = [
        ("base model", _base_link(manifest.get("base_model") if quantized_from(manifest) else None)),
        ("architecture", architecture_text(config)),
        ("scheme", f"`{scheme}`: {SCHEME_TEXT.get(scheme, scheme)}"),
        ("format", _format_text(manifest, config)),
        (
            "recipe",
            ", ".join(f"`{n}`" for n in (manifest.get("recipe") or {}).get("names", []))
            or ("none (GGUF import)" if _gguf_source(manifest) else "none (fixture)"),
        ),
        (
            "calibration",
            f"{calibration.get('dataset', '?')}, {calibration.get('num_samples', '?')} samples"
            f" of {calibration.get('seq_len', '?')} tokens"
            if calibration
            else "none",
        ),
        ("size", f"{size / 2**20:.1f} MiB in {len(files)} files besides this card"),
        *([("bits per weight", bpw)] if (bpw := _bits_per_weight_text(entry_dir)) else []),
        *([("mixed precision", mixed)] if (mixed := _mixed_text(manifest)) else []),
    ]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    return f"{intro}\n{table}"


def _mixed(manifest: dict[str, Any]) -> dict[str, Any] | None:
    return (manifest.get("conversion") or {}).get("mixed_precision")


def _mixed_text(manifest: dict[str, Any]) -> str | None:
    mixed = _mixed(manifest)
    if not mixed:
        return None
    counts = ", ".join(f"{n} × {c}" for c, n in mixed["num_linears"].items())
    return (
        f"a bits budget of {mixed['target_bits_per_weight']} per weight over the linears, achieved "
        f"{mixed['bits_per_weight']:.3f}: {counts} linears, chosen by each one's measured sensitivity "
        "(see Mixed precision)"
    )


def _mixed_section(manifest: dict[str, Any]) -> str:
    """Each decoder layer's linears by the scheme the allocator chose."""
    mixed = _mixed(manifest)
    if not mixed:
        return ""
    layers: dict[str, dict[str, list[str]]] = {}
    for name, choice in mixed["choice"].items():
        match = re.match(r"^(.*?layers\.\d+)\.(.+)$", name)
        layer, linear = match.groups() if match else ("", name)
        layers.setdefault(layer, {}).setdefault(choice, []).append(linear)
    rows = "".join(
        f"| {layer or '-'} | "
        + "; ".join(f"{c}: {', '.join(f'`{n}`' for n in names)}" for c, names in sorted(by.items()))
        + " |\n"
        for layer, by in layers.items()
    )
    return (
        "## Mixed precision\n\n"
        f"Candidates {', '.join(f'`{c}`' for c in mixed['candidates'])}; sensitivity of a linear: "
        f"`{mixed['sensitivity']}` over the calibration inputs (x: its input; linears reading one input "
        "share a scheme); allocated greedily by error removed per extra stored bit.\n\n"
        f"| layer | linears by scheme |\n|---|---|\n{rows}"
    )


def _gguf_source(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The GGUF file an imported entry was made from (`import-gguf`), else None."""
    return (manifest.get("source") or {}).get("gguf") if not manifest.get("recipe") else None


def quantized_from(manifest: dict[str, Any]) -> bool:
    """Whether the entry derives from its base model (a recipe applied, or an imported GGUF)."""
    return bool(manifest.get("recipe")) or bool(_gguf_source(manifest))


def architecture_text(config: dict[str, Any]) -> str:
    """The family and shape of the model, from its config."""
    model_type = config.get("model_type")
    if not model_type or "num_hidden_layers" not in config:
        return "-"
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    tied = "tied" if tie_word_embeddings(config) else "untied"
    text = (
        f"`{model_type}` ({', '.join(config.get('architectures') or [])}): {config['num_hidden_layers']} "
        f"layers, hidden {config['hidden_size']}, {heads} query / {kv_heads} KV heads of "
        f"{head_dim_of(config)}, "
        f"vocabulary {config['vocab_size']} ({tied} embeddings)"
    )
    if model_type == GEMMA3:
        types = gemma3.layer_types(config)
        local, full = (gemma3.rope_config(config, t)["rope_theta"] for t in (gemma3.SLIDING, gemma3.FULL))
        text += (
            f"; sliding-window attention ({config.get('sliding_window')} tokens) on "
            f"{types.count(gemma3.SLIDING)} of {len(types)} layers, rope base {local:,.0f} on those and "
            f"{full:,.0f} on the global ones; q/k RMSNorm, four (1 + weight) RMSNorms per layer, "
            f"GELU-tanh MLP, embeddings scaled by sqrt({config['hidden_size']})"
        )
    return text


def _format_text(manifest: dict[str, Any], config: dict[str, Any]) -> str:
    qc = config.get("quantization_config") or {}
    if manifest.get("format") != "compressed-tensors" or not qc:
        return manifest.get("format") or "hf"
    groups = []
    fitted = (manifest.get("conversion") or {}).get("group_size_fits")
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        text = f"weights int{w.get('num_bits')} {w.get('strategy')}"
        text += f" {w['group_size']}" if w.get("group_size") else ""
        text += " (the recipe's group size)" if w.get("group_size") and not fitted else ""
        text += ", symmetric" if w.get("symmetric", True) else ", asymmetric"
        if str(w.get("zp_dtype", "")).removeprefix("torch.") in ("bfloat16", "float16", "float32"):
            text += f", {str(w['zp_dtype']).removeprefix('torch.')} zero points"
        if a:
            text += (
                f"; activations int{a.get('num_bits')} {'dynamic' if a.get('dynamic') else 'static'} "
                f"{a.get('strategy')}"
            )
        groups.append(text)
    ignore = ", ".join(f"`{i}`" for i in qc.get("ignore") or []) or "none"
    fits = "".join(
        f"; {group_size_fit_text(fit)}"
        for fit in (manifest.get("conversion") or {}).get("group_size_fits", [])
    )
    loaders = LOADERS.get(qc.get("format"), "")
    head = (manifest.get("conversion") or {}).get("lm_head")
    if head:
        untied = (
            " (an untied copy of the tied embedding, which stays unquantized)"
            if head.get("untied_from_embedding")
            else ""
        )
        groups.append(f"LM head {head['scheme']}{untied}")
        loaders = HEAD_LOADERS
    described = f"compressed-tensors `{qc.get('format')}` ({'; '.join(groups)}){loaders}"
    return f"{described}; not quantized: {ignore}{fits}"


def _recipe_section(manifest: dict[str, Any]) -> str:
    recipe = manifest.get("recipe")
    if not recipe and _gguf_source(manifest):
        return "## Recipe\n\nNone: the GGUF file's weights, dequantized (`ascq convert` quantizes them).\n"
    if not recipe:
        return "## Recipe\n\nNone: this is a fixture model, not a quantization.\n"
    names, text, how = recipe.get("names", []), recipe.get("text"), "verbatim"
    if not text and manifest.get("planned"):  # not applied yet: the recipe files `ascq convert` will apply
        files = [RECIPES_DIR / f"{n}.yaml" for n in names]
        text = "\n---\n".join(f.read_text().strip() + "\n" for f in files if f.is_file())
        how = f"as shipped in `recipes/` ({', '.join(f.name for f in files)}), to be applied"
    text = text or "(the recipe text was not recorded)"
    return f"## Recipe\n\n`{'` + `'.join(names)}`, {how}:\n\n```yaml\n{text.rstrip()}\n```\n"


def _plan_section(planned: dict[str, Any]) -> str:
    rows = []
    for recipe, row in planned["recipes"].items():
        memory = " | ".join(f"{v['total_bytes'] / 2**30:.1f} GiB" for v in row["serve_memory"].values())
        rows.append(
            f"| `{recipe}` | `{row['scheme']}` | {row['checkpoint_bytes'] / 2**30:.1f} GiB | {memory} |"
        )
    columns = " | ".join(k.replace("_", " ") for k in next(iter(planned["recipes"].values()))["serve_memory"])
    return (
        f"## Plan\n\n{planned['num_parameters'] / 1e9:.2f} B parameters. Checkpoint size per recipe and "
        f"memory to "
        "serve it (weights with every expert resident + bf16 KV cache; activation workspace not "
        "included):\n\n"
        f"| recipe | scheme | checkpoint | {columns} |\n|---|---|---:|"
        + "---:|" * len(row["serve_memory"])
        + "\n"
        + "\n".join(rows)
        + f"\n\nServe it with `{planned['commands']['serve']}`.\n"
        + _measured_text(planned.get("measured"))
    )


def _measured_text(measured: dict[str, Any] | None) -> str:
    if not measured:
        return ""
    rows = "".join(f"| {r['what']} | {r['value']} | `{r['command']}` |\n" for r in measured["rows"])
    return (
        f"\n### Measured at this shape\n\nOn {measured['machine']}, {measured['date']}, with dummy or "
        "synthetic weights of the real shape (the real weights were not available there):\n\n"
        f"| what | measured | command |\n|---|---|---|\n{rows}"
    )


def _quality_section(manifest: dict[str, Any]) -> str:
    metrics = manifest.get("metrics") or {}
    ppl, base_ppl, unigram = (
        metrics.get("perplexity"),
        metrics.get("perplexity_base"),
        metrics.get("unigram_perplexity"),
    )
    where = f" on `{metrics['eval_text']}`" if metrics.get("eval_text") else ""
    tokens = f" ({metrics['num_eval_tokens']} tokens)" if metrics.get("num_eval_tokens") else ""
    rows = []
    if base_ppl:
        rows.append(f"| {manifest.get('base_model') or 'base'} (bf16) | {base_ppl:.4f} | |")
    if ppl:
        delta = f"{100 * (ppl / base_ppl - 1):+.2f}%" if base_ppl else ""
        rows.append(f"| {manifest['name']} ({manifest.get('scheme') or 'dense'}) | {ppl:.4f} | {delta} |")
    if unigram:
        rows.append(f"| unigram baseline | {unigram:.4f} | |")
    if not rows:
        return "## Quality\n\nNo quality metrics were recorded for this entry.\n"
    return (
        "## Quality\n\n"
        f"Held-out perplexity{where}{tokens}, lower is better; before = the base model, after = this "
        f"checkpoint.\n\n"
        "| model | perplexity | change vs base |\n|---|---:|---:|\n" + "\n".join(rows) + "\n"
    )


def _serve_section(manifest: dict[str, Any], config: dict[str, Any], ref: str, from_hub: bool) -> str:
    remote_code = " --trust-remote-code" if config.get("model_type") == "deepseek" else ""
    ascend_quant = " --quantization ascend" if manifest.get("format") == "msmodelslim" else ""
    pull = f"ascq zoo pull {ref}\nascq serve {ref.split('/')[1]}" if from_hub else f"ascq serve {ref}"
    return (
        "## Serve\n\n"
        f"With ascq (CPU, CUDA or Ascend NPU; OpenAI-compatible API):\n\n```bash\n{pull}\n```\n\n"
        f"With vLLM:\n\n```bash\nvllm serve {ref}{remote_code}\n```\n\n"
        "With vllm-ascend (vLLM's Ascend NPU plugin, installed next to vLLM and torch_npu):\n\n"
        f"```bash\nvllm serve {ref}{remote_code}{ascend_quant}\n```\n"
    )
