"""Batch-1 decode micro-benchmark on a synthetic >= 1B-parameter Llama (TinyLlama-1.1B shapes, random weights
built in memory), run through the engine's own model class (`ascq/runtime/models/llama.py`) and the `cpu`
kernels: unquantized bf16 vs W4A16 (group 128) vs W8A16 vs W8A8 dynamic vs W4A8 dynamic. The lm_head and
embeddings stay bf16 (as compressed-tensors recipes leave them). For each: decode tokens/s, weight bytes read
per token, and the weight-streaming bound (measured memory bandwidth / bytes per token). Prints a markdown
table.

    OMP_NUM_THREADS=2 python benchmarks/decode.py [--schemes dense w4a16 ...] [--tokens 16] [--context 128]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from ascq.kernels import WEIGHT_BITS, get_backend
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.models.llama import LlamaForCausalLM
from ascq.runtime.models.weights import finalize_model
from ascq.runtime.worker.kv_cache import allocate_kv_cache

CONFIG = {  # TinyLlama-1.1B
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP_SIZE = {"w4a16": 128}
BLOCK_SIZE = 16


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def random_bf16(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02)


def synthetic_weights(config: dict, scheme: str):
    """(HF name, tensor) pairs with random values; quantized linears as int8 values + scales."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    yield "model.embed_tokens.weight", random_bf16(vocab, hidden)
    yield "lm_head.weight", random_bf16(vocab, hidden)
    yield "model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        yield f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        yield f"{prefix}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)
        for name, (out_features, in_features) in linear_shapes(config).items():
            if scheme == "dense":
                yield f"{prefix}.{name}.weight", random_bf16(out_features, in_features)
                continue
            half = 2 ** (WEIGHT_BITS[scheme] - 1)
            groups = in_features // GROUP_SIZE.get(scheme, in_features)
            yield (
                f"{prefix}.{name}.weight",
                torch.randint(-half, half, (out_features, in_features), dtype=torch.int8),
            )
            yield f"{prefix}.{name}.weight_scale", torch.rand(out_features, groups).bfloat16() * 0.002


def weight_bytes_per_token(config: dict, scheme: str) -> int:
    """Bytes of weights one decode step reads: every linear (packed width + scales) and the lm_head."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    bits = 16 if scheme == "dense" else WEIGHT_BITS[scheme]
    total = 0
    for out_features, in_features in linear_shapes(config).values():
        groups = 0 if scheme == "dense" else in_features // GROUP_SIZE.get(scheme, in_features)
        total += out_features * in_features * bits // 8 + out_features * groups * 2
    return total * config["num_hidden_layers"] + vocab * hidden * 2


def measure_bandwidth_gbs() -> float:
    """Streaming read bandwidth: bytes of a 512 MiB copy source + destination over the copy time."""
    src = torch.empty(512 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / sorted(times)[len(times) // 2] / 1e9


def build_model(config: dict, scheme: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_weights(
        synthetic_weights(config, scheme), lambda prefix: "dense" if prefix == "lm_head" else scheme
    )
    finalize_model(model, get_backend("cpu"), torch.bfloat16, torch.device("cpu"))
    return model.eval()


def metadata(positions: list[int]) -> AttentionMetadata:
    """One sequence whose tokens at `positions` (contiguous, ending at its last token) run this step."""
    seq_len = positions[-1] + 1
    num_blocks = -(-seq_len // BLOCK_SIZE)
    return AttentionMetadata(
        slot_mapping=torch.tensor(positions, dtype=torch.int64),  # blocks 0..n-1 in order
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
    )


class Decoder:
    """A model with its own KV cache, decoding one sequence token by token."""

    def __init__(self, model: torch.nn.Module, context: int, max_tokens: int) -> None:
        self.model = model
        num_blocks = -(-(context + max_tokens) // BLOCK_SIZE)
        allocate_kv_cache(model, num_blocks, BLOCK_SIZE, torch.bfloat16, torch.device("cpu"))
        prompt = list(range(context))
        with torch.inference_mode():
            hidden = model(
                torch.randint(0, CONFIG["vocab_size"], (context,)), torch.tensor(prompt), metadata(prompt)
            )
            self.token = model.compute_logits(hidden[-1:]).argmax(-1)
        self.position = context
        self.times: list[float] = []

    @torch.inference_mode()
    def step(self) -> None:
        start = time.perf_counter()
        hidden = self.model(self.token, torch.tensor([self.position]), metadata([self.position]))
        self.token = self.model.compute_logits(hidden).argmax(-1)
        self.times.append(time.perf_counter() - start)
        self.position += 1

    def median_seconds(self) -> float:
        return sorted(self.times)[len(self.times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schemes", nargs="+", default=["dense", "w4a16", "w8a16", "w8a8_dynamic", "w4a8_dynamic"]
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    args = parser.parse_args()
    config = {**CONFIG, "num_hidden_layers": args.layers}
    torch.manual_seed(0)
    bandwidth = measure_bandwidth_gbs()
    decoders = {}
    for scheme in args.schemes:
        decoders[scheme] = Decoder(build_model(config, scheme), args.context, args.tokens)
        gc.collect()
    for _ in range(args.tokens):  # interleaved, so load changes on a shared machine hit every scheme alike
        for decoder in decoders.values():
            decoder.step()
    rows = []
    for scheme, decoder in decoders.items():
        num_linear = (
            sum(out_f * in_f for out_f, in_f in linear_shapes(config).values()) * config["num_hidden_layers"]
        )
        num_params = sum(p.numel() for p in decoder.model.parameters()) + num_linear
        bytes_per_token = weight_bytes_per_token(config, scheme)
        tps = 1 / decoder.median_seconds()
        rows.append((scheme, num_params, tps, bytes_per_token, bandwidth * 1e9 / bytes_per_token))
    base = rows[0][2]
    print(
        f"# batch-1 decode, {config['num_hidden_layers']} layers, context {args.context}, "
        f"{torch.get_num_threads()} threads, copy bandwidth {bandwidth:.1f} GB/s"
    )
    print()
    print(
        "| scheme | params (B) | tokens/s | vs first | weight MB/token | streaming bound tokens/s | % of "
        "bound |"
    )
    print("|---|---|---|---|---|---|---|")
    for scheme, num_params, tps, bytes_per_token, bound in rows:
        print(
            f"| {scheme} | {num_params / 1e9:.2f} | {tps:.2f} | {tps / base:.2f}x | "
            f"{bytes_per_token / 1e6:.0f} | "
            f"{bound:.2f} | {100 * tps / bound:.0f}% |"
        )


if __name__ == "__main__":
    main()
