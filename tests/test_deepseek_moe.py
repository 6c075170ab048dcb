"""The plain-PyTorch DeepSeek-MoE reference against independently written math and against transformers'
Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ascq.core.errors import AscqError
from ascq.reference.deepseek_moe import DeepseekConfig, DeepseekForCausalLM, DeepseekMoE, load_deepseek

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=8,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.2,
)

# keys of deepseek-ai/deepseek-moe-16b-base's config.json
DEEPSEEK_16B_CONFIG = {
    "architectures": ["DeepseekForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig"},
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 4096,
    "model_type": "deepseek",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0",
    "use_cache": True,
    "vocab_size": 102400,
}


def tiny_model(seed: int = 0, **overrides) -> DeepseekForCausalLM:
    torch.manual_seed(seed)
    return DeepseekForCausalLM(DeepseekConfig(**{**TINY, **overrides})).eval()


def rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def mlp(x, prefix, sd):
    return (
        F.silu(x @ sd[f"{prefix}.gate_proj.weight"].T)
        * (x @ sd[f"{prefix}.up_proj.weight"].T)
        @ sd[f"{prefix}.down_proj.weight"].T
    )


def moe_by_hand(x, prefix, sd, cfg):
    """Token by token: softmax scores, the k largest (weights not renormalised), plus the shared experts."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = torch.softmax(sd[f"{prefix}.gate.weight"] @ x[t], dim=0)
        chosen = sorted(range(cfg.n_routed_experts), key=lambda e: -scores[e].item())[
            : cfg.num_experts_per_tok
        ]
        total = sum(scores[e] for e in chosen) if cfg.norm_topk_prob else 1.0
        for e in chosen:
            out[t] += scores[e] / total * mlp(x[t], f"{prefix}.experts.{e}", sd)
        out[t] += mlp(x[t], f"{prefix}.shared_experts", sd)
    return out


