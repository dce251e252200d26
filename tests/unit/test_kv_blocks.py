"""KV block bookkeeping: pool, block tables, prefix cache. Every test checks invariants after every operation."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.kv.block_pool import BlockPool, InvariantError
from firsttoken.kv.prefix_cache import BlockHash, ImageSpan, compute_block_hashes

BLOCK_SIZE = 4
IMAGE_PAD = 151655  # Qwen2-VL <|image_pad|>: the same id for every picture


class CheckedManager(KVCacheManager):
    """The real manager, checking its invariants after every public mutation."""

    def allocate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = super().allocate(*args, **kwargs)
        self.check_invariants()
        return result

    def cache_blocks(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().cache_blocks(*args, **kwargs)
        self.check_invariants()

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.check_invariants()

    def reset_prefix_cache(self) -> int:
        num_dropped = super().reset_prefix_cache()
        self.check_invariants()
        return num_dropped


def make_manager(num_blocks: int, enable_prefix_caching: bool = True) -> CheckedManager:
    manager = CheckedManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
    manager.check_invariants()
    return manager


def text_positions(num_tokens: int) -> list[list[int]]:
    """A text-only prompt's M-RoPE rows: token i at (i, i, i)."""
    return [list(range(num_tokens))] * 3


def hashes(token_ids: list[int], image_spans: tuple[ImageSpan, ...] = ()) -> list[BlockHash]:
    return compute_block_hashes(token_ids, BLOCK_SIZE, image_spans, positions=text_positions(len(token_ids)))


def prefill(manager: KVCacheManager, request_id: str, token_ids: list[int], spans: tuple[ImageSpan, ...] = ()) -> int:
    """Admit a prompt, 'compute' it whole, publish its full blocks. Returns the cached tokens."""
    block_hashes = hashes(token_ids, spans)
    num_cached_tokens = manager.allocate(request_id, len(token_ids), block_hashes, len(token_ids) - 1)
    assert num_cached_tokens is not None
    manager.cache_blocks(request_id, block_hashes, len(token_ids))
    return num_cached_tokens


def assert_all_free(manager: KVCacheManager) -> None:
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.num_used_blocks == 0
    assert manager.usage == 0.0


# ---- tables: allocate, grow, free ---------------------------------------------------------------------
def test_allocate_grow_free_returns_pool_to_all_free() -> None:
    manager = make_manager(10)
    assert manager.allocate("a", 5) == 0
    assert len(manager.block_table("a")) == 2
    assert manager.allocate("a", 8) == 0  # still fits in 2 blocks
    assert len(manager.block_table("a")) == 2
    assert manager.allocate("a", 9) == 0  # decode crosses into a third block
    assert len(manager.block_table("a")) == 3
    assert manager.allocate("b", 1) == 0
    assert manager.num_used_blocks == 4 and manager.usage == pytest.approx(0.4)
    assert not set(manager.block_table("a")) & set(manager.block_table("b"))
    manager.free("a")
    manager.free("b")
    manager.free("b")  # freeing twice (abort after finish) is harmless
    assert_all_free(manager)


