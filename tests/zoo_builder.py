"""Small zoo entries for zoo/Hub tests: a random-weight Llama (transformers' own class) with a trained
byte-level BPE tokenizer, written dense (format hf) or as a W4A16 compressed-tensors checkpoint packed by
compressed-tensors' own compressor. Both go through `staged_entry` + `write_manifest` like every other entry
writer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ascq.cli import main
from ascq.formats.manifest import new_manifest, staged_entry, write_manifest

CORPUS = ["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"] * 20
LLAMA = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
RECIPE_TEXT = (
    "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: W4A16_ASYM\n      "
    "ignore: [lm_head]\n"
)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LLAMA["vocab_size"],
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)


def dense_llama_state(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    return config.to_dict(), {k: v.contiguous() for k, v in model.state_dict().items()}


def write_dense_entry(target: Path, name: str = "tiny-test-llama") -> Path:
    config, state = dense_llama_state()
    with staged_entry(target) as staging:
        (staging / "config.json").write_text(_json(config))
        write_tokenizer(staging)
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        write_manifest(
            staging,
            new_manifest(
                name,
                source={"model": "random-init", "revision": None},
                license="apache-2.0",
                metrics={"perplexity": 300.5, "unigram_perplexity": 250.25},
            ),
        )
    return target


def write_w4a16_entry(
    target: Path, base_model: str = "test-org/tiny-test-llama", name: str = "tiny-test-llama-w4a16"
) -> Path:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    config, state = dense_llama_state()
    scheme = QuantizationScheme(
        targets=["Linear"],
        format="pack-quantized",
        weights=QuantizationArgs(num_bits=4, group_size=32, strategy="group", symmetric=False),
    )
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        ignore=["lm_head"],
        quantization_status="compressed",
    )
    config["quantization_config"] = qconfig.model_dump(mode="json")
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module = key.removesuffix(".weight")
        if key.endswith("_proj.weight"):
            scale, zero_point = _minmax_group_params(tensor.float(), 32)
            packed = compressor.compress(
                {"weight": tensor, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point},
                scheme,
            )
            out.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
        else:
            out[key] = tensor
    shards = [dict(list(out.items())[: len(out) // 2]), dict(list(out.items())[len(out) // 2 :])]
    with staged_entry(target) as staging:
        (staging / "config.json").write_text(_json(config))
        write_tokenizer(staging)
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, staging / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        (staging / "model.safetensors.index.json").write_text(
            _json({"metadata": {}, "weight_map": weight_map})
        )
        write_manifest(
            staging,
            new_manifest(
                name,
                source={"model": base_model, "revision": "main"},
                base_model=base_model,
                license="apache-2.0",
                format="compressed-tensors",
                scheme="w4a16",
                recipe={"names": ["w4a16-rtn"], "text": RECIPE_TEXT},
                calibration={"dataset": "ascq/data/calib.txt", "num_samples": 16, "seq_len": 128},
                metrics={
                    "perplexity": 310.75,
                    "perplexity_base": 300.5,
                    "unigram_perplexity": 250.25,
                    "eval_text": "ascq/data/eval.txt",
                    "num_eval_tokens": 4096,
                },
            ),
        )
    return target


def _minmax_group_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = w.reshape(w.shape[0], -1, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero_point = (-8 - torch.round(lo / scale)).clamp(-8, 7).to(torch.int8)
    return scale, zero_point


def _json(obj: object) -> str:
    import json

    return json.dumps(obj, indent=2, default=str) + "\n"


def run(*argv: str) -> int:
    try:
        main(list(argv))
    except SystemExit as exc:
        return exc.code or 0
    return 0
