"""LLMEngine: requests in, one scheduler step at a time, cumulative outputs out (vLLM's offline engine API)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from ascq.core.errors import AscqError
from ascq.runtime.engine.detokenizer import OutputText, stop_token_reason
from ascq.runtime.engine.engine_args import EngineArgs
from ascq.runtime.engine.outputs import CompletionOutput, RequestOutput
from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sampling.structured_output import StructuredOutputManager
from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request
from ascq.runtime.sched.scheduler import Scheduler
from ascq.runtime.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    kv_cache_torch_dtype,
    num_blocks_for,
)
from ascq.runtime.worker.loader import load_model, load_tokenizer, read_config
from ascq.runtime.worker.model_runner import ModelRunner
from ascq.runtime.worker.sampler import Sampler


def eos_token_ids(model_dir: Any, tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (its weights, before the KV cache is allocated)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class LLMEngine:
    """Single-threaded; drive it from one thread. See docs/ARCHITECTURE.md "Engine API"."""

    def __init__(self, args: EngineArgs, tokenizer: Any = None, sampler: Callable | None = None,
                 detokenize: bool = True) -> None:
        """`detokenize=False`: outputs carry token ids only and stop strings are not checked (the engine-core
        process: the serving process detokenises and finishes stop-string sequences with `finish_sequence`)."""
        self.args = args
        self.detokenize = detokenize
        config = read_config(args.model)
        self.config = config
        self.dtype = args.resolve_dtype(config)
        self.max_model_len = args.resolve_max_model_len(config)
        self.device = args.torch_device
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer or args.model)
        self.eos_token_ids = eos_token_ids(args.model, self.tokenizer)
        self.vocab_size = int(config["vocab_size"])
        torch.manual_seed(args.seed)
        args.check_quantization(config)
        args.check_parallel_layout(config)
        self.kv_cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        if args.world_size > 1:  # ranks in their own processes; this one is rank 0 (runtime/distributed)
            num_blocks = self._init_distributed(args, config)
        else:
            free_before_load = args.available_memory()
            self.model, self.quant_config = load_model(args.model, args.device, self.dtype, config)
            self.block_bytes = bytes_per_block(self.model, args.block_size, self.kv_cache_dtype)
            num_blocks = num_blocks_for(args.resolve_kv_cache_memory(free_before_load, module_bytes(self.model)), self.block_bytes, args.num_gpu_blocks_override)
            allocate_kv_cache(self.model, num_blocks, args.block_size, self.kv_cache_dtype, self.device)
            self.runner = ModelRunner(self.model, args.block_size, self.device, enforce_eager=args.enforce_eager,
                                      max_num_seqs=args.max_num_seqs)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.sampler = sampler or Sampler(args.seed, self.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}  # id(sequence) -> per prompt token
        self._init_speculation(sampler)
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.texts: dict[int, OutputText] = {}  # id(sequence) -> its output text (when detokenizing)
        self.pending_outputs: list[RequestOutput] = []
        self.num_generation_tokens = 0

    def _init_distributed(self, args: EngineArgs, config: dict[str, Any]) -> int:
        """Start the other ranks and load this rank's shard; KV blocks sized by the largest per-rank block."""
        from ascq.runtime.executor.executor import DistributedModelRunner, MultiprocExecutor

        free_before_load = args.available_memory()

        def num_blocks(block_bytes: int, model: torch.nn.Module) -> int | str:
            try:
                memory = args.resolve_kv_cache_memory(free_before_load, module_bytes(model))
                return num_blocks_for(memory, block_bytes, args.num_gpu_blocks_override)
            except AscqError as exc:
                return str(exc)

        executor = MultiprocExecutor(args, config, self.dtype, num_blocks)
        rank = executor.rank
        self.model, self.quant_config, self.block_bytes = rank.model, rank.quant_config, rank.block_bytes
        self.runner = DistributedModelRunner(executor, args.block_size)
        if not args.enforce_eager:
            logging.getLogger("ascq.runtime").info("enforce_eager=False: decode graphs are single-process only; "
                                                   "the ranks run eagerly")
        return rank.num_blocks

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # ValueError for a bad schema, before admission
        sequences = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            sequences.append(Request(request_id, text, token_ids, params, generator, index))
        self.requests[request_id] = sequences
        for sequence in sequences:
            if self.detokenize:
                self.texts[id(sequence)] = OutputText(self.tokenizer, token_ids, params)
            if params.structured_outputs is not None:
                self.structured.add(id(sequence), params.structured_outputs)
            if params.prompt_logprobs is not None:
                self.prompt_logprobs[id(sequence)] = [None]
            self.scheduler.add_request(sequence)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if message := params.token_ids_in_range(self.vocab_size):
            raise ValueError(message)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} = {total} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} needs more KV cache than the "
                f"{self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens available"
            )

    def abort_request(self, request_id: str) -> None:
        sequences = self.requests.get(request_id)
        if sequences is None:
            return
        for sequence in sequences:
            if not sequence.is_finished:
                self._finish(sequence, "abort")
        self.pending_outputs.append(self._output(request_id))
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.pending_outputs)

    # ---- stepping ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return outputs
        logits, sampling = self.runner.execute(scheduled)
        if self.prompt_logprobs:
            self._record_prompt_logprobs(scheduled)
        self.scheduler.update_after_step(scheduled)
        advanced: dict[str, None] = {}
        if self.proposer is None:
            results = [[r] for r in self._sample(logits, sampling)] if sampling else []
        else:
            results = self._verify(logits, sampling, scheduled)
        for request, tokens in zip(sampling, results, strict=True):
            for result in tokens:
                if not request.is_finished:
                    self._append_token(request, result.token_id, result.logprobs)
            advanced[request.request_id] = None
        if self.proposer is not None:
            self._propose(scheduled, sampling)
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

    def _record_prompt_logprobs(self, scheduled: Any) -> None:
        """log-softmax of the raw logits at every newly computed prompt position (vLLM's prompt_logprobs)."""
        start = 0
        for request, num_new in zip(scheduled.requests, scheduled.num_scheduled_tokens, strict=True):
            recorded = self.prompt_logprobs.get(id(request))
            first = request.num_computed_tokens  # predicts token first + 1
            if recorded is not None and first < len(recorded) <= first + num_new and len(recorded) < request.num_prompt_tokens:
                rows = torch.arange(start + len(recorded) - 1 - first, start + min(num_new, request.num_prompt_tokens - 1 - first))
                logprobs = self.model.compute_logits(self.runner.hidden_states[rows]).float().log_softmax(-1).cpu()
                top_n = request.params.prompt_logprobs
                for row, token_id in zip(logprobs, request.token_ids[len(recorded):request.num_prompt_tokens], strict=False):
                    entry = {token_id: float(row[token_id])}
                    if top_n:
                        values, ids = row.topk(top_n)
                        entry.update(zip(ids.tolist(), values.tolist(), strict=True))
                    recorded.append(entry)
            start += num_new

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> None:
        request.append_token(token_id)
        self.num_generation_tokens += 1
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token_id]
        params = request.params
        grammar_done = self.structured.accept(id(request), token_id)
        on_token, token_reason = stop_token_reason(token_id, request.num_output_tokens, params, self.eos_token_ids)
        text = self.texts.get(id(request))
        stop_string = text.add_token(token_id, request.num_output_tokens, on_token) if text is not None else None
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
        if self.proposer is not None:
            self.proposer.forget(request)
        request.finish(reason, stop_reason)

    def _output(self, request_id: str) -> RequestOutput:
        sequences = self.requests[request_id]
        first = sequences[0]
        completions = []
        for s in sequences:
            text = self.texts[id(s)].visible(s.is_finished) if self.detokenize else ""
            completions.append(CompletionOutput(
                index=s.index, text=text, token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=all(s.is_finished for s in sequences),
            num_cached_tokens=first.num_cached_tokens, prompt_logprobs=self.prompt_logprobs.get(id(first)),
        )

    def _forget(self, request_id: str) -> None:
        for sequence in self.requests.pop(request_id, []):
            self.texts.pop(id(sequence), None)
            self.structured.remove(id(sequence))
            self.prompt_logprobs.pop(id(sequence), None)

    # ---- speculative decoding (ascq/runtime/spec_decode/) ----------------------------------------------

    def _init_speculation(self, custom_sampler: Callable | None) -> None:
        self.proposer = self.rejection_sampler = None
        self.num_spec_drafts = self.num_spec_draft_tokens = self.num_spec_accepted_tokens = 0
        config = self.args.speculative_config
        if config is None:
            return
        if custom_sampler is not None:
            raise AscqError("a custom sampler cannot be combined with speculative_config (it cannot verify drafts)")
        from ascq.runtime.spec_decode import make_proposer
        from ascq.runtime.spec_decode.rejection_sampler import RejectionSampler

        self.proposer = make_proposer(config, self)
        self.rejection_sampler = RejectionSampler(self.sampler)

    def _verify(self, logits: torch.Tensor, sampling: list[Request], scheduled: Any) -> list[list[Any]]:
        """Tokens per sampled request: the sampler's one for requests without proposals, the rejection
        sampler's accepted run + one for the others; their rejected KV is rolled back."""
        spec_of = {id(r): spec for r, spec in zip(scheduled.requests, scheduled.spec_token_ids, strict=True)}
        specs = [spec_of[id(r)] for r in sampling]
        starts = [0]
        for spec in specs:
            starts.append(starts[-1] + 1 + len(spec))
        plain = [i for i, spec in enumerate(specs) if not spec]
        verified = [i for i, spec in enumerate(specs) if spec]
        results: list[list[Any]] = [[] for _ in sampling]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            for i, result in zip(plain, self._sample(logits[rows], [sampling[i] for i in plain]), strict=True):
                results[i] = [result]
        if verified:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in verified]).to(logits.device)
            requests = [sampling[i] for i in verified]
            probs = [r.spec_token_probs[: len(specs[i])] if r.spec_token_probs is not None else None
                     for i, r in zip(verified, requests, strict=True)]
            accepted = self.rejection_sampler(logits[rows], requests, [specs[i] for i in verified], probs)
            for i, tokens in zip(verified, accepted, strict=True):
                results[i] = tokens
                self.num_spec_drafts += 1
                self.num_spec_draft_tokens += len(specs[i])
                self.num_spec_accepted_tokens += len(tokens) - 1
        return results

    def _propose(self, scheduled: Any, sampling: list[Request]) -> None:
        """Roll back rejected KV, then propose the next tokens for every request that just got one."""
        for request, spec in zip(scheduled.requests, scheduled.spec_token_ids, strict=True):
            if spec and not request.is_finished:
                self.scheduler.rollback_rejected(request)
            request.spec_token_ids, request.spec_token_probs = [], None
        # structured-output requests run without proposals (their grammar would have to walk the drafts)
        running = [r for r in sampling if not r.is_finished and id(r) not in self.structured.matchers]
        if not running:
            return
        # room left: the last emitted token plus the proposals must stay within max_tokens and max_model_len
        room = [min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) - 1 for r in running]
        for request, (tokens, probs) in zip(running, self.proposer.propose(running, room), strict=True):
            request.spec_token_ids, request.spec_token_probs = tokens, probs

    def spec_decode_stats(self) -> dict[str, float | int]:
        drafts, proposed, accepted = self.num_spec_drafts, self.num_spec_draft_tokens, self.num_spec_accepted_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        }

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
            **self.spec_decode_stats(),
        }
