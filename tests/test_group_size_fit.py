"""The recipe's group size is an upper bound: a model whose linears' input widths it does not divide
(SmolLM2's hidden 576) gets the largest power of two >= 32 that divides them all, one value per checkpoint.
Checked against plain-PyTorch fake quantization, transformers loading the checkpoint (compressed-tensors
decompressing it), and the planner's sizes against the bytes written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ascq.core.qmath import fitted_group_size, linear_group_size
from ascq.formats.manifest import read_manifest
from ascq.quantize.convert import ConvertOptions, convert, format_summary
from ascq.quantize.reference_forward import reference_logits
from ascq.quantize.synthetic import write_synthetic_checkpoint
from ascq.zoo.card import render_card
from ascq.zoo.planned import checkpoint_bytes
from ascq.zoo.verify import read_tensor_infos

# widths 192 = 3 * 64 and 448 = 7 * 64: 128 divides neither, 64 divides both (as 576 and 1536 in SmolLM2)
CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=192,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    bos_token_id=256,
    eos_token_id=256,
)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_fitted_group_size_rule() -> None:
    assert fitted_group_size(128, [576, 1536]) == 64  # SmolLM2-135M
    assert fitted_group_size(128, [4096, 11008]) == 128  # divides: the recipe's own value
    assert fitted_group_size(128, [96, 192]) == 32
    assert fitted_group_size(128, [128, 200]) is None  # 200 = 8 * 25: no power of two >= 32
    # a recipe's non-power-of-two value is kept when it divides
    assert fitted_group_size(96, [192, 288]) == 96
    assert fitted_group_size(96, [192, 320]) == 64
    assert fitted_group_size(16, [48]) == 16 and fitted_group_size(16, [40]) is None
    assert (
        linear_group_size(128, 200) is None
        and linear_group_size(128, 256) == 128
        and linear_group_size(None, 256) is None
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-192")
    write_synthetic_checkpoint(path, CONFIG)
    return path


@pytest.fixture(scope="module")
def entries(source: Path, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("entries")
    return {
        recipe: convert(
            ConvertOptions(str(source), [recipe], out=out / recipe, num_samples=4, seq_len=64, progress=False)
        )
        for recipe in ("w4a16-rtn", "awq-int4", "w4a16-gptq")
    }


def _plain_rtn(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Asymmetric int4 [-8, 7] min-max round-to-nearest over groups of `group` input columns, in plain
    PyTorch."""
    out_features, in_features = w.shape
    g = w.float().reshape(out_features, in_features // group, group)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 15
    zero = torch.round((-8 - lo / scale).clamp(-8, 7))
    scale = scale.to(scale_dtype).float()
    q = torch.round(torch.clamp(g / scale + zero, -8, 7))  # compressed-tensors' order: add, clamp, round
    return ((q - zero) * scale).reshape(out_features, in_features)


def _transformers_weights(entry: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear's weight as transformers loads it, decompressed by compressed-tensors."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        entry, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    return {name: module.weight.detach() for name, module in model.named_modules() if name.endswith(LINEARS)}


def _quantization_config(entry: Path) -> dict:
    return json.loads((entry / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "awq-int4", "w4a16-gptq"])
def test_one_fitted_group_size_written_recorded_and_loaded(recipe: str, entries: dict[str, Path]) -> None:
    entry = entries[recipe]
    qc = _quantization_config(entry)
    assert list(qc["config_groups"]) == ["group_0"]  # no per-linear fallback groups
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    manifest = read_manifest(entry)
    assert manifest["conversion"]["group_size_fallbacks"] == {}
    [fit] = manifest["conversion"]["group_size_fits"]
    assert (fit["recipe_group_size"], fit["group_size"], fit["in_features"]) == (128, 64, [192, 448])
    assert "group size 64 instead of the recipe's 128" in format_summary(entry)
    assert "weights int4 group 64" in render_card(
        entry
    ) and "does not divide every input width" in render_card(entry)
    scale_shapes = {
        shape for name, (_, shape) in read_tensor_infos(entry).items() if name.endswith("weight_scale")
    }
    assert {s[1] for s in scale_shapes} == {192 // 64, 448 // 64}, scale_shapes
    weights = _transformers_weights(entry)
    assert len(weights) == 2 * len(LINEARS)
    for name, w in weights.items():  # int4 groups of 64 columns: at most 16 distinct values per (row, group)
        groups = w.reshape(w.shape[0], -1, 64)
        assert (
            max(
                len(torch.unique(groups[r, g]))
                for r in range(0, w.shape[0], 17)
                for g in range(groups.shape[1])
            )
            <= 16
        ), name
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)(ids).logits
    ours = reference_logits(entry, ids)
    assert (hf - ours).abs().max() <= 1e-3 * (ours.max() - ours.min())
    assert checkpoint_bytes(CONFIG, recipe) == sum(
        math.prod(s) * DTYPE_BYTES[d] for d, s in read_tensor_infos(entry).values()
    )


def test_rtn_weights_are_plain_pytorch_fake_quant_at_the_fitted_group_size(
    entries: dict[str, Path], source: Path
) -> None:
    from safetensors.torch import load_file

    original = load_file(source / "model.safetensors")
    for name, w in _transformers_weights(entries["w4a16-rtn"]).items():
        expected = _plain_rtn(original[f"{name}.weight"], 64, torch.bfloat16)
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-6, msg=name)
        assert not torch.allclose(w, _plain_rtn(original[f"{name}.weight"], 32, torch.bfloat16)), name


def test_block_aligned_group_size_rule() -> None:
    from ascq.core.qmath import block_aligned_group_size, source_block_size

    assert block_aligned_group_size(128, [576, 1536], 32) == 32  # SmolLM2 from its Q4_1 GGUF
    assert block_aligned_group_size(128, [576, 1536], None) == 64  # the same widths from any other source
    assert block_aligned_group_size(32, [576], 64) == 32  # never coarser than the recipe's
    # a block that does not divide a width: no change
    assert block_aligned_group_size(128, [576, 1544], 32) is None
    # below the smallest servable group size: no change
    assert block_aligned_group_size(128, [4096], 16) == 128
    assert source_block_size({"source": {"gguf": {"quantization_type": "Q4_1"}}}) == 32
    assert source_block_size({"source": {"model": "org/name"}}) is None and source_block_size(None) is None
    assert source_block_size({"source": {"gguf": {"quantization_type": "F16"}}}) is None


def test_gguf_block_quantized_source_gets_its_block_as_group_size(source: Path, tmp_path: Path) -> None:
    """Weights on one int4 grid per 32-column block (as a GGUF Q4_0 import holds them, w = d·(q - 8)), in the
    source-grid mode (`zp_dtype: auto`): the recipe's 128 (fitted 64 for these widths) would mix two blocks'
    grids in a group; on the source's blocks round-to-nearest gives every weight back exactly, and the
    manifest, summary and card say why the group size is 32."""
    blocked = tmp_path / "blocked"
    tensors = _gguf_blocked(source, blocked, "Q4_0")
    entry = convert(
        ConvertOptions(
            str(blocked),
            [_source_grid_recipe("w4a16-rtn", "auto", tmp_path)],
            out=tmp_path / "rtn",
            num_samples=2,
            seq_len=32,
            max_eval_tokens=256,
            progress=False,
        )
    )
    group = _quantization_config(entry)["config_groups"]["group_0"]
    assert (group["weights"]["group_size"], group["format"]) == (32, "pack-quantized")
    [fit] = read_manifest(entry)["conversion"]["group_size_fits"]
    assert (fit["recipe_group_size"], fit["group_size"], fit["source_block_size"]) == (128, 32, 32)
    assert "quantized in GGUF blocks of 32 columns" in format_summary(entry)
    assert "quantized in GGUF blocks of 32 columns" in render_card(entry)
    for name, w in _transformers_weights(entry).items():
        torch.testing.assert_close(w, tensors[f"{name}.weight"].float(), rtol=0, atol=0, msg=name)
        # g64 is lossy
        assert not torch.equal(_plain_rtn(tensors[f"{name}.weight"], 64, torch.bfloat16), w), name


def _source_grid_recipe(recipe: str, mode: str, tmp_path: Path) -> str:
    """A named int4 recipe with `zp_dtype: MODE` (a source-grid mode, `schemes.SOURCE_GRID`) added."""
    from ascq.paths import RECIPES_DIR

    modifier_targets = "\n      targets: [Linear]\n"  # the modifier's own arguments are indented 6
    text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    assert text.count(modifier_targets) == 1
    path = tmp_path / f"{recipe}-{mode}.yaml"
    path.write_text(text.replace(modifier_targets, f"{modifier_targets}      zp_dtype: {mode}\n"))
    return str(path)


def _gguf_blocked(source: Path, dest: Path, quantization_type: str) -> dict[str, torch.Tensor]:
    """`source` with every linear's weight on a GGUF-style grid per 32-column block (k in 0..15, d a power of
    two, every block spanning its whole grid so min-max scale = d; every value exact in bf16), and an
    ascq.json naming the GGUF type. Q4_0: w = d·(k - 8), which an integer zero point holds. Otherwise
    Q4_1-style: w = d·k + m with m = -d·(j + f) and a fractional f, a float minimum an integer zero point
    cannot hold. Returns the written tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    generator = torch.Generator().manual_seed(2)
    for name, w in tensors.items():
        if name.endswith(tuple(f"{lin}.weight" for lin in LINEARS)):
            rows, cols = w.shape
            k = torch.randint(0, 16, (rows, cols // 32, 32), generator=generator).float()
            k[..., 0], k[..., 1] = 0, 15
            d = 2.0 ** -torch.randint(6, 9, (rows, cols // 32, 1), generator=generator).float()
            if quantization_type == "Q4_0":
                m = -8 * d
            else:
                frac = torch.tensor([0.25, 0.5, 0.75])[
                    torch.randint(0, 3, (rows, cols // 32, 1), generator=generator)
                ]
                m = -d * (torch.randint(1, 14, (rows, cols // 32, 1), generator=generator) + frac)
            tensors[name] = (d * k + m).reshape(rows, cols).to(w.dtype)
            assert torch.equal(tensors[name].float(), (d * k + m).reshape(rows, cols))  # exact in bf16
    save_file(tensors, dest / "model.safetensors")
    (dest / "ascq.json").write_text(
        json.dumps({"name": dest.name, "source": {"gguf": {"quantization_type": quantization_type}}})
    )
    return tensors


@pytest.fixture(scope="module")
def q4_1_source(source: Path, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    dest = tmp_path_factory.mktemp("q4_1") / "q4_1"
    return dest, _gguf_blocked(source, dest, "Q4_1")


def _convert(model: Path, recipe: str, out: Path) -> Path:
    return convert(
        ConvertOptions(
            str(model), [recipe], out=out, num_samples=2, seq_len=32, max_eval_tokens=256, progress=False
        )
    )


@pytest.mark.parametrize("recipe", ["w4a16-rtn", "awq-int4-source-grid", "w4a16-gptq"])
def test_float_min_source_kept_exactly_by_float_zero_points(recipe: str, q4_1_source, tmp_path: Path) -> None:
    """A Q4_1-style source (a float minimum per 32-column block) in the source-grid mode (`zp_dtype: float`,
    or the named recipe awq-int4-source-grid): the planner picks bf16 zero points at the block size; every
    int4 recipe gives every weight back exactly (transformers decompressing the checkpoint), the config says
    zp_dtype bfloat16 in compressed-tensors' naive-quantized format, and ascq.json, the summary and the card
    say why."""
    source, tensors = q4_1_source
    named = recipe.endswith("-source-grid")
    recipe_path = recipe if named else _source_grid_recipe(recipe, "float", tmp_path)
    entry = _convert(source, recipe_path, tmp_path / "entry")
    qc = _quantization_config(entry)
    group = qc["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["group_size"], group["weights"]["zp_dtype"]) == (
        "naive-quantized",
        32,
        "torch.bfloat16",
    )
    [fit] = read_manifest(entry)["conversion"]["group_size_fits"]
    assert (fit["group_size"], fit["zp_dtype"], fit["zp_dtype_from"]) == (32, "bfloat16", "source")
    assert (
        "bfloat16 zero points (the source's GGUF blocks of 32 columns each have a float minimum"
        in format_summary(entry)
    )
    card = render_card(entry)
    assert "bfloat16 zero points" in card and "vLLM's int4 kernels cannot" in card
    infos = read_tensor_infos(entry)
    zp = {d for n, (d, _) in infos.items() if n.endswith("weight_zero_point")}
    assert zp == {"BF16"} and all(
        d == "I8" for n, (d, _) in infos.items() if n.endswith(".weight") and "proj" in n
    )
    for name, w in _transformers_weights(entry).items():
        torch.testing.assert_close(w, tensors[f"{name}.weight"].float(), rtol=0, atol=0, msg=name)
    # on the source's grid AWQ searches no scales (awq_modifier: s = 1 there)
    if recipe.startswith("awq-int4"):
        layers = read_manifest(entry)["conversion"]["layers"].values()
        assert all(not layer["awq"]["alpha"] for layer in layers)
        skipped = [s for layer in layers for s in layer["awq"]["skipped"]]
        assert skipped and all("on the source's quantization grid" in s or "v_proj" in s for s in skipped), (
            skipped
        )
