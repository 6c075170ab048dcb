"""Engine test helpers shared by the engine, runtime-model and speculative-decoding tests: a small-KV engine,
running requests to completion, and the no-leaked-block check."""

from __future__ import annotations

from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.sampling.sampling_params import SamplingParams

KV_MEMORY = 32 << 20


def make_engine(model_dir, tokenizer=None, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_cache_memory", KV_MEMORY)
    return LLMEngine(EngineArgs(model_dir, **kwargs), tokenizer=tokenizer)


def drain(engine: LLMEngine) -> dict[str, object]:
    """Step until no request is left: request id -> its final RequestOutput."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def run_batch(engine: LLMEngine, prompts: list, params: SamplingParams) -> dict[str, object]:
    """Add prompts[i] as request str(i), all with `params`, and drain."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    return drain(engine)


def assert_no_leaks(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert set(engine.block_manager.ref_counts) == {0}
