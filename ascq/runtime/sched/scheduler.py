"""vLLM v1-style scheduler: one token budget per step shared by prefill chunks and decodes.

Each running request advances `num_computed_tokens` toward `num_tokens`; a prompt longer than the budget is
prefilled in chunks over several steps while other requests decode. Waiting requests are admitted first come
first served while blocks, the token budget and `max_num_seqs` allow (reusing prefix-cache hits). When a
running request cannot get a block, the newest running request is preempted: its blocks are freed and it goes
back to the front of the queue to be recomputed later (mostly from the prefix cache).

Speculative decoding: a running request's proposed tokens (`spec_token_ids`) are scheduled after its own
remaining tokens when the budget and the blocks allow (else it runs without them); after verification
`rollback_rejected` moves `num_computed_tokens` back to the accepted tokens and frees the rejected tail.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # own tokens + proposed tokens
    spec_token_ids: list[list[int]] = field(default_factory=list)  # proposed tokens run per request

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of admitted requests, counted once (prefix-cache hits included)
        self.num_cached_prompt_tokens = 0  # of those, served from the prefix cache
        self.num_tokens_run = 0  # every token run through the model (recomputation included)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_own = request.num_tokens - request.num_computed_tokens
            spec = request.spec_token_ids[: max(0, budget - num_own)]
            if spec and not self.block_manager.allocate_slots(request, num_own + len(spec)):
                spec = []
            num_new = min(num_own, budget) + len(spec)
            while not spec and not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                out.requests.append(request)
                out.num_scheduled_tokens.append(num_new)
                out.spec_token_ids.append(spec)
                budget -= num_new
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed_blocks) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.first_scheduled_time = time.monotonic()  # vLLM's queue / prefill time metrics
                request.num_cached_tokens = num_cached
                self.num_prompt_tokens += request.num_prompt_tokens
                self.num_cached_prompt_tokens += num_cached
            self.running.append(request)
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            out.spec_token_ids.append([])
            budget -= num_new
        return out

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance progress of the scheduled requests and publish their newly computed full blocks."""
        self.num_tokens_run += out.total_num_scheduled_tokens
        for request, num_new in zip(out.requests, out.num_scheduled_tokens, strict=True):
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request)

    def rollback_rejected(self, request: Request) -> None:
        """After verification: KV stays valid only up to the accepted tokens (the last emitted token has none
        yet); free the blocks past them and publish the now-verified full blocks."""
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.block_manager.free_excess_slots(request)
        self.block_manager.cache_full_blocks(request)

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