def attention_by_hand(x, prefix, sd, cfg):
    seq, d = x.shape[0], cfg.head_dim
    q = (x @ sd[f"{prefix}.q_proj.weight"].T).view(seq, -1, d)
    k = (x @ sd[f"{prefix}.k_proj.weight"].T).view(seq, -1, d)
    v = (x @ sd[f"{prefix}.v_proj.weight"].T).view(seq, -1, d)
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    angle = pos * torch.tensor([cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]

    def rope(t):  # rotate pairs (i, i + d/2)
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    q, k = rope(q), rope(k)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    out = torch.empty_like(q)
    for h in range(cfg.num_attention_heads):
        logits = q[:, h] @ k[:, h // group].T / math.sqrt(d)
        logits = logits.masked_fill(torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), float("-inf"))
        out[:, h] = torch.softmax(logits, dim=-1) @ v[:, h // group]
    return out.reshape(seq, -1) @ sd[f"{prefix}.o_proj.weight"].T


def forward_by_hand(model: DeepseekForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    cfg, sd = model.config, model.state_dict()
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        x = x + attention_by_hand(
            rms_norm(x, sd[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps), f"{p}.self_attn", sd, cfg
        )
        h = rms_norm(x, sd[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + (
            moe_by_hand(h, f"{p}.mlp", sd, cfg) if i >= cfg.first_k_dense_replace else mlp(h, f"{p}.mlp", sd)
        )
    return rms_norm(x, sd["model.norm.weight"], cfg.rms_norm_eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_causal_lm_matches_hand_computed_forward(norm_topk_prob):
    model = tiny_model(norm_topk_prob=norm_topk_prob)
    ids = torch.randint(0, TINY["vocab_size"], (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], forward_by_hand(model, ids[0]), rtol=1e-4, atol=1e-4)


def test_state_dict_keys_are_hf_names():
    keys = set(tiny_model().state_dict())
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.0.mlp.gate.weight" not in keys
    assert tuple(tiny_model().state_dict()["model.layers.1.mlp.gate.weight"].shape) == (6, 32)
    for name in ("gate", "experts.5.up_proj", "shared_experts.down_proj"):
        assert f"model.layers.2.mlp.{name}.weight" in keys
    assert tuple(tiny_model().state_dict()["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape) == (
        16,
        32,
    )


def test_without_routed_experts_equals_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model(n_routed_experts=None)
    llama_keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
    )
    llama = LlamaForCausalLM(LlamaConfig(**{k: TINY[k] for k in llama_keys}, tie_word_embeddings=False))
    llama.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), llama.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_decoder_layer_alone_with_linear_rope_scaling():
    scaled = tiny_model(rope_scaling={"type": "linear", "factor": 2.0}).model.layers[1]
    plain = tiny_model().model.layers[1]
    plain.load_state_dict(scaled.state_dict())
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        out = scaled(x, torch.tensor([[0, 2, 4]]))
        assert out.shape == x.shape
        # linear scaling divides positions by the factor
        torch.testing.assert_close(out, plain(x, torch.tensor([[0, 1, 2]])), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, plain(x, torch.tensor([[0, 2, 4]])), atol=1e-4)


def test_aux_loss_and_routing_counts_follow_deepseek_formula():
    model = tiny_model().train()
    ids = torch.randint(0, 64, (3, 10))
    model(ids)
    moe: DeepseekMoE = model.moe_layers()[0]
    h = model.model.layers[1]  # recompute the router input of the first MoE layer by hand
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        x = model.model.layers[0](x, torch.arange(10)[None])
        x = x + h.self_attn(h.input_layernorm(x), torch.arange(10)[None])
        scores = torch.softmax(h.post_attention_layernorm(x) @ moe.gate.weight.T, dim=-1)  # [3, 10, 6]
    chosen = scores.topk(2, dim=-1).indices
    load = torch.stack([torch.bincount(c.flatten(), minlength=6) for c in chosen]).float() / (10 * 2 / 6)
    expected = (load * scores.mean(dim=1)).sum(dim=1).mean() * moe.config.aux_loss_alpha
    torch.testing.assert_close(moe.aux_loss.detach(), expected, rtol=1e-4, atol=1e-7)
    assert model.aux_loss().requires_grad and len(model.moe_layers()) == 2

    model.eval().record_routing(True)
    with torch.no_grad():
        model(ids)
    counts = model.routed_token_counts()
    assert counts.shape == (2, 6) and counts.sum(dim=1).tolist() == [60, 60]
    assert torch.equal(counts[0], torch.bincount(chosen.flatten(), minlength=6))
    assert model.moe_layers()[0].aux_loss is None


def test_load_deepseek_sharded_bf16(tmp_path):
    model = tiny_model()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:20], "model-00002-of-00002.safetensors": names[20:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    loaded = load_deepseek(tmp_path)
    assert not loaded.training and loaded.lm_head.weight.dtype == torch.float32
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k].float()), k
    assert loaded.moe_layers()[0].routed_token_counts.device.type == "cpu"


def test_load_deepseek_bad_inputs(tmp_path):
    with pytest.raises(AscqError, match="config.json is missing"):
        load_deepseek(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_16B_CONFIG, "model_type": "llama"}))
    with pytest.raises(AscqError, match="model_type"):
        load_deepseek(tmp_path)
    model = tiny_model()
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    with pytest.raises(AscqError, match="model.safetensors is missing"):
        load_deepseek(tmp_path)
    save_file({"model.norm.weight": torch.ones(32)}, tmp_path / "model.safetensors")
    with pytest.raises(AscqError, match="do not match"):
        load_deepseek(tmp_path)


def test_config_accepts_the_16b_config_and_rejects_unsupported():
    cfg = DeepseekConfig.from_dict(DEEPSEEK_16B_CONFIG)
    assert (cfg.n_routed_experts, cfg.head_dim, cfg.is_moe_layer(0), cfg.is_moe_layer(1)) == (
        64,
        128,
        False,
        True,
    )
    hf = cfg.to_hf_dict()
    assert set(DEEPSEEK_16B_CONFIG) - set(hf) == {"auto_map", "transformers_version"}
    for bad in ({"scoring_func": "sigmoid"}, {"hidden_act": "gelu"}, {"rope_scaling": {"type": "yarn"}}):
        with pytest.raises(AscqError):
            DeepseekConfig.from_dict({**DEEPSEEK_16B_CONFIG, **bad})
    with pytest.raises(AscqError, match="num_experts_per_tok"):
        DeepseekConfig.from_dict({**DEEPSEEK_16B_CONFIG, "num_experts_per_tok": 65})
