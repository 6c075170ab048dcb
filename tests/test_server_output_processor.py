"""The serving process detokenises (output_processor.py): the engine core's token-id deltas, run through the
OutputProcessor, must give exactly the outputs of the in-process engine (which detokenises itself), step by
step, including stop strings, min_tokens, include_stop_str_in_output, stop token ids, n > 1 and logprobs. Runs
the real engine on the committed tiny-llama fixture, in one process (the pipe between them carries these same
objects)."""

from __future__ import annotations

import dataclasses

import pytest

from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.engine_core import DeltaEncoder
from ascq.runtime.engine.llm_engine import LLMEngine
from ascq.runtime.engine.output_processor import OutputProcessor
from ascq.runtime.engine.outputs import RequestOutput
from ascq.runtime.sampling.sampling_params import SamplingParams

PROMPTS = ["def main(", "import os\n", "class Foo", "for i in range(", "# utils\n"]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory=32 << 20, dtype="float32")
    return LLMEngine(args), LLMEngine(args, detokenize=False)


def request_cases(engine: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
    """Requests whose stop strings and stop token ids come from the model's own greedy output, so they do
    hit."""
    tokenizer = engine.tokenizer
    cases = []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        engine.add_request(f"probe{i}", ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
        text, token_ids = outputs[f"probe{i}"].outputs[0].text, outputs[f"probe{i}"].outputs[0].token_ids
        assert len(text) > 12, text
        cases += [
            (ids, SamplingParams(temperature=0, max_tokens=24)),
            (ids, SamplingParams(temperature=0, max_tokens=24, stop=[text[6:9], "\x00never"])),
            (
                ids,
                SamplingParams(temperature=0, max_tokens=24, stop=text[6:9], include_stop_str_in_output=True),
            ),
            (ids, SamplingParams(temperature=0, max_tokens=24, stop=text[1:3], min_tokens=6)),
            (ids, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token_ids[5]], logprobs=2)),
            (
                ids,
                SamplingParams(
                    temperature=0,
                    max_tokens=24,
                    stop_token_ids=[token_ids[5]],
                    include_stop_str_in_output=True,
                ),
            ),
            (
                ids,
                SamplingParams(
                    n=2, temperature=1.0, seed=7 + i, max_tokens=20, stop=[text[4:6], text[10:12]], logprobs=1
                ),
            ),
        ]
    return cases


def run_in_process(engine: LLMEngine, cases) -> list[list]:
    for k, (ids, params) in enumerate(cases):
        engine.add_request(f"r{k}", ids, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def run_core_and_processor(core: LLMEngine, cases, finish_lag: int) -> list[list]:
    """The core (no detokenisation) + DeltaEncoder -> OutputProcessor; a stop string found by the processor
    reaches the core `finish_lag` steps later (the serving process's finish message can trail the core)."""
    encoder, processor = DeltaEncoder(), OutputProcessor(core.tokenizer, core.eos_token_ids)
    for k, (ids, params) in enumerate(cases):
        core.add_request(f"r{k}", ids, params)
        processor.add(f"r{k}", None, ids, params)
    steps, pending = [], []
    while core.has_unfinished_requests():
        outputs = []
        for core_output in core.step():
            assert all(o.text == "" for o in core_output.outputs)  # the core ships token ids only
            output, stopped = processor.process(encoder.encode(core_output))
            if output is not None:
                outputs.append(output)
            pending += [(len(steps) + finish_lag, output.request_id, index, stop) for index, stop in stopped]
        steps.append(outputs)
        for due, request_id, index, stop in [p for p in pending if p[0] <= len(steps) - 1]:
            core.finish_sequence(request_id, index, stop)
            pending.remove((due, request_id, index, stop))
    return [s for s in steps if s]


def split_logprobs(outputs: dict[str, RequestOutput]) -> tuple[dict[str, RequestOutput], list[float]]:
    """`outputs` with every logprob value set to 0, and those values in order."""
    values = []

    def strip(logprobs: dict[int, float]) -> dict[int, float]:
        values.extend(logprobs.values())
        return dict.fromkeys(logprobs, 0.0)

    stripped = {}
    for request_id, output in sorted(outputs.items()):
        completions = []
        for o in output.outputs:
            values.append(o.cumulative_logprob or 0.0)
            logprobs = None if o.logprobs is None else [strip(step) for step in o.logprobs]
            completions.append(dataclasses.replace(o, cumulative_logprob=None, logprobs=logprobs))
        stripped[request_id] = dataclasses.replace(output, outputs=completions)
    return stripped, values


def finals(steps: list[list]) -> dict[str, object]:
    return {o.request_id: o for step in steps for o in step if o.finished}


def test_processor_outputs_equal_in_process_engine_step_by_step(engines):
    reference_engine, core = engines
    cases = request_cases(reference_engine)
    reference = run_in_process(reference_engine, cases)
    served = run_core_and_processor(core, cases, finish_lag=0)
    assert served == [s for s in reference if s]
    stops = [o.stop_reason for o in finals(reference).values() for o in o.outputs]
    assert sum(isinstance(s, str) for s in stops) >= 10 and sum(isinstance(s, int) for s in stops) >= 5


def test_processor_drops_tokens_the_core_made_after_a_stop_string(engines):
    reference_engine, core = engines
    cases = request_cases(reference_engine)
    reference = finals(run_in_process(reference_engine, cases))
    num_core_tokens = core.num_generation_tokens
    served = finals(run_core_and_processor(core, cases, finish_lag=2))
    # the lag changes which rows share a step, and an fp32 GEMM's low bits may depend on the row count (MKL on
    # AVX-512 hosts): logprobs agree to rounding, everything else exactly
    assert split_logprobs(served)[0] == split_logprobs(reference)[0]
    assert split_logprobs(served)[1] == pytest.approx(split_logprobs(reference)[1], rel=1e-4, abs=1e-5)
    num_kept = sum(len(o.token_ids) for output in served.values() for o in output.outputs)
    # the core did make tokens past stop strings
    assert core.num_generation_tokens - num_core_tokens > num_kept
