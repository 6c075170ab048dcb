"""LLMEngine: requests in, one scheduler step at a time, cumulative outputs out (vLLM's offline engine
API)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.runtime.engine.detokenizer import OutputText, stop_token_reason
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.inputs import PromptType, check_request_options, parse_prompt
from ascq.runtime.engine.outputs import CompletionOutput, RequestOutput
from ascq.runtime.engine.pooling_params import PoolingParams, as_sampling_params
from ascq.runtime.executor.start import start_model
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sampling.structured_output import StructuredOutputManager
from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request
from ascq.runtime.sched.scheduler import Scheduler
from ascq.runtime.spec_decode.speculator import Speculator, spec_decode_stats
from ascq.runtime.worker.kv_cache import kv_cache_torch_dtype
from ascq.runtime.worker.loader import engine_tokenizer
from ascq.runtime.worker.pooling import record_prompt_embeddings
from ascq.runtime.worker.prompt_logprobs import record_prompt_logprobs
from ascq.runtime.worker.sampler import Sampler


def eos_token_ids(model_dir: Any, tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


class LLMEngine:
    """Single-threaded; drive it from one thread. See docs/ARCHITECTURE.md "Engine API"."""

    def __init__(
        self,
        args: EngineArgs,
        tokenizer: Any = None,
        sampler: Callable | None = None,
        detokenize: bool = True,
    ) -> None:
        """`detokenize=False`: outputs carry token ids only and stop strings are not checked (the engine-core
        process: the serving process detokenises and finishes stop-string sequences with
        `finish_sequence`)."""
        self.args = args
        self.detokenize = detokenize
        config = args.model_config()
        self.config = config
        self.dtype = args.resolve_dtype(config)
        self.max_model_len = args.resolve_max_model_len(config)
        self.device = args.torch_device
        self.tokenizer = tokenizer if tokenizer is not None else engine_tokenizer(args)
        self.eos_token_ids = eos_token_ids(args.model, self.tokenizer)
        self.vocab_size = int(config["vocab_size"])
        torch.manual_seed(args.seed)
        args.check_quantization(config)
        args.check_parallel_layout(config)
        self.kv_cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        started = start_model(args, config, self.dtype, self.kv_cache_dtype)
        self.model, self.quant_config, self.runner = started.model, started.quant_config, started.runner
        self.block_bytes = started.block_bytes
        self.block_manager = BlockManager(started.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.sampler = sampler or Sampler(args.seed, self.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.prompt_logprobs: dict[
            int, list[dict[int, float] | None]
        ] = {}  # id(sequence) -> per prompt token
        self.prompt_embeddings: dict[int, list[float] | None] = {}  # id(sequence) -> pooled prompt
        self.speculator: Speculator | None = None
        if args.speculative_config is not None:
            if sampler is not None:
                raise AscqError(
                    "a custom sampler cannot be combined with speculative_config (it cannot verify drafts)"
                )
            self.speculator = Speculator(args.speculative_config, self, self.sampler)
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.texts: dict[int, OutputText] = {}  # id(sequence) -> its output text (when detokenizing)
        self.pending_outputs: list[RequestOutput] = []
        self.num_generation_tokens = 0
        self.num_step_tokens = 0  # tokens the last step ran (vLLM's iteration_tokens_total)

    # ---- requests ----------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> None:
        """vLLM's signature. `prompt`: text, token ids, or vLLM's TextPrompt / TokensPrompt dict, with an
        optional "cache_salt" (requests share cached prefix blocks only with requests of the same salt).
        `params`: SamplingParams, or PoolingParams for an embedding (RequestOutput.prompt_embedding).
        `arrival_time` only feeds vLLM's latency metrics (ascq times requests from when they arrive here); the
        other keywords must keep vLLM's defaults (`check_request_options`)."""
        check_request_options(lora_request, tokenization_kwargs, trace_headers, priority)
        params = as_sampling_params(params)
        prompt = parse_prompt(prompt)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            # ValueError for a bad schema, before admission
            self.structured.compile(params.structured_outputs)
        sequences = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            sequences.append(Request(request_id, text, token_ids, params, generator, index, cache_salt))
        self.requests[request_id] = sequences
        for sequence in sequences:
            if self.detokenize:
                self.texts[id(sequence)] = OutputText(self.tokenizer, token_ids, params)
            if params.structured_outputs is not None:
                self.structured.add(id(sequence), params.structured_outputs)
            if params.prompt_logprobs is not None:
                self.prompt_logprobs[id(sequence)] = [None]
            if params.pooling is not None:
                self.prompt_embeddings[id(sequence)] = None
            self.scheduler.add_request(sequence)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        wants_hidden = params.prompt_logprobs is not None or params.pooling is not None
        if wants_hidden and not self.runner.keeps_hidden_states:
            raise ValueError(
                "prompt_logprobs and embeddings need the final hidden states, which multi-process "
                "(tensor / pipeline parallel) steps do not return to the engine"
            )
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if message := params.token_ids_in_range(self.vocab_size):
            raise ValueError(message)
        max_logprobs = self.vocab_size if self.args.max_logprobs == -1 else self.args.max_logprobs
        for kind, requested in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if requested is not None and requested > max_logprobs:  # vLLM's check and wording
                raise ValueError(
                    f"Requested {kind} logprobs of {requested}, which is greater than max allowed: "
                    f"{max_logprobs} (max_logprobs, the server's --max-logprobs)"
                )
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} needs more KV cache than "
                f"the "
                f"{self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens available"
            )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """vLLM's: one id or several; each unfinished request's next output is its last (finish_reason
        "abort"); unknown ids are ignored, as finished requests are."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            sequences = self.requests.get(one)
            if sequences is None:
                continue
            for sequence in sequences:
                if not sequence.is_finished:
                    self._finish(sequence, "abort")
            self.pending_outputs.append(self._output(one))
            self._forget(one)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending_outputs)

    # ---- stepping ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        scheduled = self.scheduler.schedule()
        self.num_step_tokens = 0
        if not scheduled.requests:
            return outputs
        logits, sampling = self.runner.execute(scheduled)
        if self.prompt_logprobs:
            record_prompt_logprobs(
                scheduled, self.prompt_logprobs, self.runner.hidden_states, self.model.compute_logits
            )
        if self.prompt_embeddings:
            record_prompt_embeddings(scheduled, self.prompt_embeddings, self.runner.hidden_states)
        self.scheduler.update_after_step(scheduled)
        advanced: dict[str, None] = {}
        if self.speculator is None:
            results = [[r] for r in self._sample(logits, sampling)] if sampling else []
        else:
            spec_of = {
                id(r): spec for r, spec in zip(scheduled.requests, scheduled.spec_token_ids, strict=True)
            }
            results = self.speculator.verify(
                logits, sampling, [spec_of[id(r)] for r in sampling], self._sample
            )
        # vLLM's iteration_tokens_total: the prompts whose prefill this step finished + the tokens generated
        num_prefilled = sum(r.num_prompt_tokens for r in sampling if r.num_output_tokens == 0)
        num_generated_before = self.num_generation_tokens
        for request, tokens in zip(sampling, results, strict=True):
            for result in tokens:
                if not request.is_finished:
                    self._append_token(request, result.token_id, result.logprobs)
            advanced[request.request_id] = None
        if self.speculator is not None:
            self._speculate(scheduled, sampling)
        self.num_step_tokens = num_prefilled + self.num_generation_tokens - num_generated_before
        for request_id in advanced:
            output = self._output(request_id)
            outputs.append(output)
            if output.finished:
                self._forget(request_id)
        return outputs

    def _sample(self, logits: torch.Tensor, sampling: list[Request]) -> list[Any]:
        bitmask = self.structured.bitmask([id(r) for r in sampling])
        if bitmask is None:  # custom samplers need not know structured outputs
            return self.sampler(logits, sampling)
        return self.sampler(logits, sampling, token_bitmask=bitmask)

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> None:
        request.append_token(token_id)
        self.num_generation_tokens += 1
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token_id]
        params = request.params
        grammar_done = self.structured.accept(id(request), token_id)
        on_token, token_reason = stop_token_reason(
            token_id, request.num_output_tokens, params, self.eos_token_ids
        )
        text = self.texts.get(id(request))
        stop_string = (
            text.add_token(token_id, request.num_output_tokens, on_token) if text is not None else None
        )
        if on_token:
            self._finish(request, "stop", token_reason)
        elif stop_string is not None:
            self._finish(request, "stop", stop_string)
        elif grammar_done and request.num_output_tokens >= params.min_tokens:
            self._finish(request, "stop")
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def finish_sequence(self, request_id: str, index: int, stop_reason: int | str | None) -> None:
        """Finish one of a request's sequences now (the serving process found a stop string in its text)."""
        sequences = self.requests.get(request_id)
        if sequences is None or sequences[index].is_finished:
            return
        self._finish(sequences[index], "stop", stop_reason)
        if all(s.is_finished for s in sequences):
            self.pending_outputs.append(self._output(request_id))
            self._forget(request_id)

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        request.finish(reason, stop_reason)

    def _output(self, request_id: str) -> RequestOutput:
        sequences = self.requests[request_id]
        first = sequences[0]
        completions = []
        for s in sequences:
            text = self.texts[id(s)].visible(s.is_finished) if self.detokenize else ""
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(s.is_finished for s in sequences),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs.get(id(first)),
            prompt_embedding=self.prompt_embeddings.get(id(first)),
            first_scheduled_time=first.first_scheduled_time,
        )

    def _forget(self, request_id: str) -> None:
        for sequence in self.requests.pop(request_id, []):
            self.texts.pop(id(sequence), None)
            self.structured.remove(id(sequence))
            self.prompt_logprobs.pop(id(sequence), None)
            self.prompt_embeddings.pop(id(sequence), None)

    # ---- speculative decoding (ascq/runtime/spec_decode/) ----------------------------------------------

    def _speculate(self, scheduled: Any, sampling: list[Request]) -> None:
        """Roll back rejected KV, then propose the next tokens for every request that just got one
        (structured-output requests run without proposals: their grammar would have to walk the drafts)."""
        for request, spec in zip(scheduled.requests, scheduled.spec_token_ids, strict=True):
            if spec and not request.is_finished:
                self.scheduler.rollback_rejected(request)
            request.spec_token_ids, request.spec_token_probs = [], None
        running = [r for r in sampling if not r.is_finished and id(r) not in self.structured.matchers]
        self.speculator.propose(running, self.max_model_len)

    def dead_ranks(self) -> str | None:
        """Which worker processes have exited, as a one-line message (None when all run, or in one
        process)."""
        dead_ranks = getattr(self.runner, "dead_ranks", None)
        return dead_ranks() if dead_ranks is not None else None

    def shutdown(self) -> None:
        """Stop the executor's worker processes (none in a single process)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- stats -------------------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, float | int]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_total_blocks": self.block_manager.num_blocks,
            "kv_cache_usage": self.block_manager.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.scheduler.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_cached_prompt_tokens": self.scheduler.num_cached_prompt_tokens,
            "num_computed_tokens": self.scheduler.num_tokens_run,
            "num_step_tokens": self.num_step_tokens,
            **(self.speculator.stats() if self.speculator else spec_decode_stats()),
        }
