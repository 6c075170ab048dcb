"""LLMEngine behaviour: continuous-batching invariance (with preemption), prefix caching, no leaked blocks,
stop conditions, fp8 KV cache, input errors."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import assert_no_leaks, drain, make_engine

from ascq.core.errors import AscqError
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.sampling.sampling_params import SamplingParams


def mixed_requests(num: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(num):
        prompt_len = int(torch.randint(1, 160, (1,), generator=g))
        max_tokens = int(torch.randint(1, 13, (1,), generator=g))
        requests.append((torch.randint(1, 4096, (prompt_len,), generator=g).tolist(), max_tokens))
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_staggered(
    engine: LLMEngine, requests: list[tuple[list[int], int]], per_step: int = 3
) -> dict[str, list[int]]:
    pending = list(enumerate(requests))
    done = {}
    while pending or engine.has_unfinished_requests():
        for i, (prompt, max_tokens) in pending[:per_step]:
            engine.add_request(str(i), prompt, greedy(max_tokens))
        pending = pending[per_step:]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.fixture(scope="module")
def alone_outputs(random_llama_dir, byte_tokenizer):
    """Each of the 64 mixed requests run by itself in a fresh engine state (one request at a time)."""
    engine = make_engine(random_llama_dir, byte_tokenizer, enable_prefix_caching=False)
    requests = mixed_requests(64)
    outputs = {}
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(str(i), prompt, greedy(max_tokens))
        outputs[str(i)] = drain(engine)[str(i)].outputs[0].token_ids
    return requests, outputs


@pytest.mark.slow
def test_continuous_batching_matches_requests_run_alone(random_llama_dir, byte_tokenizer, alone_outputs):
    requests, expected = alone_outputs
    engine = make_engine(random_llama_dir, byte_tokenizer, max_num_batched_tokens=256, max_num_seqs=16)
    assert run_staggered(engine, requests) == expected
    assert_no_leaks(engine)


@pytest.mark.slow
def test_preemption_keeps_outputs_and_frees_blocks(random_llama_dir, byte_tokenizer, alone_outputs):
    requests, expected = alone_outputs
    engine = make_engine(
        random_llama_dir, byte_tokenizer, num_gpu_blocks_override=32, max_num_batched_tokens=256
    )
    assert run_staggered(engine, requests, per_step=8) == expected
    assert engine.get_stats()["num_preemptions"] > 0
    assert_no_leaks(engine)


def test_prefix_cache_hit_computes_only_new_tokens(random_llama_dir, byte_tokenizer):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(1, 4096, (256,), generator=g).tolist()
    first = prefix + torch.randint(1, 4096, (21,), generator=g).tolist()
    second = prefix + torch.randint(1, 4096, (37,), generator=g).tolist()
    engine = make_engine(random_llama_dir, byte_tokenizer)
    engine.add_request("a", first, greedy(5))
    drain(engine)
    before = engine.get_stats()
    engine.add_request("b", second, greedy(6))
    out = drain(engine)["b"]
    after = engine.get_stats()
    assert after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"] == 256
    assert out.num_cached_tokens == 256
    assert after["num_computed_tokens"] - before["num_computed_tokens"] == (len(second) - 256) + (6 - 1)
    uncached = make_engine(random_llama_dir, byte_tokenizer, enable_prefix_caching=False)
    uncached.add_request("b", second, greedy(6))
    assert drain(uncached)["b"].outputs[0].token_ids == out.outputs[0].token_ids
    assert_no_leaks(engine)


def test_whole_prompt_hit_recomputes_last_token(random_llama_dir, byte_tokenizer):
    prompt = list(range(1, 65))  # exactly 4 full blocks
    engine = make_engine(random_llama_dir, byte_tokenizer)
    engine.add_request("a", prompt, greedy(3))
    first = drain(engine)["a"].outputs[0].token_ids
    engine.add_request("b", prompt, greedy(3))
    out = drain(engine)["b"]
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == first


def test_abort_frees_blocks_of_running_and_waiting(random_llama_dir, byte_tokenizer):
    engine = make_engine(random_llama_dir, byte_tokenizer, max_num_seqs=2)
    for i in range(4):
        engine.add_request(str(i), list(range(1, 40 + i)), greedy(50))
    engine.step()
    engine.step()
    assert engine.get_stats()["num_running"] == 2 and engine.get_stats()["num_waiting"] == 2
    engine.abort_request("0")  # running
    engine.abort_request("3")  # waiting
    engine.abort_request("unknown")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["0"].finished and outputs["0"].outputs[0].finish_reason == "abort"
    assert outputs["3"].outputs[0].finish_reason == "abort" and outputs["3"].outputs[0].token_ids == []
    drain(engine)
    assert_no_leaks(engine)


def only_bytes(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Logits processor: restrict to printable-byte tokens so the byte tokenizer yields text."""
    mask = torch.full_like(logits, float("-inf"))
    mask[ord("a") + 1 : ord("z") + 2] = 0
    return logits + mask


