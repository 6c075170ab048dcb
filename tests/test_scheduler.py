"""Scheduler: token budget, chunked prefill mixed with decode, max_num_seqs, FCFS, preemption of the
newest."""

from __future__ import annotations

import pytest

from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request, RequestStatus
from ascq.runtime.sched.scheduler import Scheduler


def req(rid: str, num_tokens: int) -> Request:
    return Request(rid, None, list(range(1, num_tokens + 1)), SamplingParams())


def step(s: Scheduler, sample: bool = True) -> dict[str, int]:
    """One schedule + update; requests that finished their tokens get one sampled token appended."""
    out = s.schedule()
    s.update_after_step(out)
    if sample:
        for r in out.requests:
            if r.num_computed_tokens == r.num_tokens:
                r.append_token(7)
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)}


def test_chunked_prefill_shares_the_budget_with_decodes():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    s.add_request(req("a", 3))
    assert step(s) == {"a": 3}
    s.add_request(req("b", 25))
    assert step(s) == {"a": 1, "b": 9}  # decode first, the prompt gets the rest of the budget
    assert step(s) == {"a": 1, "b": 9}
    assert step(s) == {"a": 1, "b": 7}
    assert step(s) == {"a": 1, "b": 1}


def test_max_num_seqs_and_fcfs_admission():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add_request(req(rid, 4))
    assert step(s) == {"a": 4, "b": 4}
    assert [r.request_id for r in s.waiting] == ["c"]
    s.finish(s.running[0])
    assert step(s) == {"b": 1, "c": 4}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_newest_running_request_is_preempted_and_recomputed(prefix_caching):
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=prefix_caching)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", 7), req("b", 7)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == {"a": 7, "b": 7}  # 2 blocks each: cache full
    assert step(s) == {"a": 1, "b": 1}  # 8 tokens fit in the 2 blocks
    scheduled = step(s)  # a needs a third block: b (newest) is preempted
    assert scheduled == {"a": 1} and s.num_preemptions == 1
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b
    s.finish(a)
    # recomputed: prompt + its 2 generated tokens, or only the last one when its 2 full blocks are still
    # cached
    assert step(s) == {"b": 1 if prefix_caching else 9}
    s.finish(b)
    assert bm.num_free_blocks == 4


def test_waiting_requests_do_not_jump_the_queue_when_blocks_are_short():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    s.add_request(req("big", 12))
    s.add_request(req("small", 2))
    s.add_request(req("blocked", 9))
    assert step(s, sample=False) == {"big": 12}
    assert [r.request_id for r in s.waiting] == ["small", "blocked"]
