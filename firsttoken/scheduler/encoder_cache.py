"""Which vision-tower outputs exist, who needs them, and which to drop: bookkeeping only, no tensors.

Entries are keyed by image content hash and sized in visual tokens. An entry referenced by a request whose
prefill has not yet passed that image is pinned. Unreferenced entries stay, least recently used first out,
while the total fits `capacity_tokens`; with capacity 0 (cache off) an entry lives exactly as long as some
request still needs it. An image larger than the whole capacity is still served: it is pinned while needed
and dropped as soon as it is released. The runner holds the tensors and drops those the scheduler lists in
`ScheduledBatch.freed_encoder_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self._sizes: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._users: dict[str, set[str]] = {}
        self._freed: list[str] = []
        self.num_hits = 0
        self.num_misses = 0

    @property
    def num_tokens(self) -> int:
        return sum(self._sizes.values())

    def contains(self, content_hash: str) -> bool:
        return content_hash in self._sizes

    def acquire(self, request_id: str, content_hash: str, num_tokens: int) -> bool:
        """Pin an entry for a request; returns True on a hit (the output exists, no encode needed)."""
        hit = content_hash in self._sizes
        if hit:
            self._sizes.move_to_end(content_hash)
            self.num_hits += 1
        else:
            self._sizes[content_hash] = num_tokens
            self.num_misses += 1
        self._users.setdefault(content_hash, set()).add(request_id)
        return hit

    def is_pinned_by(self, request_id: str, content_hash: str) -> bool:
        return request_id in self._users.get(content_hash, ())

    def release(self, request_id: str, content_hash: str) -> None:
        users = self._users.get(content_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self._users[content_hash]
        self._shrink()

    def release_all(self, request_id: str) -> None:
        for h in [h for h, users in self._users.items() if request_id in users]:
            self.release(request_id, h)

    def pop_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def check_invariants(self) -> None:
        for h in self._users:
            if h not in self._sizes:
                raise RuntimeError(f"pinned encoder entry {h} has no size record")
        unpinned = sum(n for h, n in self._sizes.items() if h not in self._users)
        if unpinned > self.capacity_tokens:
            raise RuntimeError("unpinned encoder entries exceed capacity")

    def _shrink(self) -> None:
        """Evict unpinned entries, oldest first, until unpinned + pinned fit, or only pinned ones remain."""
        total = self.num_tokens
        for h in list(self._sizes):
            if total <= self.capacity_tokens:
                break
            if h in self._users:
                continue
            total -= self._sizes.pop(h)
            self._freed.append(h)
