"""LLMEngine: requests in, one scheduler step at a time, cumulative outputs out (vLLM's offline engine API)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from ascq.errors import AscqError
from ascq.runtime.block_manager import BlockManager
from ascq.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from ascq.runtime.engine_args import EngineArgs
from ascq.runtime.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_torch_dtype, num_blocks_for
from ascq.runtime.loader import load_model, read_config
from ascq.runtime.model_runner import ModelRunner
from ascq.runtime.outputs import CompletionOutput, RequestOutput
from ascq.runtime.request import Request
from ascq.runtime.sampler import Sampler
from ascq.runtime.sampling_params import SamplingParams
from ascq.runtime.scheduler import Scheduler


def load_tokenizer(path: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise AscqError(f"cannot load a tokenizer from {path}: {' '.join(str(exc).split())[:200]}") from exc


def eos_token_ids(model_dir: Any, tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


class LLMEngine:
    """Single-threaded; drive it from one thread. See docs/ARCHITECTURE.md "Engine API"."""

    def __init__(self, args: EngineArgs, tokenizer: Any = None, sampler: Callable | None = None) -> None:
        self.args = args
        config = read_config(args.model)
        self.config = config
        self.dtype = args.resolve_dtype(config)
        self.max_model_len = args.resolve_max_model_len(config)
        self.device = args.torch_device
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer or args.model)
        self.eos_token_ids = eos_token_ids(args.model, self.tokenizer)
        self.vocab_size = int(config["vocab_size"])
        torch.manual_seed(args.seed)
        self.model, self.quant_config = load_model(args.model, args.device, self.dtype, config)
        self.kv_cache_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, self.dtype)
        self.block_bytes = bytes_per_block(self.model, args.block_size, self.kv_cache_dtype)
        num_blocks = num_blocks_for(args.resolve_kv_cache_memory(), self.block_bytes, args.num_gpu_blocks_override)
        allocate_kv_cache(self.model, num_blocks, args.block_size, self.kv_cache_dtype, self.device)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, args.block_size, self.device)
        self.sampler = sampler or Sampler(args.seed)
        self._init_speculation(sampler)
        self.requests: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.pending_outputs: list[RequestOutput] = []
        self.num_generation_tokens = 0

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)
        sequences = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + index)
            sequences.append(Request(request_id, text, token_ids, params, generator, index))
        self.requests[request_id] = sequences
        for sequence in sequences:
            self.detokenizers[id(sequence)] = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            self.scheduler.add_request(sequence)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
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
        self.scheduler.update_after_step(scheduled)
        advanced: dict[str, None] = {}
        if self.proposer is None:
            results = [[r] for r in self.sampler(logits, sampling)] if sampling else []
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

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> None:
        request.append_token(token_id)
        self.num_generation_tokens += 1
        if logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[token_id]
        delta = self.detokenizers[id(request)].add_token(token_id)
        request.output_text += delta
        params = request.params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            self._finish(request, "stop")
        elif token_id in params.stop_token_ids:
            self._finish(request, "stop", token_id)
        elif delta and params.stop and (match := find_stop_string(request.output_text, len(delta), params.stop)):
            request.output_text = request.output_text[: match[0]]
            self._finish(request, "stop", match[1])
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

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
            text = s.output_text
            if not s.is_finished and s.params.stop:  # hold back a possible partial stop string
                text = text[: max(0, len(text) - max(len(x) for x in s.params.stop) + 1)]
            completions.append(CompletionOutput(
                index=s.index, text=text, token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=all(s.is_finished for s in sequences),
            num_cached_tokens=first.num_cached_tokens,
        )

    def _forget(self, request_id: str) -> None:
        for sequence in self.requests.pop(request_id, []):
            self.detokenizers.pop(id(sequence), None)

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
        self.rejection_sampler = RejectionSampler(self.sampler.generator)

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
            for i, result in zip(plain, self.sampler(logits[rows], [sampling[i] for i in plain]), strict=True):
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
        running = [r for r in sampling if not r.is_finished]
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
