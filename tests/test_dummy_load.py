"""vLLM's `--load-format dummy`: random weights at a config's shape, in the format a recipe's conversion
writes (checked against real converted entries, tensor by tensor), seeded so that every rank makes the same
(tensor + expert parallel gives the single process's tokens), loaded module by module (never the whole
checkpoint's unpacked tensors at once), with a tokenizer for a folder that has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ascq import LLM, SamplingParams
from ascq.cli import main
from ascq.core.errors import AscqError
from ascq.formats.byte_tokenizer import dummy_tokenizer
from ascq.platforms.cpu import MAX_DEFAULT_KV_CACHE_BYTES
from ascq.quantize.planned_config import planned_quantization_config
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.models import weights as model_weights
from ascq.runtime.worker.dummy import dummy_weights
from ascq.runtime.worker.loader import QuantConfig, iter_checkpoint, load_model

ROOT = Path(__file__).resolve().parents[1]
PLANNED_16B = ROOT / "zoo" / "deepseek-moe-16b"


def layouts(tensors) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors}


CHEAP = {"num_samples": 4, "seq_len": 16, "max_eval_tokens": 256}  # the format does not depend on them


@pytest.mark.parametrize(
    ("fixture", "recipe", "opts"),
    [("tiny_llama_dir", "w4a16-rtn", {}), ("tiny_deepseek_moe_dir", "w8a8", CHEAP)],
)
def test_dummy_weights_have_the_converted_entrys_format(
    fixture, recipe, opts, request, converted_entry
) -> None:
    base = request.getfixturevalue(fixture)
    entry = converted_entry(base, (recipe,), **opts)
    config = json.loads((base / "config.json").read_text())
    written = json.loads((entry / "config.json").read_text())["quantization_config"]
    planned = planned_quantization_config(config, recipe)
    (planned_group,), (written_group,) = QuantConfig(planned).groups, QuantConfig(written).groups
    assert planned_group[1:] == written_group[1:]  # scheme name, format
    assert planned_group[0].weights == written_group[0].weights  # bits, group size, symmetry, zero points
    assert planned_group[0].input_activations == written_group[0].input_activations
    real = layouts(iter_checkpoint(entry, QuantConfig(written)))
    dummy = layouts(dummy_weights(config, QuantConfig(planned)))
    assert dummy == real  # the same tensors, shapes and dtypes as the loader reads from the real entry


def test_dummy_is_seeded_and_tp_ep_gives_the_single_process_tokens(tiny_deepseek_moe_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    runs = []
    for parallel in ({}, {}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        kwargs = {"load_format": "dummy", "quantization": "w4a16-rtn", "dtype": "float32", **parallel}
        with LLM(str(tiny_deepseek_moe_dir), kv_cache_memory=8 << 20, **kwargs) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1] == runs[2]
    with LLM(str(tiny_deepseek_moe_dir), kv_cache_memory=8 << 20, load_format="dummy", seed=1) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] != runs[0]


def test_linears_are_finalized_while_loading(tiny_deepseek_moe_dir: Path, monkeypatch) -> None:
    """At no point do more than two linears or expert blocks hold unprepared tensors (a full-shape int4
    MoE checkpoint unpacks to a byte per parameter)."""
    from ascq.runtime.layers.linear import LinearBase
    from ascq.runtime.layers.moe import FusedMoE

    most_pending = []
    original = model_weights.load_named_weights

    def watched(model, weights, scheme_for, on_loaded=None):
        def counted():
            for item in weights:
                pending = [
                    m for m in model.modules() if isinstance(m, LinearBase | FusedMoE) and m.prepared is None
                ]
                most_pending.append(sum(1 for m in pending if any(m.pending.values())))
                yield item

        return original(model, counted(), scheme_for, on_loaded)

    monkeypatch.setattr("ascq.runtime.models.llama.load_named_weights", watched)
    config = EngineArgs(tiny_deepseek_moe_dir, load_format="dummy", quantization="awq-int4").model_config()
    model, _ = load_model(tiny_deepseek_moe_dir, "cpu", torch.float32, config, load_format="dummy")
    assert max(most_pending) <= 2
    assert all(m.prepared is not None for m in model.modules() if isinstance(m, LinearBase | FusedMoE))


def test_dummy_tokenizer_decodes_every_id_and_renders_chat() -> None:
    tokenizer = dummy_tokenizer(1000)
    assert len(tokenizer) == 1000
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert all(tokenizer.decode([i]) for i in (0, 300, 999))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text


def test_recipe_names_need_dummy_and_bad_formats_are_refused(tiny_llama_dir: Path, capsys) -> None:
    with pytest.raises(AscqError, match="names a recipe, which makes weights only with load_format='dummy'"):
        LLM(str(tiny_llama_dir), quantization="awq-int4")
    with pytest.raises(AscqError, match="load_format 'pt' is not supported; supported: auto, safetensors"):
        EngineArgs(tiny_llama_dir, load_format="pt")
    with pytest.raises(AscqError, match="quantizes no weights"):
        LLM(str(tiny_llama_dir), load_format="dummy", quantization="fp8-kv")
    # the planned 16B entry still says how to get its weights unless dummy weights are asked for
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(PLANNED_16B), "--prompt", "a", "--max-tokens", "1"])
    assert exit_info.value.code != 0 and "has no weights yet" in capsys.readouterr().err


def test_the_default_kv_cache_holds_one_max_model_len_sequence(tiny_llama_dir: Path) -> None:
    """The 16B card command with no KV flags: a tenth of free memory held 3936 of 4096 tokens and the server
    refused to start; the default is now at least one full sequence."""
    args = EngineArgs(tiny_llama_dir)
    assert args.resolve_kv_cache_memory(sequence_bytes=10**13) == 10**13
    assert 1 < args.resolve_kv_cache_memory(sequence_bytes=1) <= MAX_DEFAULT_KV_CACHE_BYTES  # the share
    # an explicit budget is the user's: the start-up check names what one sequence needs
    explicit = EngineArgs(tiny_llama_dir, kv_cache_memory=1 << 20)
    assert explicit.resolve_kv_cache_memory(sequence_bytes=1 << 30) == 1 << 20


def test_bf16_weight_copies_only_for_a_model_whose_linears_all_fit(
    tiny_deepseek_moe_dir: Path, monkeypatch
) -> None:
    """The CPU backend's bf16 weight copies (ASCQ_BF16_WEIGHT_CACHE_MB) go to a model whose projection
    linears all fit the budget, or to none of its linears (not to its first layers only)."""
    from ascq.kernels import cpu
    from ascq.runtime.layers.linear import LinearBase
    from ascq.runtime.worker.loader import linear_bf16_bytes

    monkeypatch.setattr(cpu, "BF16_GEMM_FAST", True)  # where the copies are made; torch runs it anywhere
    config = EngineArgs(tiny_deepseek_moe_dir, load_format="dummy", quantization="w4a16-rtn").model_config()
    model_mib = linear_bf16_bytes(config) / 2**20
    held_mib = cpu._bf16_cache_bytes / 2**20  # copies other models in this process still hold
    for budget_mib, copies in ((int(held_mib + model_mib) + 2, True), (int(model_mib) - 1, False)):
        monkeypatch.setenv("ASCQ_BF16_WEIGHT_CACHE_MB", str(budget_mib))
        model, _ = load_model(tiny_deepseek_moe_dir, "cpu", torch.bfloat16, config, load_format="dummy")
        kept = [
            m.prepared.bf16_weight is not None
            for m in model.modules()
            if isinstance(m, LinearBase) and m.prepared.kernel == "native"
        ]
        assert kept and all(k == copies for k in kept), (budget_mib, kept)
        del model


def _file_mappings(paths: list[Path]) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `paths` (/proc/self/maps)."""
    names = {str(p.resolve()) for p in paths}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in names:
            start, end = (int(v, 16) for v in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_loaded_tensors_do_not_keep_the_shards_mapped(tiny_llama_dir: Path, converted_entry) -> None:
    from ascq.formats.safetensors import CheckpointReader

    entry = converted_entry(tiny_llama_dir, ("w4a16-rtn",))
    shards = sorted(entry.glob("*.safetensors"))
    quant = QuantConfig(json.loads((entry / "config.json").read_text())["quantization_config"])

    def in_shards(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
        return any(start <= t.data_ptr() < end for start, end in ranges)

    reader = CheckpointReader(entry)
    with reader.opened():  # the reader's own tensors are views of the mapped files (what the test guards)
        assert all(in_shards(reader.get(name), _file_mappings(shards)) for name in sorted(reader))
    names = []
    for name, tensor in iter_checkpoint(entry, quant):
        assert not in_shards(tensor, _file_mappings(shards)), name
        names.append(name)
    assert any(n.endswith("weight_scale") for n in names) and any(n.endswith("norm.weight") for n in names)
