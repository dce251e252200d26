"""Per-request block tables over one BlockPool, with prefix caching: which physical blocks hold
whose KV.

Contract: a request's block table lists physical block ids in logical order; token i of the request
lives in block table[i // block_size] at slot i % block_size. `allocate` is the only way a table is
made or grown and is atomic: it returns None and changes nothing when the free queue cannot cover
the call. A request's first `allocate` may reuse the longest cached prefix (whole blocks, at most
`max_cached_tokens`); those blocks are shared read-only. `cache_blocks` publishes a request's blocks
once they are full and their KV is written. Write-safety invariant (what lets the runner write
without asking): a request only writes tokens at indices >= its num_computed_tokens, which is >= the
cached-prefix tokens `allocate` returned, and every block of the table at or past the first
not-yet-published block is owned by that request alone (ref count 1, no hash); prefix hits and
published blocks are full and lie wholly before num_computed_tokens, so no shared or cached block is
ever written again. `check_invariants` verifies this, the pool's own invariants, and that each
block's ref count equals the number of live tables holding it. Ints and lists only, no tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from firsttoken.kv.block_pool import BlockPool, InvariantError
from firsttoken.kv.prefix_cache import BlockHash


@dataclass
class _RequestBlocks:
    block_ids: list[int]  # physical ids in logical order
    # Leading blocks that are prefix hits or were published by cache_blocks;
    # block_ids[num_published_blocks:] are exclusive to this request and unhashed.
    num_published_blocks: int


@dataclass(frozen=True)
class _FirstAllocationPlan:
    hit_block_ids: list[int]  # prefix-cache hits, in logical order
    num_new_blocks: int  # fresh blocks from the head of the free queue
    num_free_blocks_consumed: int  # num_new_blocks + hits that currently sit in the free queue


@dataclass(frozen=True)
class KVCacheStats:
    """Counters since construction. Hit rate = num_hit_tokens / num_query_tokens."""

    num_queries: int  # first allocations that looked up the prefix cache
    num_query_tokens: int  # full-block tokens those lookups could have hit
    num_hit_tokens: int  # tokens served from the cache
    num_evicted_blocks: int  # cached blocks whose hash was dropped so the block could be reused


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self.num_prefix_queries = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- occupancy -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, evictable cached ones included."""
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a hash (evictable prefix-cache entries)."""
        return self.block_pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0..1.0; cached-but-free blocks count as free."""
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_queries=self.num_prefix_queries,
            num_query_tokens=self.num_prefix_query_tokens,
            num_hit_tokens=self.num_prefix_hit_tokens,
            num_evicted_blocks=self.block_pool.num_evicted_blocks,
        )

    # ---- read-only planning ----------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens: ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def num_cached_prefix_tokens(
        self, block_hashes: Sequence[BlockHash] | None, max_cached_tokens: int | None = None
    ) -> int:
        """Tokens a first `allocate` with these arguments would serve from the cache (a multiple of
        block_size)."""
        return len(self._hit_block_ids(block_hashes, max_cached_tokens)) * self.block_size

    def blocks_needed_for(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash] | None = None,
        max_cached_tokens: int | None = None,
    ) -> int:
        """Free-queue blocks a first `allocate` with these arguments would consume (fresh + revived
        hits)."""
        return self._plan_first_allocation(
            num_tokens, block_hashes, max_cached_tokens
        ).num_free_blocks_consumed

    # ---- mutations -------------------------------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        block_hashes: Sequence[BlockHash] | None = None,
        max_cached_tokens: int | None = None,
    ) -> int | None:
        """Make the request's table cover num_tokens tokens; None (and no change at all) if blocks
        run short.

        First call for a request: reuse the longest cached prefix of `block_hashes`, whole blocks,
        at most `max_cached_tokens` tokens (pass prompt_len - 1 so at least one token is computed),
        then add fresh blocks; the table covers max(num_tokens, cached tokens). Returns the cached
        tokens, the request's starting num_computed_tokens. Later calls only grow the table
        (block_hashes, max_cached_tokens ignored) and return 0.
        """
        request = self._requests.get(request_id)
        if request is not None:
            return self._grow(request, num_tokens)
        plan = self._plan_first_allocation(num_tokens, block_hashes, max_cached_tokens)
        if plan.num_free_blocks_consumed > self.num_free_blocks:
            return None
        # first: hits leave the free queue before take_free evicts
        self.block_pool.acquire(plan.hit_block_ids)
        new_block_ids = self.block_pool.take_free(plan.num_new_blocks)
        self._requests[request_id] = _RequestBlocks(
            plan.hit_block_ids + new_block_ids, len(plan.hit_block_ids)
        )
        num_hit_tokens = len(plan.hit_block_ids) * self.block_size
        if self.enable_prefix_caching and block_hashes is not None:
            self.num_prefix_queries += 1
            self.num_prefix_query_tokens += len(block_hashes) * self.block_size
            self.num_prefix_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Publish the request's blocks that are full within its first num_computed_tokens tokens
        (KV written).

        block_hashes[i] is the hash of logical block i (from compute_block_hashes over the request's
        tokens). A block whose hash another block already holds stays unpublished; the existing
        entry is kept.
        """
        request = self._requests[request_id]
        if num_computed_tokens > len(request.block_ids) * self.block_size:
            raise ValueError(
                f"num_computed_tokens {num_computed_tokens} exceeds the {len(request.block_ids)} blocks of {request_id}"
            )
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(num_computed_tokens // self.block_size, len(block_hashes))
        for logical_index in range(request.num_published_blocks, num_full_blocks):
            self.block_pool.cache(request.block_ids[logical_index], block_hashes[logical_index])
        request.num_published_blocks = max(request.num_published_blocks, num_full_blocks)

    def free(self, request_id: str) -> None:
        """Drop the request's references. Blocks reaching ref count 0 join the free queue tail-block
        first, keeping their hashes: the end of a sequence is evicted before its head, so shared
        prefixes (and the parents every later block's hash chains through) survive longest. Unknown
        ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.block_pool.release(request.block_ids[::-1])

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight update). Returns the number of hashes
        dropped."""
        return self.block_pool.reset_prefix_cache()

    # ---- queries on live requests ----------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in logical order (a copy)."""
        return list(self._requests[request_id].block_ids)

    # ---- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pool invariants, ref count == number of tables holding the block, and the write-safety
        invariant."""
        self.block_pool.check_invariants()
        num_holders = Counter(
            block_id for request in self._requests.values() for block_id in request.block_ids
        )
        for block_id in range(self.num_blocks):
            if self.block_pool.ref_count(block_id) != num_holders[block_id]:
                raise InvariantError(
                    f"block {block_id} has ref count {self.block_pool.ref_count(block_id)} "
                    f"but {num_holders[block_id]} tables hold it"
                )
        for request_id, request in self._requests.items():
            for block_id in request.block_ids[request.num_published_blocks :]:
                if (
                    self.block_pool.ref_count(block_id) != 1
                    or self.block_pool.block_hash(block_id) is not None
                ):
                    raise InvariantError(
                        f"writable block {block_id} of {request_id} is shared or cached"
                    )

    # ---- internals -------------------------------------------------------------------------------
    def _grow(self, request: _RequestBlocks, num_tokens: int) -> int | None:
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(request.block_ids))
        if num_new_blocks > self.num_free_blocks:
            return None
        request.block_ids.extend(self.block_pool.take_free(num_new_blocks))
        return 0

    def _hit_block_ids(
        self, block_hashes: Sequence[BlockHash] | None, max_cached_tokens: int | None
    ) -> list[int]:
        """The cached blocks of the longest cached prefix, capped at max_cached_tokens (whole
        blocks)."""
        if not self.enable_prefix_caching or not block_hashes:
            return []
        max_hit_blocks = len(block_hashes)
        if max_cached_tokens is not None:
            max_hit_blocks = max(0, max_cached_tokens) // self.block_size
        hit_block_ids = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block_id = self.block_pool.lookup(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def _plan_first_allocation(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash] | None,
        max_cached_tokens: int | None,
    ) -> _FirstAllocationPlan:
        hit_block_ids = self._hit_block_ids(block_hashes, max_cached_tokens)
        num_hits_in_free_queue = sum(
            1 for block_id in hit_block_ids if self.block_pool.is_free(block_id)
        )
        num_new_blocks = max(0, self.blocks_needed(num_tokens) - len(hit_block_ids))
        return _FirstAllocationPlan(
            hit_block_ids, num_new_blocks, num_new_blocks + num_hits_in_free_queue
        )