def test_stop_strings_stop_token_ids_and_length(random_llama_dir, byte_tokenizer):
    engine = make_engine(random_llama_dir, byte_tokenizer)
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logits_processors=[only_bytes])
    engine.add_request("free", [5, 6, 7], base)
    free = drain(engine)["free"].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30 and len(free.text) == 30
    stop = free.text[10:13]
    engine.add_request("s", [5, 6, 7], SamplingParams(**{**base.__dict__, "stop": [stop]}))
    out = drain(engine)["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == free.text[: free.text.index(stop)] and stop not in out.text
    token = free.token_ids[7]
    engine.add_request("t", [5, 6, 7], SamplingParams(**{**base.__dict__, "stop_token_ids": [token]}))
    out = drain(engine)["t"].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", token)
    assert out.token_ids == free.token_ids[: free.token_ids.index(token) + 1]


def test_eos_stops_unless_ignored(random_llama_dir, byte_tokenizer):
    def force_eos_after_two(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(token_ids) == 2:
            logits[byte_tokenizer.eos_token_id] = 1e4
        return logits

    engine = make_engine(random_llama_dir, byte_tokenizer)
    engine.add_request(
        "eos", [9, 9], SamplingParams(temperature=0, max_tokens=8, logits_processors=[force_eos_after_two])
    )
    engine.add_request(
        "ign",
        [9, 9],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logits_processors=[force_eos_after_two]),
    )
    done = drain(engine)
    assert done["eos"].outputs[0].token_ids[-1] == 0 and len(done["eos"].outputs[0].token_ids) == 3
    assert done["eos"].outputs[0].finish_reason == "stop" and done["eos"].outputs[0].stop_reason is None
    assert len(done["ign"].outputs[0].token_ids) == 8


def test_seeded_sampling_is_reproducible_and_n_samples_differ(random_llama_dir, byte_tokenizer):
    engine = make_engine(random_llama_dir, byte_tokenizer)
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True, n=3, logprobs=2
    )
    engine.add_request("x", [1, 2, 3], params)
    engine.add_request("y", [1, 2, 3], params)
    done = drain(engine)
    xs = [c.token_ids for c in done["x"].outputs]
    assert xs == [c.token_ids for c in done["y"].outputs]
    assert len({tuple(t) for t in xs}) > 1
    completion = done["x"].outputs[0]
    assert len(completion.logprobs) == 12 and all(len(step) in (2, 3) for step in completion.logprobs)
    assert completion.cumulative_logprob == pytest.approx(
        sum(step[t] for step, t in zip(completion.logprobs, completion.token_ids, strict=True))
    )


def test_block_size_128(random_llama_dir, byte_tokenizer, alone_outputs):
    requests, expected = alone_outputs
    engine = make_engine(random_llama_dir, byte_tokenizer, block_size=128)
    subset = requests[:12]
    assert run_staggered(engine, subset) == {k: v for k, v in expected.items() if int(k) < 12}
    assert_no_leaks(engine)


def test_fp8_kv_cache_doubles_blocks_and_warns_without_scales(random_llama_dir, byte_tokenizer, caplog):
    bf16 = make_engine(random_llama_dir, byte_tokenizer, dtype="bfloat16", kv_cache_memory=8 << 20)
    with caplog.at_level(logging.WARNING, logger="ascq.runtime"):
        fp8 = make_engine(
            random_llama_dir, byte_tokenizer, dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory=8 << 20
        )
    assert "no k/v scales" in caplog.text
    assert fp8.get_stats()["num_total_blocks"] == 2 * bf16.get_stats()["num_total_blocks"]
    assert fp8.model.model.layers[0].self_attn.attn.k_cache.dtype == torch.float8_e4m3fn


def test_input_errors(random_llama_dir, byte_tokenizer):
    engine = make_engine(random_llama_dir, byte_tokenizer, max_model_len=128)
    with pytest.raises(
        ValueError, match=r"prompt length 120 \+ max_tokens 16 = 136 exceeds max_model_len 128"
    ):
        engine.add_request("long", list(range(1, 121)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 4096\)"):
        engine.add_request("oov", [5000], SamplingParams())
    engine.add_request("dup", [1], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(AscqError, match="kv_cache_dtype"):
        EngineArgs(random_llama_dir, kv_cache_dtype="int4")
    with pytest.raises(AscqError, match="max_position_embeddings"):
        make_engine(random_llama_dir, byte_tokenizer, max_model_len=10**6)
    with pytest.raises(AscqError, match="not a model folder"):
        EngineArgs(random_llama_dir / "nope")
