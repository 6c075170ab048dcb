"""Gemma 3 without the PyPI package: a tiny random Gemma3ForCausalLM written by transformers (window 8, so
prompts cross it; a global layer with a scaled rope; random norm weights, so (1 + weight) matters) against
ascq's serving model (cpu and reference backends, chunked prefill and batched decode) and its converter
layer; sliding-window paged attention never reads blocks past the window; every shipped recipe converts it
and the result serves; a chunked GGUF package is reassembled and checked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import make_engine, run_batch
from test_hub_publish import hub  # noqa: F401 (the Hub test double fixture)
from test_runtime_models import random_prompts
from zoo_builder import write_tokenizer

from ascq.core.errors import AscqError, UnsupportedError
from ascq.kernels import get_backend
from ascq.kernels.reference import causal_attention
from ascq.paths import shipped_recipes
from ascq.quantize import awq
from ascq.quantize.architectures import architecture_from_config
from ascq.runtime.layers.attention import AttentionMetadata
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.zoo import gguf_import

WINDOW = 8
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    max_position_embeddings=256,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    },
)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # transformers initializes them to 0: (1 + weight) would be 1
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def hf_model(path: Path) -> transformers.Gemma3ForCausalLM:
    return transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_served_greedy_and_logprobs_match_transformers(tiny_gemma3_dir: Path, byte_tokenizer, device: str):
    hf = hf_model(tiny_gemma3_dir)
    # blocks of 4 under a window of 8: whole blocks fall behind the window; 24-token steps: prefill runs in
    # chunks (long and short ones) beside decode rows
    engine = make_engine(
        tiny_gemma3_dir, byte_tokenizer, device=device, dtype="float32", block_size=4,
        max_num_batched_tokens=24,
    )  # fmt: skip
    prompts = random_prompts(5, (3, 70), vocab=320, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = run_batch(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        got = outs[str(i)].outputs[0]
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            logits = hf(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert got.token_ids == expected
        logprobs = logits.log_softmax(-1)
        for step, top in enumerate(got.logprobs):
            ids = list(top)
            torch.testing.assert_close(
                torch.tensor([top[t] for t in ids]), logprobs[step, ids], atol=2e-4, rtol=1e-4
            )


def test_converter_layers_match_transformers(tiny_gemma3_dir: Path):
    """The converter's reference model (embedding scale, layers, final norm) gives transformers' logits."""
    from safetensors.torch import load_file

    config = json.loads((tiny_gemma3_dir / "config.json").read_text())
    arch = architecture_from_config(config)
    state = load_file(tiny_gemma3_dir / "model.safetensors")
    ids = torch.randint(1, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    hidden = arch.embed(state["model.embed_tokens.weight"], ids)
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        for index in range(arch.num_layers):
            prefix = arch.layer_prefix(index)
            layer = arch.build_layer(
                index, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )
            hidden = arch.forward_layer(layer, hidden, positions)
        logits = arch.final_norm(hidden, state["model.norm.weight"]) @ state["model.embed_tokens.weight"].T
        expected = hf_model(tiny_gemma3_dir)(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_windowed_layers_never_read_blocks_past_the_window():
    """Values of blocks wholly behind every query row's window are NaN: reading them (even with weight 0)
    would make the output NaN. The output equals dense attention over the last WINDOW positions."""
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, dim = 4, 16, 4, 2, 8
    seq_lens, query_lens = [30, 21, 9], [1, 6, 9]  # a decode row, a short chunk, a whole prompt
    # table padding (read, then masked, by batched decode rows) points at a block inside a window
    tables = torch.tensor(
        [[3, 1, 4, 0, 5, 9, 2, 6], [7, 8, 10, 11, 12, 13, 15, 15], [14, 15, 15, 15, 15, 15, 15, 15]]
    )
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    dense_k = [k_cache[t].reshape(-1, kv_heads, dim)[:n] for t, n in zip(tables, seq_lens, strict=True)]
    dense_v = [
        v_cache[t].reshape(-1, kv_heads, dim)[:n].clone() for t, n in zip(tables, seq_lens, strict=True)
    ]
    for s, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        first_visible = max(n - q - WINDOW + 1, 0)
        for b in range(first_visible // block_size):
            v_cache[tables[s, b]] = float("nan")
    query = torch.randn(sum(query_lens), heads, dim)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=tables.to(torch.int32),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    ).windowed(WINDOW, block_size)
    assert meta.seq_lens.tolist() == [10, 13, 9]  # 5, 2 and 0 blocks left out
    for name in ("cpu", "reference"):
        out = get_backend(name).paged_attention(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.3,
            sliding_window=WINDOW,
        )  # fmt: skip
        for s in range(len(seq_lens)):
            rows = slice(int(starts[s]), int(starts[s + 1]))
            expected = causal_attention(query[rows], dense_k[s], dense_v[s], 0.3, WINDOW)
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def test_awq_fold_into_offset_norm_keeps_the_function():
    from ascq.reference.decoder import GemmaRMSNorm

    torch.manual_seed(0)
    norm, linear = GemmaRMSNorm(16, 1e-6), torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
        x = torch.randn(5, 16)
        before = linear(norm(x))
        awq.fold_into_norm(norm, [linear], torch.rand(16) + 0.5)
        torch.testing.assert_close(linear(norm(x)), before, atol=1e-5, rtol=1e-5)


# recipes that are additions to a weight recipe in one format only
COMPOSED = {"kv-int8-c8": (("w8a8", "kv-int8-c8"), "msmodelslim")}


@pytest.mark.parametrize("recipe", sorted(shipped_recipes()))
def test_every_recipe_converts_and_serves(
    tiny_gemma3_dir: Path, converted_entry, tmp_path: Path, recipe: str
):
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text("def main():\n    return 0\n" * 40)
    recipes, fmt = COMPOSED.get(recipe, ((recipe,), "compressed-tensors"))
    entry = converted_entry(
        tiny_gemma3_dir, recipes, num_samples=4, seq_len=48, eval_text=eval_text, format=fmt
    )
    manifest = json.loads((entry / "ascq.json").read_text())
    assert manifest["metrics"]["perplexity"] > 0
    if fmt == "msmodelslim":  # vllm-ascend's format: served on NPU only (tests/test_npu_msmodelslim.py)
        description = json.loads((entry / "quant_model_description.json").read_text())
        assert description["model.layers.3.self_attn.k_proj.kv_cache_scale"] == "C8"
        assert description["model.layers.3.self_attn.q_norm.weight"] == "FLOAT"
        return
    engine = make_engine(entry, dtype="float32", block_size=4)
    out = run_batch(
        engine, [list(range(1, 30))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out["0"].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("key", "value"),
    [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0), ("hidden_activation", "gelu")],
)
def test_unimplemented_gemma3_settings_are_refused(key: str, value: object):
    config = {"model_type": "gemma3_text", "num_hidden_layers": 2, **TINY, "rms_norm_eps": 1e-6, key: value}
    with pytest.raises(UnsupportedError, match=key.split("_")[-1]):
        architecture_from_config(config)


def _chunk_package(site: Path, name: str, files: dict[str, bytes], requires: list[str] = ()) -> None:
    """An installed distribution (dist-info with METADATA and RECORD) shipping `files`."""
    module = name.replace("-", "_")
    info = site / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"] + [
        f"Requires-Dist: {r}\n" for r in requires
    ]
    (info / "METADATA").write_text("".join(lines))
    for rel, data in files.items():
        (site / module / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / module / rel).write_bytes(data)
    record = [f"{module}/{rel},," for rel in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def test_chunked_gguf_package_is_reassembled_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = bytes(range(256)) * 1000
    cut = [0, 70_000, 150_001, len(data)]
    site = tmp_path / "site"
    for i in range(3):
        part = data[cut[i] : cut[i + 1]]
        _chunk_package(site, f"tiny-gguf-part{i + 1}", {f"data/m.gguf.part{i:02d}": part})
    digest = hashlib.sha256(data).hexdigest()
    requires = [f"tiny-gguf-part{i + 1}==1.0" for i in range(3)]
    _chunk_package(site, "tiny-gguf", {"data/SHA256SUMS": f"{digest}  m.gguf\n".encode()}, requires)
    _chunk_package(site, "bad-gguf", {"data/SHA256SUMS": f"{'0' * 64}  m.gguf\n".encode()}, requires)
    _chunk_package(site, "gapped-gguf", {}, requires[::2])
    monkeypatch.syspath_prepend(str(site))
    source = gguf_import.packaged_gguf("tiny-gguf", tmp_path)
    assert source.path.read_bytes() == data and source.path.name == "m.gguf"
    assert (source.package, source.package_version) == ("tiny-gguf", "1.0")
    with pytest.raises(AscqError, match="does not match its SHA256SUMS"):
        gguf_import.packaged_gguf("bad-gguf", tmp_path)
    with pytest.raises(AscqError, match="not one file's parts"):
        gguf_import.packaged_gguf("gapped-gguf", tmp_path)


def test_converter_fake_quant_logits_equal_served_reference_logits(
    tiny_gemma3_dir: Path, converted_entry, tmp_path: Path
):
    """What the converter measures is what the server runs, windows and (1 + weight) norms included."""
    from test_runtime_loader import prefill_logits

    from ascq.quantize.reference_forward import reference_logits
    from ascq.runtime.engine.engine_args import EngineArgs
    from ascq.runtime.engine.llm_engine import LLMEngine

    eval_text = tmp_path / "eval.txt"
    eval_text.write_text("def main():\n    return 0\n" * 40)
    entry = converted_entry(tiny_gemma3_dir, ("w8a8",), num_samples=4, seq_len=48, eval_text=eval_text)
    windows = torch.randint(1, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    converter = reference_logits(entry, windows)
    args = EngineArgs(entry, device="reference", dtype="float32", kv_cache_memory=8 << 20, block_size=4)
    engine = LLMEngine(args)
    for window, expected in zip(windows, converter, strict=True):
        assert torch.equal(prefill_logits(engine, window.tolist()), expected)


def test_card_describes_gemma3_and_publish_pull_round_trips(
    tiny_gemma3_dir: Path,
    converted_entry,
    hub,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    import shutil

    from huggingface_hub import ModelCard
    from zoo_builder import run

    source = converted_entry(tiny_gemma3_dir, ("awq-int4",), num_samples=4, seq_len=48)
    entry = Path(shutil.copytree(source, tmp_path / "zoo" / "tiny-gemma3-awq"))
    assert run("publish", str(entry), "--repo", "test/gemma") == 0
    card = ModelCard(hub.files("test/gemma")["README.md"].decode())
    assert "gemma3_text" in card.data.tags
    assert "`gemma3_text` (Gemma3ForCausalLM): 4 layers, hidden 64, 4 query / 2 KV heads of 16" in card.text
    assert "sliding-window attention (8 tokens) on 3 of 4 layers, rope base 10,000" in card.text
    monkeypatch.setenv("ASCQ_ZOO", str(tmp_path / "fresh"))
    assert run("zoo", "pull", "test/gemma") == 0
    assert run("zoo", "verify", "gemma") == 0


def test_core_tensors_are_the_checkpoint_transformers_writes(tiny_gemma3_dir: Path):
    from safetensors import safe_open

    from ascq.core.tensors import checkpoint_tensors

    config = json.loads((tiny_gemma3_dir / "config.json").read_text())
    with safe_open(tiny_gemma3_dir / "model.safetensors", "pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert dict(checkpoint_tensors(config)) == written


def test_dummy_load_serves_gemma3(tiny_gemma3_dir: Path, tmp_path: Path):
    """--load-format dummy makes Gemma 3's tensors (q/k norms, four norms) from the config alone."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_gemma3_dir / "config.json").read_text())
    engine = make_engine(folder, load_format="dummy", dtype="float32", block_size=4)
    out = run_batch(
        engine, [list(range(1, 20))], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    assert len(out["0"].outputs[0].token_ids) == 3
