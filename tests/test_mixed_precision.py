"""Mixed precision under a bits budget (`ascq.quantize.mixed`, `--bits-per-weight`, recipe `int4-mixed`): the
allocator's arithmetic, and converted entries whose linears carry every candidate scheme (int8 per channel,
int4 g32 / g64 / g128) in several explicit-target config groups: the achieved bits per weight is the card's
count of the stored tensors and meets the budget, the reference backend serves the converter's own logits
bit for bit, the cpu backend's kernels agree with it, and transformers reads the entry to the same greedy
tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine
from test_int4_default_format import _prompts, assert_transformers_greedy_equals_runtime
from test_runtime_loader import prefill_logits

from ascq.core.errors import AscqError, UnsupportedError
from ascq.evaluate import eval_windows, load_eval_token_ids
from ascq.formats.manifest import read_manifest
from ascq.paths import EVAL_TEXT
from ascq.quantize.convert import ConvertOptions, convert
from ascq.quantize.mixed import Unit, _hull, allocate
from ascq.quantize.recipe import load_recipe, parse_recipe
from ascq.quantize.reference_forward import reference_logits
from ascq.zoo.card import quantized_weight_bits, render_card
from ascq.zoo.verify import verify_entry


def _unit(name: str, params: int, *options: tuple[str, int, float]) -> Unit:
    return Unit([name], params, list(options))


def test_hull_drops_options_no_cheaper_per_bit() -> None:
    # (bits, error): b at 5 bits lies above the line from a to c, d removes no error
    options = [("a", 4, 10.0), ("b", 5, 9.0), ("c", 6, 2.0), ("d", 8, 2.0)]
    assert [o[0] for o in _hull(options)] == ["a", "c"]


def test_allocate_spends_the_budget_where_error_drops_most_per_bit() -> None:
    units = [
        _unit("flat", 100, ("int4", 400, 10.0), ("int8", 800, 9.0)),
        _unit("steep", 100, ("int4", 400, 10.0), ("int8", 800, 1.0)),
    ]
    assert allocate(units, 4.0) == ["int4", "int4"]
    assert allocate(units, 6.0) == ["int4", "int8"]  # one upgrade fits: the one removing 9, not 1
    assert allocate(units, 8.0) == ["int8", "int8"]
    with pytest.raises(AscqError, match="below the fewest bits"):
        allocate(units, 3.9)


def test_allocate_meets_the_budget_and_never_spends_for_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    units = []
    for i in range(40):
        params = int(torch.randint(10, 1000, (1,), generator=gen))
        errors = sorted(torch.rand(4, generator=gen).tolist(), reverse=True)
        bits = [4.16, 4.31, 4.63, 8.03]
        units.append(
            Unit(
                [f"u{i}"],
                params,
                [(f"c{k}", int(b * params), e) for k, (b, e) in enumerate(zip(bits, errors, strict=True))],
            )
        )
    total = sum(u.params for u in units)
    errors_by_budget = []
    for budget in (4.2, 4.5, 4.8, 5.5, 9.0):
        picks = allocate(units, budget)
        spent = sum(next(b for n, b, _ in u.options if n == p) for u, p in zip(units, picks, strict=True))
        error = sum(next(e for n, _, e in u.options if n == p) for u, p in zip(units, picks, strict=True))
        assert spent <= budget * total
        errors_by_budget.append(error)
    assert errors_by_budget[-1] < errors_by_budget[0]
    assert allocate(units, 9.0) == [min(u.options, key=lambda o: o[2])[0] for u in units]


def test_recipe_budget_is_validated() -> None:
    base = "quant_stage:\n  quant_modifiers:\n    AWQModifier:\n      scheme: {scheme}\n"
    recipe = parse_recipe("r", base.format(scheme="W4A16_ASYM") + "      bits_per_weight: 4.5\n")
    assert recipe.modifiers[0].quant_scheme().budget.bits_per_weight == 4.5
    with pytest.raises(UnsupportedError, match="weight-only int4 group scheme"):
        parse_recipe("r", base.format(scheme="W8A16") + "      bits_per_weight: 4.5\n")
    with pytest.raises(UnsupportedError, match="int4-g16"):
        parse_recipe(
            "r", base.format(scheme="W4A16") + "      bits_per_weight: 5\n      mixed_schemes: [int4-g16]\n"
        )
    with pytest.raises(AscqError, match="mixed_schemes needs bits_per_weight"):
        parse_recipe("r", base.format(scheme="W4A16") + "      mixed_schemes: [int8]\n")
    with pytest.raises(AscqError, match="outside"):
        parse_recipe("r", base.format(scheme="W4A16") + "      bits_per_weight: 1.5\n")
    assert load_recipe("int4-mixed").modifiers[0].quant_scheme().budget is not None


def _mixed_recipe(tmp_path: Path, candidates: list[str], bits: float) -> Path:
    text = load_recipe("int4-mixed").text.replace("bits_per_weight: 4.8", f"bits_per_weight: {bits}")
    text = text.replace(
        "mixed_schemes: [int8, int4-g32, int4-g64, int4-g128]", f"mixed_schemes: [{', '.join(candidates)}]"
    )
    path = tmp_path / f"mixed-{'-'.join(candidates)}.yaml"
    path.write_text(text)
    return path


# two budgets between two candidates each: every candidate is chosen for some linear
MIXES = [(["int8", "int4-g128"], 5.5), (["int4-g32", "int4-g64"], 4.45)]


@pytest.mark.parametrize(("candidates", "bits"), MIXES, ids=["int8+g128", "g32+g64"])
def test_mixed_entry_meets_budget_and_every_backend_serves_it(
    candidates: list[str], bits: float, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    entry = convert(
        ConvertOptions(
            str(tiny_llama_dir),
            [str(_mixed_recipe(tmp_path, candidates, bits))],
            out=tmp_path / "entry",
            num_samples=4,
            seq_len=64,
            evaluate=False,
            progress=False,
        )
    )
    record = read_manifest(entry)["conversion"]["mixed_precision"]
    assert set(record["choice"].values()) == set(candidates)
    stored_bits, params = quantized_weight_bits(entry)
    assert record["bits_per_weight"] == pytest.approx(stored_bits / params, abs=1e-4)
    assert stored_bits / params <= bits
    qc = json.loads((entry / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and len(qc["config_groups"]) == 3  # + the recipe's int8 lm_head
    targets = [t for g in qc["config_groups"].values() for t in g["targets"] if t != "lm_head"]
    assert sorted(targets) == sorted(record["choice"])  # explicit names, each linear once
    for layer in range(4):  # linears that read one input share one scheme (fused in vLLM and ascq)
        q = f"model.layers.{layer}.self_attn."
        m = f"model.layers.{layer}.mlp."
        assert (
            record["choice"][q + "q_proj"] == record["choice"][q + "k_proj"] == record["choice"][q + "v_proj"]
        )
        assert record["choice"][m + "gate_proj"] == record["choice"][m + "up_proj"]
    card = render_card(entry)
    assert f"| bits per weight | {stored_bits / params:.2f} " in card
    assert "| mixed precision |" in card

    windows = eval_windows(load_eval_token_ids(tiny_llama_dir), 64)[:2]
    converter = reference_logits(entry, windows)
    reference = make_engine(entry, device="reference", dtype="float32")
    cpu = make_engine(entry, device="cpu", dtype="float32")
    for window, expected in zip(windows, converter, strict=True):
        assert torch.equal(prefill_logits(reference, window.tolist()), expected)
        served = prefill_logits(cpu, window.tolist())
        torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert_transformers_greedy_equals_runtime(entry, _prompts(4, 4096), 16)


def test_bits_per_weight_flag_overrides_and_rejects(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def run(recipe: str, bits: float) -> Path:
        return convert(
            ConvertOptions(
                str(tiny_llama_dir),
                [recipe],
                out=tmp_path / f"{recipe}-{bits}",
                num_samples=2,
                seq_len=32,
                evaluate=False,
                progress=False,
                bits_per_weight=bits,
            )
        )

    with pytest.raises(UnsupportedError, match="weight-only int4 group scheme"):
        run("w8a8", 4.5)
    with pytest.raises(AscqError, match="below the fewest bits"):
        run("awq-int4", 4.1)
    record = read_manifest(run("awq-int4", 4.3))["conversion"]["mixed_precision"]
    assert record["target_bits_per_weight"] == 4.3 and record["bits_per_weight"] <= 4.3


def _tied_copy(base: Path, out: Path) -> Path:
    """tiny-llama with tied embeddings (its lm_head dropped, the embedding serving as the head)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for file in base.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy2(file, out / file.name)
    state = load_file(base / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


def test_tied_head_is_written_as_an_untied_int8_copy(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """int4-mixed's `lm_head: int8` on a tied model: the embedding stays as it was, the head is an untied
    int8 per-row copy that transformers reads and ascq serves (the reference backend bit for bit the
    converter's own forward); the card says who reads it."""
    from safetensors import safe_open

    base = _tied_copy(tiny_llama_dir, tmp_path / "tied")
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text(EVAL_TEXT.read_text()[:6000])
    options = ConvertOptions(
        str(base), ["int4-mixed"], out=tmp_path / "entry", num_samples=2, seq_len=32, eval_text=eval_text
    )
    entry = convert(dataclasses.replace(options, progress=False))
    config = json.loads((entry / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    qc = config["quantization_config"]
    assert "lm_head" not in qc["ignore"]
    [head_group] = [g for g in qc["config_groups"].values() if g["targets"] == ["lm_head"]]
    assert (head_group["weights"]["num_bits"], head_group["weights"]["strategy"]) == (8, "channel")
    with safe_open(entry / "model.safetensors", "pt") as f, safe_open(base / "model.safetensors", "pt") as b:
        assert torch.equal(
            f.get_tensor("model.embed_tokens.weight"), b.get_tensor("model.embed_tokens.weight")
        )
        assert "lm_head.weight_scale" in set(f.keys())
    manifest = read_manifest(entry)
    assert manifest["conversion"]["lm_head"]["untied_from_embedding"] is True
    # measured with the dequantized head
    metrics = manifest["metrics"]
    assert metrics["perplexity"] < 1.2 * metrics["perplexity_base"]
    assert "ascq and transformers only" in render_card(entry)
    verify_entry(entry)

    windows = eval_windows(load_eval_token_ids(tiny_llama_dir), 64)[:2]
    converter = reference_logits(entry, windows)
    reference = make_engine(entry, device="reference", dtype="float32")
    cpu = make_engine(entry, device="cpu", dtype="float32")
    for window, expected in zip(windows, converter, strict=True):
        assert torch.equal(prefill_logits(reference, window.tolist()), expected)
        served = prefill_logits(cpu, window.tolist())
        torch.testing.assert_close(served, expected, rtol=1e-3, atol=2e-3 * expected.abs().max().item())
    assert_transformers_greedy_equals_runtime(entry, _prompts(4, 4096), 16)
