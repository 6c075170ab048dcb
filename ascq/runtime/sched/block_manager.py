"""KV-cache block allocation with automatic prefix caching (vLLM v1's design).

Every full block of a request gets a key: sha256 over the previous block's key and the block's token ids
(vLLM's `--prefix-caching-hash-algo sha256`; Python's `hash()` of ints and tuples is unkeyed and collisions
can be built, CVE-2025-25183). Nothing else changes a block's KV here: one model, no LoRA, no multimodal
inputs; such inputs would join the key. A computed full block is registered under its key and can be shared
(reference counted) by any later request whose block has the same key, parent key and token ids (a hit
compares the stored token ids, so even a colliding key never hands out another prompt's KV). Freed blocks keep
their hash and join the free queue at the tail; allocation takes from the head, so cached blocks are evicted
least-recently-freed first. A request's last prompt token is always recomputed, so a hit never covers the
whole prompt (the model must produce logits for it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from ascq.runtime.sched.request import Request

ROOT_KEY = hashlib.sha256(b"ascq prefix cache v1").digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 over the parent block's key (ROOT_KEY for the first block) and the block's token ids (as
    int64)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_key(request: Request) -> bytes:
    """The parent key of a request's first block: ROOT_KEY, or ROOT_KEY salted with its `cache_salt` (so
    requests with different salts never share cached blocks, vLLM's cache_salt)."""
    if request.cache_salt is None:
        return ROOT_KEY
    return hashlib.sha256(ROOT_KEY + request.cache_salt.encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # what a cached block holds: (parent key, token ids), compared on every hit
        self.block_content: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # key -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _hash_blocks(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        while len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else root_key(request)
            hashes.append(block_key(parent, self._block_tokens(request, len(hashes))))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the request's leading full blocks (never its last
        token)."""
        # needs every position
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        hits = []
        for i, block_hash in enumerate(
            self._hash_blocks(request, (request.num_tokens - 1) // self.block_size)
        ):
            block_id = self.cached_blocks.get(block_hash)
            parent = request.block_hashes[i - 1] if i else root_key(request)
            if block_id is None or self.block_content[block_id] != (parent, self._block_tokens(request, i)):
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `computed_blocks`); False if
        short."""
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(request.block_table) - len(computed_blocks)
        num_reused_free = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if num_new_blocks + num_reused_free > self.num_free_blocks:
            return False
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
            request.block_table.append(block_id)
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            request.block_table.append(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            if self.cached_blocks.get(block_hash) == block_id:
                del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None
            self.block_content[block_id] = None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks so later requests can reuse them (never blocks holding
        unverified speculative tokens: only positions below num_tokens are the request's own tokens)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        hashes = self._hash_blocks(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            block_id, block_hash = request.block_table[i], hashes[i]
            if self.block_hash[block_id] is None and block_hash not in self.cached_blocks:
                self.block_hash[block_id] = block_hash
                self.block_content[block_id] = (
                    hashes[i - 1] if i else root_key(request),
                    self._block_tokens(request, i),
                )
                self.cached_blocks[block_hash] = block_id
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def free_excess_slots(self, request: Request) -> None:
        """Speculative rollback: free the tail blocks beyond the request's tokens (they held rejected tokens'
        KV).

        They were allocated this step and never published to the prefix cache (only blocks of computed tokens
        are), so they go to the head of the free queue, to be reused before any cached block is evicted."""
        keep = self.blocks_needed(request.num_tokens)
        while len(request.block_table) > keep:
            block_id = request.block_table.pop()
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks are freed first so they are evicted first."""
        for block_id in reversed(request.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        request.block_table = []
        request.num_registered_blocks = 0
