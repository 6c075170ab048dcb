"""The engine's own models against independent references: transformers (Llama family) and ascq's
plain-PyTorch DeepSeek-MoE reference, greedy token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import make_engine, run_batch

from ascq.reference.deepseek_moe import load_deepseek
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.sampling.sampling_params import SamplingParams


def run_greedy(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True
) -> list[list[int]]:
    done = run_batch(
        engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    )
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def random_prompts(num: int, lengths: tuple[int, int], vocab: int = 4096, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (num,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in sizes]


def text_prompts(tokenizer, num: int, eval_text: Path) -> list[list[int]]:
    ids = tokenizer.encode(eval_text.read_text()[:200_000])
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - 200, (num,), generator=g).tolist()
    lengths = torch.randint(4, 120, (num,), generator=g).tolist()
    return [ids[s : s + n] for s, n in zip(starts, lengths, strict=True)]


def hf_greedy(model, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    return reference_greedy_batch(model, [prompt], max_tokens)[0]


def reference_greedy_batch(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding without a cache: the whole sequence is recomputed each step. Sequences are
    right-padded, which a causal model never attends to, and each one's next token is read at its own last
    position."""
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for _ in range(max_tokens):
            width = max(len(s) for s in seqs)
            batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            logits = model(batch)
            for i, s in enumerate(seqs):
                s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def test_random_llama_greedy_matches_transformers(random_llama_dir, byte_tokenizer):
    engine = make_engine(random_llama_dir, byte_tokenizer)
    hf = transformers.LlamaForCausalLM.from_pretrained(random_llama_dir, dtype=torch.float32)
    prompts = random_prompts(6, (1, 40))
    got = run_greedy(engine, prompts, 12)
    assert got == [hf_greedy(hf, p, 12, None) for p in prompts]


def test_random_deepseek_greedy_matches_reference(random_deepseek_dir, byte_tokenizer):
    engine = make_engine(random_deepseek_dir, byte_tokenizer)
    reference = load_deepseek(random_deepseek_dir, torch.float32).eval()
    prompts = random_prompts(4, (3, 30))
    assert run_greedy(engine, prompts, 8) == [reference_greedy(reference, p, 8) for p in prompts]


@pytest.mark.parametrize(
    "variant",
    [
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "num_key_value_heads": 4, "head_dim": 16},
    ],
    ids=["qwen2-bias-tied", "llama3-rope", "linear-rope-mha-headdim"],
)
def test_llama_family_variants_match_transformers(tmp_path, byte_tokenizer, variant):
    base = dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    config_cls = (
        transformers.Qwen2Config if variant.get("model_type") == "qwen2" else transformers.LlamaConfig
    )
    config = config_cls(
        **{**base, **{k: v for k, v in variant.items() if k not in ("architectures", "model_type")}}
    )
    model_cls = (
        transformers.Qwen2ForCausalLM
        if config_cls is transformers.Qwen2Config
        else transformers.LlamaForCausalLM
    )
    torch.manual_seed(1)
    hf = model_cls(config).float().eval()
    if variant.get("model_type") == "qwen2":  # make the q/k/v biases matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("tie_word_embeddings", False) == variant.get("tie_word_embeddings", False)
    engine = make_engine(tmp_path, byte_tokenizer)
    prompts = random_prompts(3, (20, 150), vocab=512, seed=2)
    outs = run_batch(engine, prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0, -1].log_softmax(-1)
        values, ids = expected.topk(5)
        got = outs[str(i)].outputs[0].logprobs[0]
        assert set(ids.tolist()) <= set(got)
        torch.testing.assert_close(torch.tensor([got[t] for t in ids.tolist()]), values, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_tiny_llama_greedy_matches_transformers(tiny_llama_dir, eval_text_path):
    engine = make_engine(tiny_llama_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = text_prompts(engine.tokenizer, 32, eval_text_path)
    got = run_greedy(engine, prompts, 64, ignore_eos=False)
    expected = [hf_greedy(hf, p, 64, engine.tokenizer.eos_token_id) for p in prompts]
    assert got == expected


@pytest.mark.slow
def test_tiny_deepseek_moe_greedy_matches_reference(tiny_deepseek_moe_dir, eval_text_path):
    engine = make_engine(tiny_deepseek_moe_dir)
    reference = load_deepseek(tiny_deepseek_moe_dir, torch.float32).eval()
    prompts = text_prompts(engine.tokenizer, 32, eval_text_path)
    assert run_greedy(engine, prompts, 64) == reference_greedy_batch(reference, prompts, 64)
