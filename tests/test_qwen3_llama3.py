"""Qwen 3 (per-head q/k norms, no biases), Qwen 3 MoE and Llama 3.x (llama3 rope scaling) against
transformers' own model classes: tiny random-weight checkpoints built from transformers' configs and written
by `save_pretrained` (safetensors, tiny-llama's tokenizer), served by ascq in fp32, greedy tokens equal to
transformers' over 8 prompts x 32 tokens, one prompt longer than the original rope context; and `ascq
convert` with the main recipes converts and serves them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import make_engine
from native_support import needs_native
from test_distributed import assert_same_tokens
from test_runtime_models import run_greedy, text_prompts

from ascq.paths import PROJECT_DIR

TINY_LLAMA = PROJECT_DIR / "zoo" / "tiny-llama"

ORIGINAL_CONTEXT = 64  # llama3 rope scaling's original_max_position_embeddings: the long prompt exceeds it
BASE = dict(
    vocab_size=4096,  # tiny-llama's tokenizer
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=0,
)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {  # layer 0 dense, layer 1 routed
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            }
        },
    ),
}


def write_checkpoint(family: str, path: Path) -> Path:
    """A random-weight fp32 checkpoint of `family` with tiny-llama's tokenizer; Qwen 3's q/k norm weights
    are drawn away from 1 so that a norm left out or misloaded changes the tokens, and MoE routers wide
    enough that routing is no near-tie."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**BASE, **extra)).float().eval()
    for layer in model.model.layers:
        for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
        router = getattr(layer.mlp, "gate", None)
        if router is not None:
            torch.nn.init.normal_(router.weight, std=0.5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LLAMA / name, path / name)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def prompts_for(tokenizer, eval_text_path: Path) -> list[list[int]]:
    """7 text prompts of 4..119 tokens and one of 1.5x the original rope context."""
    prompts = text_prompts(tokenizer, 7, eval_text_path)
    long = tokenizer.encode(eval_text_path.read_text()[:20_000])[: ORIGINAL_CONTEXT * 3 // 2]
    assert len(long) > ORIGINAL_CONTEXT
    return [*prompts, long]


def transformers_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens (its KV-cached generate; no EOS). The attention mask is given: inferred,
    it would mask every prompt token equal to the pad id (0, which the text prompts contain)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(checkpoint, eval_text_path):
    family, path = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    if family == "llama3":  # the saved config keeps the scaling transformers applies
        assert config.rope_parameters["rope_type"] == "llama3"
    assert any(p.suffix == ".safetensors" for p in path.iterdir())
    engine = make_engine(path, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILIES[family][1].__name__
    prompts = prompts_for(engine.tokenizer, eval_text_path)
    got = run_greedy(engine, prompts, 32)
    expected = [transformers_greedy(hf, p, 32) for p in prompts]
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["w8a8", "awq-int4", "w4a16-gptq"])
def test_main_recipes_convert_and_serve(checkpoint, converted_entry, recipe, eval_text_path):
    family, path = checkpoint
    entry = converted_entry(path, (recipe,), num_samples=8, seq_len=64, max_eval_tokens=1024)
    config = transformers.AutoConfig.from_pretrained(entry)
    assert config.quantization_config["quant_method"] == "compressed-tensors"
    engine = make_engine(entry, dtype="float32")
    prompts = prompts_for(engine.tokenizer, eval_text_path)[-2:]
    got = run_greedy(engine, prompts, 8)
    assert all(len(tokens) == 8 for tokens in got)


@needs_native
def test_qwen3_bf16_serves_eagerly_with_the_fused_decode_refused(checkpoint, monkeypatch):
    """The C fused decode has no q/k norms: a bf16 Qwen 3 (MoE) model says so and decodes on its eager path;
    the Llama 3.x checkpoint (rope scaling only changes the cos/sin tables it is handed) fuses."""
    family, path = checkpoint
    monkeypatch.setenv("ASCQ_FUSED_DECODE", "1")
    engine = make_engine(path, dtype="bfloat16")
    reason = engine.runner.fused_decode_reason
    if family == "llama3":
        assert engine.model.model.fused_decode is not None, reason
        return
    assert engine.model.model.fused_decode is None and "q/k norms" in reason
    prompt = [3 + (5 * j) % 100 for j in range(12)]
    assert len(run_greedy(engine, [prompt], 4)[0]) == 4


@pytest.mark.slow
def test_tensor_parallel_gives_the_single_process_tokens(checkpoint):
    """TP 2 (and TP 2 + expert parallelism for Qwen 3 MoE) over gloo: the single process's greedy tokens."""
    family, path = checkpoint
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": family == "qwen3-moe"}
    assert_same_tokens(path, 4, 8, **parallel)
