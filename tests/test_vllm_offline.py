"""vLLM-style offline snippets, run unchanged on tiny-llama, against reference computations.

Each batched sampling feature is checked against a plain per-request PyTorch reference run through the
`logits_processors` plug-in (which runs before the batched pipeline), or against transformers / jsonschema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from ascq import LLM, SamplingParams
from ascq.core.errors import AscqError, UnsupportedError
from ascq.runtime.sampling.structured_output import StructuredOutputsParams
from ascq.runtime.worker.sampler import apply_penalties, padded

PROMPTS = ["def parse_args(argv):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # the kwargs a vLLM user passes, unchanged
    return LLM(
        model=str(tiny_llama_dir),
        tensor_parallel_size=1,
        gpu_memory_utilization=0.02,
        enforce_eager=True,
        trust_remote_code=False,
        max_model_len=512,
        seed=0,
        dtype="float32",
        kv_cache_dtype="auto",
        block_size=16,
        enable_prefix_caching=True,
        swap_space=0,
        cpu_offload_gb=0,
    )


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 24), **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---- prompts and kwargs --------------------------------------------------------------------------------


def test_prompt_forms_agree(llm) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[0])
    by_text = llm.generate(PROMPTS[0], greedy())[0].outputs[0].token_ids
    forms = [{"prompt_token_ids": ids}, {"prompt": PROMPTS[0]}, ids, [{"prompt_token_ids": ids}], [ids]]
    for form in forms:
        assert token_ids(llm.generate(form, greedy())) == [by_text], form
    mixed = llm.generate([PROMPTS[0], {"prompt_token_ids": ids}, {"prompt": PROMPTS[1]}], greedy())
    assert token_ids(mixed)[:2] == [by_text, by_text]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}})


def test_engine_kwargs_checked(tiny_llama_dir) -> None:
    with pytest.raises(TypeError, match="did you mean 'gpu_memory_utilization'"):
        LLM(str(tiny_llama_dir), gpu_memory_utilisation=0.5)
    with pytest.raises(UnsupportedError, match="trust_remote_code"):
        LLM(str(tiny_llama_dir), trust_remote_code=True)
    with pytest.raises(UnsupportedError, match="swap_space"):
        LLM(str(tiny_llama_dir), swap_space=4)
    with pytest.raises(UnsupportedError, match="cpu_offload_gb"):
        LLM(str(tiny_llama_dir), cpu_offload_gb=2)
    with pytest.raises(AscqError, match="not quantized"):
        LLM(str(tiny_llama_dir), quantization="compressed-tensors")
    with pytest.raises(AscqError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(str(tiny_llama_dir), gpu_memory_utilization=1.5)


def test_gpu_memory_utilization_sizes_kv_from_free_memory(tiny_llama_dir) -> None:
    import psutil

    from ascq.runtime.executor.start import module_bytes

    small = LLM(str(tiny_llama_dir), gpu_memory_utilization=0.01, max_model_len=128).engine
    free = psutil.virtual_memory().available
    kv_bytes = small.block_manager.num_blocks * small.block_bytes
    expected = 0.01 * free - module_bytes(small.model)
    # free memory moves a little meanwhile
    assert abs(kv_bytes - expected) < 0.2 * expected + 2 * small.block_bytes


# ---- sampling parameters against per-request references ------------------------------------------------


def reference_penalties(repetition: float, frequency: float, presence: float):
    """Plain per-token loops (HF's RepetitionPenaltyLogitsProcessor rule + OpenAI's frequency/presence)."""

    def processor(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        for token in set(prompt_ids) | set(output_ids):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(output_ids):
            logits[token] -= frequency * output_ids.count(token) + presence
        return logits

    return processor


def test_repetition_penalty_matches_transformers_on_logits() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    prompts, outputs = [[1, 2, 3], [4, 4], [7]], [[3, 9, 9], [], [8, 1]]
    ours = apply_penalties(
        logits,
        padded(prompts, 50),
        padded(outputs, 50),
        torch.tensor([1.3, 1.3, 1.3]),
        torch.zeros(3),
        torch.zeros(3),
    )
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], theirs[0])


def test_penalties_bias_and_bans_match_references(llm) -> None:
    eos = llm.get_tokenizer().eos_token_id
    first = llm.generate(PROMPTS[1], greedy())[0].outputs[0].token_ids[0]
    cases = [  # (batched parameter, reference logits processor)
        (dict(repetition_penalty=1.4), reference_penalties(1.4, 0, 0)),
        (dict(frequency_penalty=0.8, presence_penalty=0.5), reference_penalties(1.0, 0.8, 0.5)),
        (dict(repetition_penalty=0.8, presence_penalty=-0.4), reference_penalties(0.8, 0, -0.4)),
        (
            dict(logit_bias={first: -100.0}),
            lambda out, lg: lg.index_add(0, torch.tensor([first]), torch.tensor([-100.0])),
        ),
        (
            dict(min_tokens=20),
            lambda out, lg: lg.index_fill(0, torch.tensor([eos]), float("-inf")) if len(out) < 20 else lg,
        ),
        (
            dict(allowed_token_ids=[5, 9, 33, 71]),
            lambda out, lg: torch.full_like(lg, float("-inf")).index_copy(
                0, torch.tensor([5, 9, 33, 71]), lg[[5, 9, 33, 71]]
            ),
        ),
    ]
    prompts = [PROMPTS[i % 3] for i in range(len(cases))]
    batched = llm.generate(prompts, [greedy(**kwargs) for kwargs, _ in cases])  # one batch, mixed parameters
    reference = llm.generate(prompts, [greedy(logits_processors=[ref]) for _, ref in cases])
    assert token_ids(batched) == token_ids(reference)
    plain = token_ids(llm.generate(prompts, greedy()))
    # logit_bias -100 changed the greedy token
    assert token_ids(batched)[3][0] != first and plain[1][0] == first
    assert token_ids(batched)[0] != plain[0]  # the penalty did something
    assert set(token_ids(batched)[5]) <= {5, 9, 33, 71}


def test_min_tokens_holds_back_eos_and_stop_strings(llm) -> None:
    stopped = llm.generate(PROMPTS[0], greedy(stop=["\n"], max_tokens=30))[0].outputs[0]
    held = llm.generate(PROMPTS[0], greedy(stop=["\n"], max_tokens=30, min_tokens=12))[0].outputs[0]
    assert len(held.token_ids) >= 12 and len(stopped.token_ids) < 12


def test_bad_words_never_appear(llm) -> None:
    plain = llm.generate(PROMPTS[2], greedy(max_tokens=32))[0].outputs[0].text
    word = next(w for w in re.findall(r"[A-Za-z_]{3,}", plain))
    banned = llm.generate(PROMPTS[2], greedy(max_tokens=32, bad_words=[word]))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    sequences = [
        tokenizer.encode(word, add_special_tokens=False),
        tokenizer.encode(" " + word, add_special_tokens=False),
    ]
    out = banned.token_ids
    for seq in sequences:
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (word, seq, out)
    assert banned.text != plain


def test_stop_string_included_on_request(llm) -> None:
    full = llm.generate(PROMPTS[1], greedy(max_tokens=24))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = llm.generate(PROMPTS[1], greedy(max_tokens=24, stop=[stop]))[0].outputs[0]
    kept = llm.generate(PROMPTS[1], greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True))[
        0
    ].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert kept.text == full[: full.index(stop) + len(stop)] and kept.stop_reason == stop


def test_n_greedy_gives_identical_copies(llm) -> None:
    (out,) = llm.generate(PROMPTS[0], greedy(n=3))
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


def test_prompt_logprobs_match_transformers(llm, tiny_llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    ids = llm.get_tokenizer().encode(PROMPTS[2] * 3)
    llm.generate(ids, greedy(max_tokens=2))  # cache the prefix: prompt_logprobs must recompute it anyway
    (out,) = llm.generate(ids, greedy(max_tokens=2, prompt_logprobs=2))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for j in range(1, len(ids)):
        entry = out.prompt_logprobs[j]
        assert ids[j] in entry and len(entry) <= 3
        assert entry[ids[j]] == pytest.approx(float(expected[j - 1, ids[j]]), abs=2e-3)
        assert set(expected[j - 1].topk(2).indices.tolist()) <= set(entry)


def test_seeded_sampling_and_min_p(llm) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.05, seed=7, max_tokens=16)
    a, b = llm.generate([PROMPTS[0], PROMPTS[0]], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


# ---- structured outputs --------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_json_regex_choice(llm) -> None:
    cases = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    ]
    prompts = [PROMPTS[i % 3] for i in range(len(cases))]
    outs = llm.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c) for c in cases]
    )
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert isinstance(json.loads(texts[1]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[2]), texts[2]
    assert texts[3] in ("yes", "no", "maybe")
    sampled = llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=120, guided_decoding=StructuredOutputsParams(json=SCHEMA)
        ),
    )
    jsonschema.validate(json.loads(sampled[0].outputs[0].text), SCHEMA)


def test_structured_outputs_reject_bad_input(llm) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="invalid structured outputs regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
