"""Where a request goes among engine replicas: pure functions over plain values, no Ray
(serving/router.py wraps them in Ray Serve's request-router interface;
tests/unit/test_serving_routing.py drives them directly).

Two decisions, in order:
1. The pool, by counted prompt length: prompts of at least ``long_prompt_threshold`` tokens (text +
   image, the threshold the in-engine lanes use) go to the long pool, the rest to the short pool;
   with one pool, everything goes there and the engine's own lanes still separate them.
2. The replica inside the pool (``rank_replicas``), one of three policies:
   - ``affinity``: the replica this router last sent the longest prefix of the prompt to (prefix
     keys are the engine's own KV block hashes, kv/prefix_cache.py, so images enter them by content
     hash) while its in-flight count is below its capacity and at most ``max_imbalance`` above the
     least loaded replica's; otherwise, and for prompts nobody has seen, power of two choices.
   - ``p2c``: two replicas drawn at random; the one with fewer requests in flight, then more free KV
     blocks.
   - ``round-robin``: replicas in a fixed order (by id), one after the other; ignores load (for
     comparison).
   The answer is a ranking: Serve tries the first replica, and the next ones only when it has no
   room.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from firsttoken.kv.prefix_cache import BlockHash, prompt_block_hashes
from firsttoken.types import EngineRequest

POLICIES = ("affinity", "p2c", "round-robin")
SHORT_POOL, LONG_POOL, SINGLE_POOL = "short", "long", "all"
# prompt blocks hashed for routing (64k tokens at 16 per block); a longer prompt's tail does not
# change where it goes
MAX_PREFIX_BLOCKS = 4096
# prefix keys a router remembers (16-byte keys: a few MiB), least recent dropped
DEFAULT_MEMORY_ENTRIES = 200_000


@dataclass(frozen=True)
class RoutingHints:
    """What the router needs of a request, computed once at the ingress (the prompt never crosses
    twice)."""

    num_prompt_tokens: int
    # chained hash per full prompt block: key i covers blocks 0..i
    prefix_keys: tuple[BlockHash, ...]


def routing_hints(request: EngineRequest, block_size: int) -> RoutingHints:
    """The keys of the prompt's leading full blocks, at most ``MAX_PREFIX_BLOCKS``: each equal to
    the key the replicas' prefix caches compute for that block over the whole prompt.

    The prefix is cut at ``MAX_PREFIX_BLOCKS * block_size`` tokens, or at the start of the first
    image that ends past that cut, whichever is earlier, so the kept prefix never holds part of an
    image (a replica keys a block of an image by its content hash and offset; keyed as text, it
    would name a block no replica ever caches)."""
    cut = MAX_PREFIX_BLOCKS * block_size
    for im in sorted(request.images, key=lambda im: im.offset):
        # it and every later image (spans are disjoint) are left out with the tokens from here
        if im.end > cut:
            cut = min(cut, im.offset)
            break
    keys = prompt_block_hashes(request, block_size, cut)
    return RoutingHints(request.num_prompt_tokens, tuple(keys))


def pool_for(num_prompt_tokens: int, long_prompt_threshold: int, pools: Sequence[str]) -> str:
    """The pool a prompt of this many tokens goes to: ``SINGLE_POOL`` when it is the only one."""
    if SINGLE_POOL in pools:
        return SINGLE_POOL
    return LONG_POOL if num_prompt_tokens >= long_prompt_threshold else SHORT_POOL


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it when a request is routed."""

    replica: Hashable  # the replica's id
    num_in_flight: int  # requests this router sent it that have not completed
    capacity: int  # requests it may hold at once (running + queued in its engine)
    num_free_kv_blocks: int  # as the replica last reported it (0 before its first report)


class PrefixMemory:
    """Which replica each prefix key was last sent to; bounded, least recently used dropped."""

    def __init__(self, max_entries: int = DEFAULT_MEMORY_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._where: OrderedDict[BlockHash, Hashable] = OrderedDict()

    def remember(self, keys: Sequence[BlockHash], replica: Hashable) -> None:
        for key in keys:
            self._where[key] = replica
            self._where.move_to_end(key)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    def holder(self, keys: Sequence[BlockHash]) -> tuple[Hashable, int] | None:
        """(replica, blocks matched) for the longest remembered prefix of ``keys``; keys are
        chained, so the last remembered one decides."""
        for i in range(len(keys) - 1, -1, -1):
            replica = self._where.get(keys[i])
            if replica is not None:
                return replica, i + 1
        return None

    def forget(self, replica: Hashable) -> None:
        """The replica died: what it held is gone."""
        for key in [k for k, r in self._where.items() if r == replica]:
            del self._where[key]

    def __len__(self) -> int:
        return len(self._where)


@dataclass
class RoutingState:
    """What a router keeps between requests: the prefix memory and the round-robin position."""

    memory: PrefixMemory
    next_index: int = 0


def rank_replicas(
    policy: str,
    loads: Sequence[ReplicaLoad],
    hints: RoutingHints | None,
    state: RoutingState,
    max_imbalance: int,
    rng: random.Random,
) -> list[Hashable]:
    """Replica ids, most preferred first (every candidate appears once)."""
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not loads:
        return []
    if policy == "round-robin":
        ordered = sorted(loads, key=lambda r: str(r.replica))
        start = state.next_index % len(ordered)
        state.next_index += 1
        return [r.replica for r in ordered[start:] + ordered[:start]]
    if policy == "affinity" and hints is not None and hints.prefix_keys:
        held = state.memory.holder(hints.prefix_keys)
        by_id = {r.replica: r for r in loads}
        if held is not None and held[0] in by_id:
            holder = by_id[held[0]]
            least = min(r.num_in_flight for r in loads)
            if (
                holder.num_in_flight < holder.capacity
                and holder.num_in_flight - least <= max_imbalance
            ):
                return [holder.replica, *_two_choices([r for r in loads if r is not holder], rng)]
    return _two_choices(loads, rng)


def _two_choices(loads: Sequence[ReplicaLoad], rng: random.Random) -> list[Hashable]:
    """Two drawn at random, the less loaded first, then the rest: fewer in flight, then more free KV
    blocks."""
    pool = list(loads)
    rng.shuffle(pool)
    head = sorted(pool[:2], key=lambda r: (r.num_in_flight, -r.num_free_kv_blocks))
    return [r.replica for r in head + pool[2:]]
