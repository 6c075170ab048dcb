"""Loader: compressed-tensors checkpoints written by the library itself (and by `ascq convert`) load into the
runtime model; the cpu backend's logits match the reference backend's dequantized forward."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from ascq.core.errors import UnsupportedError
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sched.request import Request
from ascq.runtime.sched.scheduler import SchedulerOutput

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_ct_checkpoint(src, dst, scheme: QuantizationScheme, fmt: str) -> dict[str, torch.Tensor]:
    """Quantize every decoder linear round-to-nearest with the library's qparams and compressor, written as
    two shards; returns the library's own decompression of each weight (the independent ground truth)."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    out, dequantized = {}, {}
    for name, tensor in state.items():
        prefix = name.rsplit(".", 1)[0]
        if not prefix.endswith(LINEARS):
            out[name] = tensor
            continue
        weight = tensor.float()
        args = scheme.weights
        groups = weight.shape[1] // args.group_size if args.strategy == "group" else 1
        grouped = weight.reshape(weight.shape[0], groups, -1)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        local = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        compressed = compressor.compress(local, scheme)
        out.update({f"{prefix}.{k}": v.contiguous() for k, v in compressed.items()})
        dequantized[name] = compressor.decompress(dict(compressed), scheme)["weight"]
    (dst / "model.safetensors").unlink()
    names = sorted(out)
    shards = {
        "model-00001-of-00002.safetensors": names[0::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():  # alternate names: each linear's tensors span both shards
        save_file({n: out[n] for n in shard_names}, str(dst / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"], quantization_status="compressed"
    )
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    return dequantized


def prefill_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len, vocab] of every prompt position, through the engine's paged forward."""
    request = Request("p", None, token_ids, SamplingParams())
    assert engine.block_manager.allocate_slots(request, len(token_ids))
    out = SchedulerOutput([request], [len(token_ids)])
    input_ids, positions, meta, _ = engine.runner.prepare(out)
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(input_ids, positions, meta))
    engine.block_manager.free(request)
    return logits


@pytest.mark.parametrize(
    ("weights", "fmt"),
    [
        (QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32), "pack-quantized"),
        (QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"), "pack-quantized"),
        (QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"), "int-quantized"),
    ],
    ids=["w4a16-asym-g32-packed", "w8a16-packed", "w8a16-int"],
)
def test_library_written_checkpoint_matches_library_decompression(
    tmp_path, random_llama_dir, byte_tokenizer, weights, fmt
):
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    dequantized = write_ct_checkpoint(random_llama_dir, tmp_path / "ct", scheme, fmt)
    engine = LLMEngine(
        EngineArgs(tmp_path / "ct", device="reference", kv_cache_memory=8 << 20), tokenizer=byte_tokenizer
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(random_llama_dir, dtype=torch.float32).eval()
    hf.load_state_dict({**hf.state_dict(), **{k: v.float() for k, v in dequantized.items()}})
    prompt = torch.randint(1, 4096, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompt), expected, atol=2e-3, rtol=2e-3)


def test_unsupported_format_is_named(tmp_path, random_llama_dir, byte_tokenizer):
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, strategy="channel"))
    write_ct_checkpoint(random_llama_dir, tmp_path / "ct", scheme, "int-quantized")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    config["quantization_config"]["format"] = "float-quantized"
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedError, match="'float-quantized' is not supported; supported: int-quantized, pack-quantized"
    ):
        LLMEngine(EngineArgs(tmp_path / "ct", kv_cache_memory=8 << 20), tokenizer=byte_tokenizer)
    config["quantization_config"]["quant_method"] = "gptq"
    (tmp_path / "ct" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="'gptq' is not supported; supported: compressed-tensors"):
        LLMEngine(EngineArgs(tmp_path / "ct", kv_cache_memory=8 << 20), tokenizer=byte_tokenizer)


# recipes other tests convert with the default options share the session cache; the rest convert cheaply
CASES = [
    ("tiny_llama_dir", ("w8a8",), False),
    ("tiny_llama_dir", ("w4a16-rtn",), False),
    ("tiny_llama_dir", ("w8a8-static",), True),
    ("tiny_llama_dir", ("w8a16",), True),
    ("tiny_llama_dir", ("w4a8-dynamic",), True),
    ("tiny_deepseek_moe_dir", ("w8a8", "fp8-kv"), False),
    ("tiny_deepseek_moe_dir", ("w4a16-rtn",), True),
    ("tiny_deepseek_moe_dir", ("w4a8-dynamic",), True),
]


@pytest.fixture(scope="module")
def cheap_opts(tmp_path_factory, eval_text_path) -> dict:
    # perplexity is not what these tests check
    short_eval = tmp_path_factory.mktemp("runtime-eval") / "eval.txt"
    short_eval.write_text(eval_text_path.read_text()[:4000])
    return {"num_samples": 8, "seq_len": 128, "eval_text": short_eval}


def eval_chunks(tokenizer, eval_text_path, num: int = 4, length: int = 256) -> list[list[int]]:
    ids = tokenizer.encode(eval_text_path.read_text()[:100_000])
    return [ids[i * length : (i + 1) * length] for i in range(num)]


def top1_agreement(model_dir, tokenizer, chunks, dtype: str = "auto", kv_cache_dtype: str = "auto") -> float:
    engines = [
        LLMEngine(
            EngineArgs(
                model_dir, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=16 << 20
            ),
            tokenizer=tokenizer,
        )
        for device in ("cpu", "reference")
    ]
    matches = total = 0
    for chunk in chunks:
        fast, ref = (prefill_logits(engine, chunk).argmax(-1) for engine in engines)
        matches += int((fast == ref).sum())
        total += len(chunk)
    assert total >= 1000
    return matches / total


@pytest.mark.slow
@pytest.mark.parametrize(
    ("base", "recipes", "cheap"), CASES, ids=[f"{b[5:-4]}-{'+'.join(r)}" for b, r, _ in CASES]
)
def test_converted_entry_cpu_backend_matches_reference(
    request, converted_entry, cheap_opts, eval_text_path, base, recipes, cheap
):
    entry = converted_entry(request.getfixturevalue(base), recipes, **(cheap_opts if cheap else {}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(entry)
    chunks = eval_chunks(tokenizer, eval_text_path)
    assert top1_agreement(entry, tokenizer, chunks) >= 0.99
    if recipes[0] in ("w4a16-rtn", "w8a16"):  # the int4pack / int8pack kernels take bf16 activations
        assert top1_agreement(entry, tokenizer, chunks, dtype="bfloat16") >= 0.99
    if "fp8-kv" in recipes:
        engine = LLMEngine(
            EngineArgs(entry, kv_cache_dtype="fp8", kv_cache_memory=16 << 20), tokenizer=tokenizer
        )
        attn = engine.model.model.layers[0].self_attn.attn
        assert attn.has_checkpoint_kv_scales and attn.k_scale != 1.0 and attn.v_scale != 1.0
        assert top1_agreement(entry, tokenizer, chunks, kv_cache_dtype="fp8") >= 0.99
