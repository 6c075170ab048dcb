"""Shared test fixtures: paths of the committed fixture models and the bundled eval/calibration text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ascq.paths import CALIB_TEXT, EVAL_TEXT, PROJECT_DIR

ZOO = PROJECT_DIR / "zoo"
TINY_LLAMA = ZOO / "tiny-llama"
TINY_DEEPSEEK_MOE = ZOO / "tiny-deepseek-moe"


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return TINY_LLAMA


@pytest.fixture(scope="session")
def tiny_deepseek_moe_dir() -> Path:
    return TINY_DEEPSEEK_MOE


@pytest.fixture(scope="session")
def eval_text_path() -> Path:
    return EVAL_TEXT


@pytest.fixture(scope="session")
def calib_text_path() -> Path:
    return CALIB_TEXT


# ---- NPU backend on the CPU torch_npu EMULATOR (issue 7; tests/npu_emulation) -----------------------------


@pytest.fixture
def npu_backend():
    """`ascq.kernels.npu` with tensors on the CPU and the torch_npu EMULATOR installed as `torch_npu`."""
    import sys

    import npu_emulation

    from ascq.kernels import npu

    previous = npu_emulation.install()
    npu.set_device("cpu")
    yield npu
    npu.set_device("npu")
    if previous is None:
        sys.modules.pop("torch_npu", None)
    else:
        sys.modules["torch_npu"] = previous


# ---- runtime: small random-weight checkpoints for the engine's math tests (issue 5)
# ---------------------------


class ByteTokenizer:
    """A tokenizer object for random-weight models: token = byte + 1, 0 = eos (the custom-tokenizer
    plug-in)."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if 0 < i < 257).decode(errors="replace")


@pytest.fixture(scope="session")
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's config (GQA 8/2, untied) with random bf16 weights, written by transformers."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("random-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=640,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-deepseek-moe's config with random bf16 weights, written from ascq's reference model."""
    import json

    import torch
    from safetensors.torch import save_file

    from ascq.reference.deepseek_moe import DeepseekConfig, DeepseekForCausalLM

    path = tmp_path_factory.mktemp("random-deepseek")
    config = DeepseekConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=2,
        n_routed_experts=16,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = DeepseekForCausalLM(config).to(torch.bfloat16)
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


# ---- converters: one conversion per (model, recipes, options) per session (issue 3)
# ------------------------------


@pytest.fixture(scope="session")
def converted_entry(tmp_path_factory: pytest.TempPathFactory):
    """`converted_entry(base_dir, recipe_names, **opts) -> Path`: `ascq convert` into a session tmp zoo,
    cached.

    `opts` are `ascq.quantize.convert.ConvertOptions` fields (num_samples, seq_len, calib, eval_text, ...); to
    keep the suite fast the calibration defaults to 32 x 256 tokens (the CLI's is 64 x 512). A missing base
    model makes the test fail (AscqError), never skip.
    """
    from ascq.quantize.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("converted")
    cache: dict[tuple, Path] = {}

    def convert_once(base_dir: Path, recipe_names: tuple[str, ...], **opts) -> Path:
        # whole eval text: stable bounds
        opts = {
            "num_samples": 32,
            "seq_len": 256,
            "max_eval_tokens": None,
            **opts,
        }
        key = (str(base_dir), tuple(recipe_names), tuple(sorted((k, str(v)) for k, v in opts.items())))
        if key not in cache:
            out = root / f"{Path(base_dir).name}-{'+'.join(Path(r).stem for r in recipe_names)}-{len(cache)}"
            cache[key] = convert(
                ConvertOptions(
                    model=str(base_dir), recipes=list(recipe_names), out=out, progress=False, **opts
                )
            )
        return cache[key]

    return convert_once


@pytest.fixture(scope="session")
def npu_converted(tmp_path_factory):
    """(base model dir, "recipe[+recipe]", format) -> entry converted once per session, small calibration
    set."""
    import functools

    from ascq.quantize.convert import ConvertOptions, convert

    short_eval = tmp_path_factory.mktemp("npu-eval") / "eval.txt"  # perplexity is not what these tests check
    short_eval.write_text(EVAL_TEXT.read_text()[:4000])

    @functools.cache
    def get(base_dir: Path, recipe: str, fmt: str = "compressed-tensors") -> Path:
        out = tmp_path_factory.mktemp("npu-entries") / f"{base_dir.name}-{recipe}-{fmt}"
        convert(
            ConvertOptions(
                str(base_dir),
                recipe.split("+"),
                out=out,
                num_samples=8,
                seq_len=128,
                format=fmt,
                eval_text=short_eval,
                progress=False,
            )
        )
        return out

    return get


# Two small zoo entries (dense and W4A16) shared by the zoo card and verify tests.
@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from zoo_builder import write_dense_entry, write_w4a16_entry

    root = tmp_path_factory.mktemp("built")
    return {
        "dense": write_dense_entry(root / "tiny-test-llama"),
        "w4a16": write_w4a16_entry(root / "tiny-test-llama-w4a16"),
    }


@pytest.fixture
def zoo(built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "zoo"
    for entry in built.values():
        shutil.copytree(entry, root / entry.name)
    monkeypatch.setenv("ASCQ_ZOO", str(root))
    return root
