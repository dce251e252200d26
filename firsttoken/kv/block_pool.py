"""The pool of physical KV blocks: reference counts, the free queue, and the hash -> block map.

Contract: blocks are ids 0..num_blocks-1. A block is *used* while its ref count is > 0 and *free*
while it is 0; every free block sits in the free queue exactly once, least recently freed at the
head. A free block may still hold a `BlockHash` (its KV is intact and can be reused by a later
prefix hit: it is *cached*, or evictable); `take_free` hands out blocks from the head and evicts
their hash, `acquire` revives a cached block from anywhere in the queue. A block holds a hash iff
the hash map points at it (a second block with the same content is simply not registered). The pool
never decides which blocks a request gets; the manager does, and checks up front that a call can
succeed, so every mutation here either fully applies or raises before changing anything.
`check_invariants` raises `InvariantError` when the bookkeeping is broken. Ints and lists only, no
tensors.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from firsttoken.kv.prefix_cache import BlockHash


class InvariantError(Exception):
    """The block bookkeeping contradicts itself: a bug in firsttoken, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # Insertion order is LRU order: head = least recently freed = next to be handed out.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_cached_free_blocks = 0  # free blocks that still hold a hash
        self.num_evicted_blocks = 0  # cached blocks whose hash was dropped to reuse the block

    # ---- reads -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached ones included (all of them can be handed out)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a hash: evictable prefix-cache entries."""
        return self._num_cached_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_queue

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, used or free, or None."""
        return self._hash_to_block.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first."""
        return list(self._free_queue)

    # ---- writes ----------------------------------------------------------------------------------
    def take_free(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks from the head of the free queue with ref count 1, evicting
        their hashes."""
        if num_blocks > len(self._free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free_queue)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block (prefix-cache hits); a free block leaves the free
        queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
                if self._block_hashes[block_id] is not None:
                    self._num_cached_free_blocks -= 1
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """One reference less to each block; a block reaching 0 joins the tail of the free queue, in
        the order given, keeping its hash (it stays a cache entry until evicted)."""
        for block_id, num_releases in Counter(block_ids).items():
            if self._ref_counts[block_id] < num_releases:
                ref_count = self._ref_counts[block_id]
                raise InvariantError(
                    f"block {block_id} released {num_releases}x with ref count {ref_count}"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_hashes[block_id] is not None:
                    self._num_cached_free_blocks += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a used, full block under `block_hash`. False (and nothing changes) when another
        block already holds that hash: the existing entry stays, this block stays unhashed."""
        if self._ref_counts[block_id] <= 0:
            raise InvariantError(f"caching free block {block_id}")
        if self._block_hashes[block_id] is not None:
            raise InvariantError(f"block {block_id} is already cached")
        if block_hash in self._hash_to_block:
            return False
        self._block_hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every hash, used blocks' included (their KV stays, it just can't be hit any more).
        Returns the number of hashes dropped."""
        num_dropped = len(self._hash_to_block)
        self._hash_to_block.clear()
        self._block_hashes = [None] * self.num_blocks
        self._num_cached_free_blocks = 0
        return num_dropped

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is None:
            return
        del self._hash_to_block[block_hash]
        self._block_hashes[block_id] = None
        self._num_cached_free_blocks -= 1
        self.num_evicted_blocks += 1

    # ---- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantError if refcounts, the free queue or the hash map contradict each
        other."""
        num_used = sum(1 for ref_count in self._ref_counts if ref_count > 0)
        if len(self._free_queue) + num_used != self.num_blocks:
            raise InvariantError(
                f"free {len(self._free_queue)} + used {num_used} != total {self.num_blocks}"
            )
        for block_id, ref_count in enumerate(self._ref_counts):
            if ref_count < 0:
                raise InvariantError(f"block {block_id} has ref count {ref_count}")
        for block_id in self._free_queue:
            if self._ref_counts[block_id] != 0:
                ref_count = self._ref_counts[block_id]
                raise InvariantError(
                    f"block {block_id} is in the free queue with ref count {ref_count}"
                )
        self._check_hashes()

    def _check_hashes(self) -> None:
        for block_hash, block_id in self._hash_to_block.items():
            if self._block_hashes[block_id] != block_hash:
                raise InvariantError(
                    f"hash {block_hash.hex()} maps to block {block_id}, which does not hold it"
                )
        num_hashed = sum(1 for block_hash in self._block_hashes if block_hash is not None)
        if num_hashed != len(self._hash_to_block):
            raise InvariantError(
                f"{num_hashed} blocks hold a hash but the map has {len(self._hash_to_block)}"
            )
        num_cached_free = sum(
            1 for block_id in self._free_queue if self._block_hashes[block_id] is not None
        )
        if num_cached_free != self._num_cached_free_blocks:
            raise InvariantError(
                f"{num_cached_free} cached free blocks, counter says {self._num_cached_free_blocks}"
            )
