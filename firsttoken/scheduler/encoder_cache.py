"""Which vision-tower outputs exist or are being computed, who needs them, and which to drop:
bookkeeping only.

Entries are keyed by image content hash and sized in visual tokens. An image is encoded unit by unit
(the model family's split of its vision work, e.g. one block per unit), possibly across several
steps (``units_done`` of its ``num_units``); it is *ready* when every unit has run. Progress is
recorded from what the runner reports it actually ran (``record_progress``), never from what was
scheduled: an encode that fails is ``reset`` to zero units, so a failure can never leave an entry
that claims embeddings nobody holds. An entry pinned by a request whose prefill has not yet passed
that image is never evicted. Unpinned ready entries stay, least recently used first out, while the
total fits ``capacity_tokens``; with capacity 0 (cache off) an entry lives exactly as long as some
request still needs it. An unpinned entry that is not ready (its requester went away mid-encode) is
dropped at once. An image larger than the whole capacity is still served: pinned while needed, then
dropped. The runner holds the tensors and drops those listed by ``pop_freed``.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self._sizes: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._num_units: dict[str, int] = {}
        self._units_done: dict[str, int] = {}
        self._users: dict[str, set[str]] = {}
        self._freed: list[str] = []
        self.num_hits = 0
        self.num_misses = 0

    @property
    def num_tokens(self) -> int:
        return sum(self._sizes.values())

    def contains(self, content_hash: str) -> bool:
        return content_hash in self._sizes

    def is_ready(self, content_hash: str) -> bool:
        return (
            content_hash in self._units_done
            and self._units_done[content_hash] >= self._num_units[content_hash]
        )

    def units_done(self, content_hash: str) -> int:
        return self._units_done.get(content_hash, 0)

    def acquire(self, request_id: str, content_hash: str, num_tokens: int, num_units: int) -> bool:
        """Pin an entry for a request; True on a hit (computed or being computed by someone: no new
        work)."""
        hit = content_hash in self._sizes
        if hit:
            self._sizes.move_to_end(content_hash)
            self.num_hits += 1
        else:
            self._sizes[content_hash] = num_tokens
            self._num_units[content_hash] = num_units
            self._units_done[content_hash] = 0
            self.num_misses += 1
        self._users.setdefault(content_hash, set()).add(request_id)
        return hit

    def record_progress(self, content_hash: str, units_done: int) -> None:
        """The runner reports the image's units now done (after a step). Unknown hashes (the entry
        was dropped while its last work ran) are ignored."""
        if content_hash in self._units_done:
            self._units_done[content_hash] = min(max(units_done, 0), self._num_units[content_hash])

    def reset(self, content_hash: str) -> None:
        """The runner holds nothing for this image (its encode failed, or its embeddings went
        missing): back to zero units. An unpinned entry is dropped instead."""
        if content_hash not in self._sizes:
            return
        if content_hash in self._users:
            self._units_done[content_hash] = 0
        else:
            self._drop(content_hash)

    def is_pinned_by(self, request_id: str, content_hash: str) -> bool:
        return request_id in self._users.get(content_hash, ())

    def release(self, request_id: str, content_hash: str) -> None:
        users = self._users.get(content_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self._users[content_hash]
            if not self.is_ready(content_hash):
                self._drop(content_hash)
        self._shrink()

    def release_all(self, request_id: str) -> None:
        for h in [h for h, users in self._users.items() if request_id in users]:
            self.release(request_id, h)

    @property
    def has_freed(self) -> bool:
        return bool(self._freed)

    def pop_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def check_invariants(self) -> None:
        for h in self._users:
            if h not in self._sizes:
                raise RuntimeError(f"pinned encoder entry {h} has no size record")
        if set(self._units_done) != set(self._sizes) or set(self._num_units) != set(self._sizes):
            raise RuntimeError("encoder progress and size records disagree")
        unpinned = [h for h in self._sizes if h not in self._users]
        if any(not self.is_ready(h) for h in unpinned):
            raise RuntimeError("an unpinned encoder entry is only partly computed")
        if sum(self._sizes[h] for h in unpinned) > self.capacity_tokens:
            raise RuntimeError("unpinned encoder entries exceed capacity")

    def _drop(self, content_hash: str) -> None:
        del self._sizes[content_hash]
        del self._num_units[content_hash]
        del self._units_done[content_hash]
        self._freed.append(content_hash)

    def _shrink(self) -> None:
        """Evict unpinned entries, oldest first, until everything fits or only pinned ones
        remain."""
        total = self.num_tokens
        for h in list(self._sizes):
            if total <= self.capacity_tokens:
                break
            if h in self._users:
                continue
            total -= self._sizes[h]
            self._drop(h)
