"""Train the fixture models `tiny-llama` and `tiny-deepseek-moe` on the standard library's Python sources.

    python -m ascq.zoo.train_fixture --out zoo                      # both, one after the other
    python -m ascq.zoo.train_fixture --out zoo --model tiny-llama   # one
    python -m ascq.zoo.train_fixture --out zoo --model tiny-llama --steps 150 --resume   # train it further

`--resume` continues from the entry's saved weights with a fresh optimizer and warmup + cosine schedule (a warm
restart) and data seed 0 + steps done so far; the manifest's `training.stages` lists every stage and its command.

Deterministic (seed 0): AdamW, linear warmup then cosine decay, random windows of 256 tokens from the training
stream, fp32 training, weights saved in bf16. Each entry gets `ascq.json` with held-out perplexity recomputed in fp32
from the saved bf16 files (see `ascq.evaluate`), the unigram perplexity of the same tokenizer, and for the MoE the
share of routed tokens per expert on the eval text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ascq.evaluate import encode_text, load_eval_token_ids, perplexity, unigram_perplexity
from ascq.formats.manifest import new_manifest, read_manifest, staged_entry, write_manifest
from ascq.models.deepseek_moe import DeepseekConfig, DeepseekForCausalLM, load_deepseek
from ascq.zoo import fixture_corpus as corpus

SEED, SEQ_LEN = 0, 256
LLAMA_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
DEEPSEEK_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
    first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=False, scoring_func="softmax", aux_loss_alpha=0.01,
    seq_aux=True, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


@dataclasses.dataclass
class TrainSettings:
    steps: int = 180
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        self.warmup_steps = min(self.warmup_steps, self.steps // 10)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:  # linear warmup from lr / warmup_steps
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(name: str) -> nn.Module:
    if name == "tiny-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    return DeepseekForCausalLM(DeepseekConfig(**DEEPSEEK_CONFIG))


def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def train(
    model: nn.Module, stream: torch.Tensor, settings: TrainSettings, log_every: int = 20, seed: int = SEED
) -> None:
    """Next-token cross-entropy (+ the MoE balance loss when the model has one) on random stream windows."""
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    model.train()
    start = time.perf_counter()
    for step in range(settings.steps):
        offsets = torch.randint(0, stream.numel() - SEQ_LEN - 1, (settings.batch_size,), generator=generator)
        batch = torch.stack([stream[o : o + SEQ_LEN + 1] for o in offsets.tolist()])
        logits = logits_of(model, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        aux = model.aux_loss() if isinstance(model, DeepseekForCausalLM) else torch.zeros(())
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        if step % log_every == 0 or step == settings.steps - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step:5d} loss {loss.item():.4f} aux {aux.item():.4f} {elapsed:7.1f}s", flush=True)
    model.eval()


def save_weights(model: nn.Module, name: str, out_dir: Path) -> None:
    """bf16 config.json + model.safetensors + generation_config.json in Hugging Face layout."""
    if name == "tiny-llama":
        model.to(torch.bfloat16).save_pretrained(out_dir)
        # transformers 4.x reads these two keys (5.x writes `dtype` and `rope_parameters`)
        config = json.loads((out_dir / "config.json").read_text())
        config.update(torch_dtype="bfloat16", rope_theta=model.config.rope_parameters["rope_theta"])
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def load_fp32(name: str, model_dir: Path) -> nn.Module:
    """The saved entry loaded back in fp32 exactly as the tests recompute it."""
    if name == "tiny-llama":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return load_deepseek(model_dir, torch.float32)


def evaluate_entry(name: str, model_dir: Path, train_stream: torch.Tensor) -> dict[str, Any]:
    model = load_fp32(name, model_dir)
    eval_ids = load_eval_token_ids(model_dir)
    if isinstance(model, DeepseekForCausalLM):
        model.record_routing(True)
    metrics: dict[str, Any] = {
        "perplexity": perplexity(lambda ids: logits_of(model, ids), eval_ids, seq_len=SEQ_LEN),
        "unigram_perplexity": unigram_perplexity(train_stream, eval_ids, 4096),
        "eval_text": "ascq/data/eval.txt",
        "eval_seq_len": SEQ_LEN,
        "num_eval_tokens": eval_ids.numel(),
    }
    if isinstance(model, DeepseekForCausalLM):
        counts = model.routed_token_counts().double()
        shares = counts / counts.sum(dim=1, keepdim=True)
        metrics["routed_token_share"] = [[round(s, 5) for s in layer.tolist()] for layer in shares]
        metrics["min_routed_token_share"] = round(shares.min().item(), 5)
    return metrics


def train_fixture(
    name: str,
    out: Path,
    settings: TrainSettings,
    texts: list[str],
    tokenizer: Any,
    log_every: int = 20,
    resume: bool = False,
) -> dict[str, Any]:
    """Train `name` from scratch, or with `resume` continue the entry already in `out` (fresh optimizer and schedule)."""
    stream = encode_text(tokenizer, corpus.EOT.join(texts))
    training = read_manifest(out / name)["training"] if resume else {}
    stages = training.get("stages", [training]) if resume else []
    previous_steps = sum(stage["steps"] for stage in stages)
    torch.manual_seed(SEED + previous_steps)
    model = load_fp32(name, out / name).train() if resume else build_model(name)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {stream.numel()} training tokens")
    start = time.perf_counter()
    train(model, stream, settings, log_every, seed=SEED + previous_steps)
    stages.append(
        {
            "steps": settings.steps,
            "tokens": settings.steps * settings.batch_size * SEQ_LEN,
            "seconds": round(time.perf_counter() - start, 1),
            "threads": torch.get_num_threads(),
            "settings": dataclasses.asdict(settings),
            "command": "python -m ascq.zoo.train_fixture " + shlex.join(sys.argv[1:]),
        }
    )
    with staged_entry(out / name) as staging:
        save_weights(model, name, staging)
        corpus.save_hf_tokenizer(tokenizer, staging)
        manifest = new_manifest(
            name,
            source={"model": f"ascq/{name}", "revision": None},
            base_model=f"ascq/{name}",
            license="apache-2.0",
            format="hf",
            metrics=evaluate_entry(name, staging, stream),
            training={
                **{key: sum(stage[key] for stage in stages) for key in ("steps", "tokens", "seconds")},
                "command": " && ".join(stage["command"] for stage in stages),
                "stages": stages,
            },
        )
        manifest = write_manifest(staging, manifest)
    print(f"{name}: {json.dumps({k: v for k, v in manifest['metrics'].items() if k != 'routed_token_share'})}")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("zoo"), help="zoo folder to write the entries into")
    parser.add_argument("--model", choices=["tiny-llama", "tiny-deepseek-moe", "all"], default="all")
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    parser.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    parser.add_argument("--resume", action="store_true", help="continue training the entries already in --out")
    parser.add_argument("--write-held-out", action="store_true", help="regenerate ascq/data/{eval,calib}.txt")
    args = parser.parse_args(argv)
    sources = corpus.stdlib_sources()
    if args.write_held_out:
        corpus.write_held_out_texts(sources)
    texts = corpus.training_texts(sources)
    tokenizer = corpus.train_tokenizer(texts)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size)
    names = ["tiny-llama", "tiny-deepseek-moe"] if args.model == "all" else [args.model]
    for name in names:
        train_fixture(name, args.out, settings, texts, tokenizer, args.log_every, args.resume)


if __name__ == "__main__":
    main()