def test_blocks_needed_is_ceil() -> None:
    manager = make_manager(4)
    assert [manager.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocation_failure_is_atomic() -> None:
    manager = make_manager(4)
    assert manager.allocate("a", 12) == 0  # 3 blocks
    table_before = manager.block_table("a")
    assert manager.blocks_needed_for(8) > manager.num_free_blocks
    assert manager.allocate("b", 8) is None  # needs 2, 1 free
    assert manager.num_used_blocks == 3  # nothing of b's
    assert manager.allocate("b", 1) == 0 and len(manager.block_table("b")) == 1  # b's first allocation, now
    manager.free("b")
    assert manager.allocate("a", 20) is None  # growth by 2, 1 free
    assert manager.block_table("a") == table_before
    assert manager.num_free_blocks == 1
    assert manager.allocate("a", 16) == 0  # growth by exactly what is left
    assert manager.num_free_blocks == 0


def test_revived_cache_hits_are_not_counted_as_fresh_blocks() -> None:
    manager = make_manager(4)
    prompt = list(range(12))  # 3 full blocks
    prefill(manager, "a", prompt)
    manager.free("a")
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 3
    # Same 3-block prefix + 2 more blocks: the 3 hits come out of the free queue too, so 3 + 2 > 4.
    longer = prompt + list(range(100, 108))
    assert manager.blocks_needed_for(len(longer), hashes(longer), len(longer) - 1) == 5
    assert manager.allocate("b", len(longer), hashes(longer), len(longer) - 1) is None
    assert manager.num_cached_blocks == 3  # the failed call evicted nothing
    assert manager.allocate("c", len(prompt) + 4, hashes(prompt), len(prompt)) == 12


# ---- prefix cache -------------------------------------------------------------------------------------
def test_second_request_with_same_prefix_shares_full_blocks_only() -> None:
    manager = make_manager(16)
    system = list(range(1, 9))  # 2 full blocks
    assert prefill(manager, "a", system + [50, 51, 52]) == 0  # 2 full blocks + 1 partial
    assert prefill(manager, "b", system + [60, 61, 62]) == 8
    table_a, table_b = manager.block_table("a"), manager.block_table("b")
    assert table_a[:2] == table_b[:2]
    assert table_a[2] != table_b[2]  # the partial block is never cached nor shared
    assert [manager.block_pool.ref_count(b) for b in table_a] == [2, 2, 1]
    assert manager.block_pool.block_hash(table_a[2]) is None
    assert manager.stats().num_hit_tokens == 8 and manager.stats().num_queries == 2
    manager.free("a")
    assert [manager.block_pool.ref_count(b) for b in table_b] == [1, 1, 1]
    manager.free("b")
    assert_all_free(manager)
    assert manager.num_cached_blocks == 2


def test_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    manager = make_manager(8)
    prompt = list(range(8))  # exactly 2 full blocks
    prefill(manager, "a", prompt)
    block_hashes = hashes(prompt)
    assert manager.num_cached_prefix_tokens(block_hashes) // manager.block_size == 2
    assert manager.num_cached_prefix_tokens(block_hashes, max_cached_tokens=7) == 4
    assert manager.allocate("b", 8, block_hashes, max_cached_tokens=7) == 4
    assert manager.block_table("b")[0] == manager.block_table("a")[0]
    assert manager.block_table("b")[1] != manager.block_table("a")[1]  # b writes its own last block
    assert manager.allocate("c", 8, block_hashes, max_cached_tokens=0) == 0


def test_cached_prefix_longer_than_first_chunk_is_kept() -> None:
    manager = make_manager(8)
    prompt = list(range(16))
    prefill(manager, "a", prompt)
    # A chunked-prefill caller asks for only 4 tokens, but all 3 allowed hit blocks are kept.
    assert manager.allocate("b", 4, hashes(prompt), 15) == 12
    assert len(manager.block_table("b")) == 3


def test_cache_blocks_keeps_the_existing_block_for_a_duplicate_hash() -> None:
    manager = make_manager(8)
    prompt = list(range(8))
    block_hashes = hashes(prompt)
    assert manager.allocate("a", 8) == 0  # both computed before either published
    assert manager.allocate("b", 8) == 0
    manager.cache_blocks("a", block_hashes, 8)
    manager.cache_blocks("b", block_hashes, 8)
    manager.cache_blocks("b", block_hashes, 8)  # idempotent
    assert manager.block_pool.lookup(block_hashes[0]) == manager.block_table("a")[0]
    assert manager.block_pool.block_hash(manager.block_table("b")[0]) is None


def test_different_images_with_identical_placeholders_never_share_blocks() -> None:
    manager = make_manager(32)
    prompt = [1, 2, 3, 4] + [IMAGE_PAD] * 8 + [5, 6, 7, 8]
    cat = (ImageSpan("cat", start=4, length=8),)
    dog = (ImageSpan("dog", start=4, length=8),)
    prefill(manager, "cat", prompt, cat)
    assert prefill(manager, "dog", prompt, dog) == 4  # only the text block before the image
    assert prefill(manager, "cat-again", prompt, cat) == 12  # capped at prompt_len - 1
    assert manager.block_table("cat-again")[:3] == manager.block_table("cat")[:3]


def test_same_image_shares_only_at_the_same_offset_within_a_block() -> None:
    base = hashes([IMAGE_PAD] * 8, (ImageSpan("cat", 0, 8),))
    assert base == hashes([IMAGE_PAD] * 8, (ImageSpan("cat", 0, 8),))
    # Same tokens, image starting one token later: block 0 sees the image at offset -1, not 0.
    shifted = hashes([IMAGE_PAD] * 8, (ImageSpan("cat", 1, 7),))
    assert shifted[0] != base[0] and shifted[1] != base[1]
    # An image straddling a block boundary keys both blocks it touches.
    straddle = [9, 9, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 9, 9, 9]
    cat = hashes(straddle, (ImageSpan("cat", 2, 3),))
    dog = hashes(straddle, (ImageSpan("dog", 2, 3),))
    assert cat[0] != dog[0] and cat[1] != dog[1]


def test_the_same_tokens_and_clip_at_another_time_step_share_only_the_blocks_before_the_positions_differ() -> None:
    # Qwen2.5-VL plays a clip's grid g at time start + g * step, the step scaling with the clip's seconds per grid:
    # the same frames at another fps are the same tokens and the same pixels, at other positions from grid 1 on.
    prompt = [1, 2, 3, 4] + [IMAGE_PAD] * 8 + [5, 6, 7, 8]  # text block, grid 0's block, grid 1's block, text block
    clip = (ImageSpan("clip", start=4, length=8),)

    def positions(step: int) -> list[list[int]]:
        t = [0, 1, 2, 3] + [4 + k // 4 * step for k in range(8)] + [6, 7, 8, 9]  # 2 grids of 2 x 2 tokens
        h = [0, 1, 2, 3] + [4 + k // 2 % 2 for k in range(8)] + [6, 7, 8, 9]
        w = [0, 1, 2, 3] + [4 + k % 2 for k in range(8)] + [6, 7, 8, 9]
        return [t, h, w]

    manager = make_manager(16)
    cached = {}
    for request_id, step in (("fps 2", 1), ("fps 1", 2), ("fps 1 again", 2)):
        block_hashes = compute_block_hashes(prompt, BLOCK_SIZE, clip, positions=positions(step))
        cached[request_id] = manager.allocate(request_id, len(prompt), block_hashes, len(prompt) - 1)
        manager.cache_blocks(request_id, block_hashes, len(prompt))
    # the text and grid 0 (at time 4 at either step) are shared; grid 1 and everything after it only at one step
    assert cached == {"fps 2": 0, "fps 1": 8, "fps 1 again": 12}


def test_block_hashes_are_chained_full_blocks_with_extra_key() -> None:
    token_ids = list(range(10))
    block_hashes = hashes(token_ids)
    assert len(block_hashes) == 2  # 2 tokens of a partial block are not hashed
    changed_first = hashes([99] + token_ids[1:])
    assert changed_first[0] != block_hashes[0] and changed_first[1] != block_hashes[1]
    salted = compute_block_hashes(token_ids, BLOCK_SIZE, positions=text_positions(10), extra_key="lora-7")
    assert salted[0] != block_hashes[0] and salted[1] != block_hashes[1]
    grown = compute_block_hashes(token_ids + [10, 11], BLOCK_SIZE, positions=text_positions(12),
                                 prev_hashes=block_hashes)
    assert grown == hashes(token_ids + [10, 11])
    with pytest.raises(ValueError):
        hashes(token_ids, (ImageSpan("x", 8, 4),))  # runs past the tokens
    with pytest.raises(ValueError):
        hashes(token_ids, (ImageSpan("x", 0, 4), ImageSpan("y", 2, 4)))
    with pytest.raises(ValueError, match="one per token"):
        compute_block_hashes(token_ids, BLOCK_SIZE, positions=text_positions(9))


def test_a_requests_keys_are_the_keys_of_its_ids_images_and_positions() -> None:
    """The engine's and the router's path (an EngineRequest's tensors packed once) keys a prompt exactly as the pure
    ints path does, cut at any length."""
    import torch

    from firsttoken.kv.prefix_cache import prompt_block_hashes
    from firsttoken.types import EngineRequest, ImageItem, SamplingParams

    ids = tuple(range(100, 130))
    positions = torch.tensor([list(range(30)), [p + (p % 3) for p in range(30)], [p * 2 for p in range(30)]])
    image = ImageItem("pic", 5, 9, (1, 6, 6), (), None)
    request = EngineRequest("r", ids, (image,), positions, 0, SamplingParams(max_tokens=1), 0.0, 0.0)
    for end in (30, 14, 4, 3):  # whole; past the image; before it; no full block
        spans = (ImageSpan("pic", 5, 9),) if end > 5 else ()
        want = compute_block_hashes(list(ids[:end]), BLOCK_SIZE, spans, positions=positions[:, :end].tolist())
        assert prompt_block_hashes(request, BLOCK_SIZE, end) == want
    assert prompt_block_hashes(request, BLOCK_SIZE) == prompt_block_hashes(request, BLOCK_SIZE, 30)


def test_block_hashes_are_equal_across_processes() -> None:
    code = (
        "from firsttoken.kv.prefix_cache import ImageSpan, compute_block_hashes;"
        "print(compute_block_hashes(list(range(8)), 4, [ImageSpan('cat', 2, 3)], positions=[list(range(8))] * 3,"
        " extra_key='m')[1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = compute_block_hashes(list(range(8)), 4, [ImageSpan("cat", 2, 3)], positions=text_positions(8),
                                extra_key="m")[1].hex()
    assert other.stdout.strip() == here


# ---- eviction -----------------------------------------------------------------------------------------
def test_eviction_takes_least_recently_freed_cached_blocks_first() -> None:
    manager = make_manager(6)
    prompt_a, prompt_b = list(range(100, 108)), list(range(200, 208))
    prefill(manager, "a", prompt_a + [0])  # 2 full + 1 partial block
    prefill(manager, "b", prompt_b + [0])
    manager.free("a")  # a's blocks are now the least recently freed
    manager.free("b")
    assert manager.num_cached_blocks == 4
    assert manager.allocate("c", 12) == 0  # 3 fresh: a's partial + a's 2 cached blocks
    assert manager.stats().num_evicted_blocks == 2
    assert manager.num_cached_prefix_tokens(hashes(prompt_a)) // manager.block_size == 0
    assert manager.num_cached_prefix_tokens(hashes(prompt_b)) // manager.block_size == 2


def test_free_releases_the_tail_first_so_pressure_keeps_the_prefix() -> None:
    manager = make_manager(4)
    prompt = list(range(16))  # 4 full blocks
    prefill(manager, "a", prompt)
    table = manager.block_table("a")
    manager.free("a")
    assert manager.block_pool.free_block_ids() == table[::-1]
    assert manager.allocate("b", 1) == 0  # evicts exactly one block: the tail
    assert manager.block_table("b") == [table[3]]
    assert manager.num_cached_prefix_tokens(hashes(prompt)) // manager.block_size == 3


def test_reset_prefix_cache_forgets_all_hashes() -> None:
    manager = make_manager(8)
    prefill(manager, "a", list(range(9)))
    manager.free("a")
    assert manager.reset_prefix_cache() == 2
    assert manager.num_cached_blocks == 0
    assert manager.num_cached_prefix_tokens(hashes(list(range(9)))) == 0


def test_disabled_prefix_caching_never_hits_and_frees_unhashed_blocks() -> None:
    manager = make_manager(8, enable_prefix_caching=False)
    prompt = list(range(8))
    assert prefill(manager, "a", prompt) == 0
    assert prefill(manager, "b", prompt) == 0
    assert not set(manager.block_table("a")) & set(manager.block_table("b"))
    manager.free("a")
    manager.free("b")
    assert manager.num_cached_blocks == 0 and manager.num_cached_prefix_tokens(hashes(prompt)) == 0
    assert manager.stats().num_queries == 0
    assert_all_free(manager)


def test_pool_check_invariants_catches_corruption() -> None:
    pool = BlockPool(4)
    pool.take_free(2)
    pool._ref_counts[0] = 0  # a used block silently dropped: neither used nor free
    with pytest.raises(InvariantError):
        pool.check_invariants()
    with pytest.raises(InvariantError):
        BlockPool(2).release([0])  # double free


# ---- randomized: 2000 operations against a fake runner that writes "KV" -------------------------------
Position = tuple[int, int, int]  # a token's M-RoPE (t, h, w)
# (tokens up to here, images started so far, the positions of the tokens up to here)
KvValue = tuple[tuple[int, ...], tuple[tuple[str, int], ...], tuple[Position, ...]]


@dataclass
class FakeRequest:
    token_ids: list[int]
    image_spans: tuple[ImageSpan, ...]
    positions: list[Position]  # one per token
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    def expected_kv(self, position: int) -> KvValue:
        """What a correct model would store at `position`: it depends on every token, image and rotary position
        up to it."""
        images = tuple((span.content_hash, span.start) for span in self.image_spans if span.start <= position)
        return tuple(self.token_ids[: position + 1]), images, tuple(self.positions[: position + 1])

    def keys(self) -> list[BlockHash]:
        rows = [list(row) for row in zip(*self.positions)]
        return compute_block_hashes(self.token_ids, BLOCK_SIZE, self.image_spans, positions=rows,
                                    prev_hashes=self.block_hashes)

    def append(self, token_id: int) -> None:
        """A sampled token, one past the last position on every axis."""
        self.token_ids.append(token_id)
        self.positions.append((max(self.positions[-1]) + 1,) * 3)


class FakeRunner:
    """Physical KV as plain values; asserts every write lands in a block the request owns alone."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.slots: dict[tuple[int, int], KvValue] = {}  # (block_id, slot) -> value

    def write(self, request_id: str, request: FakeRequest, end: int) -> None:
        table = self.manager.block_table(request_id)
        for position in range(request.num_computed_tokens, end):
            block_id = table[position // BLOCK_SIZE]
            assert self.manager.block_pool.ref_count(block_id) == 1, "write into a shared block"
            assert self.manager.block_pool.block_hash(block_id) is None, "write into a cached block"
            self.slots[(block_id, position % BLOCK_SIZE)] = request.expected_kv(position)

    def verify_prefix(self, request_id: str, request: FakeRequest, num_cached_tokens: int) -> None:
        table = self.manager.block_table(request_id)
        for position in range(num_cached_tokens):
            stored = self.slots.get((table[position // BLOCK_SIZE], position % BLOCK_SIZE))
            assert stored == request.expected_kv(position), "prefix hit served another prompt's KV"


def random_prompt(rng: random.Random) -> FakeRequest:
    """Prompts from a few shared system prefixes, maybe a clip (3 clips, same placeholder ids) played at one of two
    time steps, a tail. The clip's tokens are grids of 2 at time ``grid * step`` (Qwen2.5-VL's video positions
    scale so with the seconds per grid); the text after it resumes 2 past the clip's start either way."""
    token_ids = list(rng.choice([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 7, 7], [9] * 9, []]))
    positions: list[Position] = [(i, i, i) for i in range(len(token_ids))]
    spans: tuple[ImageSpan, ...] = ()
    if rng.random() < 0.6:
        length, step, start = rng.choice([3, 4, 6]), rng.choice([1, 2]), len(token_ids)
        spans = (ImageSpan(rng.choice("abc"), start, length),)
        token_ids += [IMAGE_PAD] * length
        positions += [(start + k // 2 * step, start, start + k % 2) for k in range(length)]
    resume = len(positions) if not spans else spans[0].start + 2
    tail = rng.randrange(1, 8)
    token_ids += [rng.randrange(3) for _ in range(tail)]
    positions += [(resume + i,) * 3 for i in range(tail)]
    return FakeRequest(token_ids, spans, positions, num_prompt_tokens=len(token_ids))


def admit(
    manager: KVCacheManager, runner: FakeRunner, request_id: str, request: FakeRequest, rng: random.Random
) -> bool:
    """First allocation with a random first chunk; checks blocks_needed_for agrees and the hit KV is right."""
    request.block_hashes = request.keys()
    max_cached_tokens = request.num_prompt_tokens - 1
    num_expected = manager.num_cached_prefix_tokens(request.block_hashes, max_cached_tokens)
    first_chunk_tokens = min(request.num_prompt_tokens, num_expected + rng.randrange(1, 9))
    can = (
        manager.blocks_needed_for(first_chunk_tokens, request.block_hashes, max_cached_tokens)
        <= manager.num_free_blocks
    )
    num_cached_tokens = manager.allocate(request_id, first_chunk_tokens, request.block_hashes, max_cached_tokens)
    assert (num_cached_tokens is not None) == can
    if num_cached_tokens is None:
        return False
    assert num_cached_tokens == num_expected and num_cached_tokens % BLOCK_SIZE == 0
    runner.verify_prefix(request_id, request, num_cached_tokens)
    request.num_computed_tokens = num_cached_tokens
    return True


def step(
    manager: KVCacheManager, runner: FakeRunner, request_id: str, request: FakeRequest, rng: random.Random
) -> None:
    """Compute the next prefill chunk, or one decode token; publish what became full."""
    if request.num_computed_tokens >= request.num_prompt_tokens:
        request.append(rng.randrange(3))  # the sampled token
        request.block_hashes = request.keys()
    end = min(len(request.token_ids), request.num_computed_tokens + rng.randrange(1, 9))
    table_before = manager.block_table(request_id)
    if manager.allocate(request_id, end) is None:
        assert manager.block_table(request_id) == table_before
        return
    runner.write(request_id, request, end)
    request.num_computed_tokens = end
    manager.cache_blocks(request_id, request.block_hashes, end)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_operations_keep_invariants_and_never_serve_wrong_kv(seed: int, enable_prefix_caching: bool) -> None:
    rng = random.Random(seed)
    manager = make_manager(24, enable_prefix_caching)
    runner = FakeRunner(manager)
    live: dict[str, FakeRequest] = {}
    for op_index in range(2000):
        roll = rng.random()
        if roll < 0.3 or not live:
            request_id, request = f"r{op_index}", random_prompt(rng)
            if admit(manager, runner, request_id, request, rng):
                live[request_id] = request
        elif roll < 0.8:
            request_id = rng.choice(sorted(live))
            step(manager, runner, request_id, live[request_id], rng)
        elif roll < 0.995:
            request_id = rng.choice(sorted(live))
            del live[request_id]
            manager.free(request_id)
        else:
            manager.reset_prefix_cache()
    for request_id in sorted(live):
        manager.free(request_id)
    assert_all_free(manager)
    stats = manager.stats()
    if enable_prefix_caching:
        assert stats.num_hit_tokens > 0 and stats.num_evicted_blocks > 0  # the run exercised hits and pressure
    else:
        assert manager.num_cached_blocks == 0 and stats.num_hit_tokens == 0

