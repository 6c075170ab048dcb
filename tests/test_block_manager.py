"""Block manager: allocation, prefix-cache hash chain, reference counts, LRU eviction, no leaks."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from ascq.runtime.sampling.sampling_params import SamplingParams
from ascq.runtime.sched import block_manager
from ascq.runtime.sched.block_manager import BlockManager
from ascq.runtime.sched.request import Request


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, None, tokens, SamplingParams())


def compute(bm: BlockManager, r: Request, hits: list[int] | None = None) -> None:
    """Admit a request and pretend its whole prompt was computed."""
    hits = bm.get_computed_blocks(r) if hits is None else hits
    r.num_computed_tokens = 0
    assert bm.allocate_slots(r, r.num_tokens - len(hits) * bm.block_size, hits)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def test_allocation_counts_blocks_and_fails_when_short():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(list(range(9)))
    assert bm.allocate_slots(a, 9) and len(a.block_table) == 3 and bm.num_free_blocks == 1
    b = req(list(range(100, 106)))
    assert not bm.allocate_slots(b, 6) and b.block_table == []
    bm.free(a)
    assert bm.num_free_blocks == 4


def test_shared_prefix_hits_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req(list(range(10)))
    compute(bm, a)
    b = req(list(range(10)) + [50, 51])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]  # 2 full blocks of a; a's third block is partial
    c = req(list(range(8)))  # exactly two full blocks: the last token must be recomputed
    assert bm.get_computed_blocks(c) == a.block_table[:1]
    d = req([0, 1, 2, 99] + list(range(4, 10)))  # diverges in block 0: the chain breaks at once
    assert bm.get_computed_blocks(d) == []


def test_ref_counts_and_lru_eviction_of_free_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5])
    compute(bm, a)
    shared = a.block_table[:2]
    b = req([1, 2, 3, 4, 9])
    compute(bm, b)
    assert b.block_table[:2] == shared and all(bm.ref_counts[x] == 2 for x in shared)
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in shared)
    bm.free(b)
    assert bm.num_free_blocks == 4 and set(bm.ref_counts) == {0}
    # cached blocks stay reusable after being freed ...
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 7])) == shared
    # ... until allocation needs them: least recently freed first; a request's tail before its head
    e = req(list(range(20, 26)))
    compute(bm, e, hits=[])
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 7])) == shared[:1]
    f = req([30, 31])
    compute(bm, f, hits=[])
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 7])) == []
    bm.free(f)
    bm.free(e)
    assert bm.num_free_blocks == 4


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = req([1, 2, 3])
    compute(bm, a)
    bm.free(a)
    b = req([1, 2, 8])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1 and bm.allocate_slots(b, 1, hits)
    assert bm.num_free_blocks == 1 and b.block_table[0] == hits[0]
    c = req([5, 6, 7, 8, 9])
    assert not bm.allocate_slots(c, 5)  # needs 3 blocks, only 1 free: the hit block is not evictable now


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = req([1, 2, 3, 4, 5])
    compute(bm, a, hits=[])
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 5])) == []


def test_block_keys_are_sha256_chained_over_parent_and_tokens():
    from ascq.runtime.sched.block_manager import ROOT_KEY, block_key

    bm = BlockManager(num_blocks=8, block_size=2)
    r = req([1, 2, 3, 4, 5])
    first, second = bm._hash_blocks(r, 2)
    assert first == hashlib.sha256(ROOT_KEY + array("q", [1, 2]).tobytes()).digest()
    assert second == block_key(first, [3, 4]) != block_key(ROOT_KEY, [3, 4])
    assert block_key(ROOT_KEY, [1, 2]) != block_key(ROOT_KEY, [2, 1])


def test_colliding_block_keys_never_share_kv(monkeypatch: pytest.MonkeyPatch):
    """Every block key collides (the old Python-hash keying and the new one, both made constant): a request
    whose tokens differ must not get the first request's KV blocks; one with the same tokens still hits."""
    monkeypatch.setattr(block_manager, "hash", lambda _: 0, raising=False)  # the keying before sha256
    monkeypatch.setattr(block_manager, "block_key", lambda *_: b"\0" * 32, raising=False)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    compute(bm, a)
    assert bm.get_computed_blocks(req([9, 9, 9, 9, 5], "b")) == []
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 0, 0, 0, 0, 9], "c")) == a.block_table[:1]
    assert bm.get_computed_blocks(req([1, 2, 3, 4, 5], "d")) == a.block_table[:1]
