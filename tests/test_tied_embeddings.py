"""Tied embeddings (no lm_head tensor, as SmolLM2): every shipped recipe's output keeps lm_head / embeddings /
router in `ignore`, and transformers loads it with perplexity within the recipe's bound of the tied model's
own."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.paths import shipped_recipes
from ascq.quantize.convert import ConvertOptions, convert

# perplexity bound vs full precision per recipe (transformers-loadable ones); kv-int8-c8 is msModelSlim-only
BOUNDS = {
    "w8a8": 0.03,
    "w8a8-static": 0.03,
    "w8a16": 0.01,
    "w4a16-rtn": 0.08,
    "awq-int4": 0.08,
    "w4a16-gptq": 0.08,
    "w4a8-dynamic": 0.10,
    "fp8-kv": 0.03,
}
MSMODELSLIM_ONLY = {"kv-int8-c8": ["w8a8", "kv-int8-c8"]}


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory, tiny_llama_dir: Path) -> Path:
    """tiny-llama with one shared embedding/head matrix (its trained lm_head) and `tie_word_embeddings:
    true`."""
    out = tmp_path_factory.mktemp("tied") / "tiny-llama-tied"
    shutil.copytree(tiny_llama_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True), indent=2))
    (out / "ascq.json").unlink()  # not the fixture any more
    return out


@pytest.fixture(scope="module")
def eval_ids(tied_llama: Path) -> torch.Tensor:
    return eval_windows(load_eval_token_ids(tied_llama), 256)[:4]


def test_tied_w8a8_loads_in_transformers_with_head_unquantized(tied_llama, eval_ids, tmp_path) -> None:
    entry = convert(
        ConvertOptions(
            str(tied_llama), ["w8a8"], out=tmp_path / "e", num_samples=4, seq_len=64, progress=False
        )
    )
    assert {"lm_head", "model.embed_tokens"} <= set(
        json.loads((entry / "config.json").read_text())["quantization_config"]["ignore"]
    )
    assert _hf_perplexity(entry, eval_ids[:1]) <= _hf_perplexity(tied_llama, eval_ids[:1]) * 1.03


def _hf_perplexity(entry: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()
    assert "lm_head.weight" not in load_file(next(entry.glob("*.safetensors")))
    assert not hasattr(model.lm_head, "quantization_scheme")  # the head is full precision
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


@pytest.mark.slow  # 9 conversions + transformers loads: ~3 min idle, ~9 min on a loaded 2-core machine
def test_every_shipped_recipe_on_a_tied_model(
    tied_llama: Path, eval_ids: torch.Tensor, tmp_path: Path
) -> None:
    assert set(shipped_recipes()) == set(BOUNDS) | set(MSMODELSLIM_ONLY), "a new recipe needs a bound here"
    base = _hf_perplexity(tied_llama, eval_ids)
    for name, bound in BOUNDS.items():
        entry = convert(
            ConvertOptions(
                str(tied_llama), [name], out=tmp_path / name, num_samples=8, seq_len=128, progress=False
            )
        )
        config = json.loads((entry / "config.json").read_text())
        ignore = config["quantization_config"].get("ignore") or []
        assert {"lm_head", "model.embed_tokens"} <= set(ignore), (name, ignore)
        ppl = _hf_perplexity(entry, eval_ids)
        assert ppl <= base * (1 + bound), (name, ppl, base)
    for name, recipes in MSMODELSLIM_ONLY.items():
        entry = convert(
            ConvertOptions(
                str(tied_llama),
                recipes,
                out=tmp_path / name,
                num_samples=8,
                seq_len=128,
                format="msmodelslim",
                progress=False,
            )
        )
        labels = json.loads((entry / "quant_model_description.json").read_text())
        assert "lm_head.weight" not in labels and labels["model.embed_tokens.weight"] == "FLOAT"
