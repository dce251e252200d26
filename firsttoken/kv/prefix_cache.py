"""Content keys for KV blocks: what a block of the prefix cache is looked up by.

Contract: `compute_block_hashes` turns a token sequence into one `BlockHash` per FULL block of
`block_size` tokens (a trailing partial block has no hash and is never cached). Equal keys must mean
equal KV, so a block's key holds everything its KV is computed from:
- its token ids;
- for every image (or video grid) whose tokens overlap the block, `(content_hash, block_start -
  image_start)`: placeholder token ids are the same for every picture, so the ids alone would let
  two different images share KV;
- its tokens' rotary positions, every row (M-RoPE's t, h, w): they are not a function of the ids and
  images (a Qwen2.5-VL video's time positions scale with its seconds per grid, an image's follow its
  grid, and every later token's shift with the rope delta of the vision items before it), so the key
  carries the positions themselves rather than the facts a family derives them from;
- everything before it: block i's key contains block i-1's hash, so equal hashes mean equal whole
  prefixes.
The optional `extra_key` (model id, LoRA id, cache salt) enters the first block and so, through the
chain, every block. Hashes are blake2b digests of a length-prefixed little-endian encoding, so they
are equal across processes, machines and `PYTHONHASHSEED` values. `compute_block_hashes` is pure
Python over ints; `prompt_block_hashes` hashes an `EngineRequest`'s tokens packed by
`EngineRequest.token_records` (the one place its tensors are read: the same bytes, so the same keys,
and none is kept).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, NewType

from firsttoken.types import TokenRecords

if TYPE_CHECKING:
    from firsttoken.types import EngineRequest

# A 16-byte blake2b digest. Equal BlockHash <=> equal (extra_key, tokens, images, positions) for the
# whole prefix ending at that block, up to a 2**-128 collision chance.
BlockHash = NewType("BlockHash", bytes)

_DIGEST_BYTES = 16
_ROOT_PARENT = b""  # the parent "hash" of block 0


@dataclass(frozen=True)
class ImageSpan:
    """One image's placeholder tokens: prompt indices [start, start + length).

    Built from an `ImageItem` as `ImageSpan(item.content_hash, item.offset, item.num_tokens)`.
    """

    content_hash: str  # identifies the pixels and every setting that shapes the image's tokens
    start: int  # index of the image's first placeholder token in the prompt
    length: int  # number of placeholder tokens

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"ImageSpan.start must be >= 0, got {self.start}")
        if self.length <= 0:
            raise ValueError(f"ImageSpan.length must be > 0, got {self.length}")

    @property
    def end(self) -> int:
        return self.start + self.length


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    image_spans: Sequence[ImageSpan] = (),
    *,
    positions: Sequence[Sequence[int]],
    extra_key: str | bytes | None = None,
    prev_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """One chained hash per full block of `token_ids`.

    `positions`: the rotary position rows the model computes the tokens at, each `len(token_ids)`
    ints (M-RoPE: 3 rows, t, h, w). `prev_hashes` are hashes already computed for the leading blocks
    of this same sequence (for instance before decode tokens were appended); they are kept as they
    are and only later full blocks are hashed.
    """
    if not positions or any(len(row) != len(token_ids) for row in positions):
        raise ValueError(f"positions needs at least one row of {len(token_ids)} positions (one per token), got rows "
                         f"of {[len(row) for row in positions]}")
    full = len(token_ids) // block_size * block_size if block_size > 0 else 0
    return hash_token_records(
        _token_records(token_ids, positions, full),
        len(token_ids),
        block_size,
        image_spans,
        extra_key=extra_key,
        prev_hashes=prev_hashes,
    )


def hash_token_records(
    records: TokenRecords,
    num_tokens: int,
    block_size: int,
    image_spans: Sequence[ImageSpan] = (),
    *,
    extra_key: str | bytes | None = None,
    prev_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """`compute_block_hashes` from the tokens already packed: `records` holds at least the full
    blocks of the `num_tokens` tokens (an `EngineRequest`'s `token_records`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full_blocks = num_tokens // block_size
    if len(prev_hashes) > num_full_blocks:
        raise ValueError(f"prev_hashes has {len(prev_hashes)} hashes but token_ids only {num_full_blocks} full blocks")
    if records.num_tokens < num_full_blocks * block_size:
        raise ValueError(f"records hold {records.num_tokens} tokens, the full blocks {num_full_blocks * block_size}")
    spans = _checked_spans(image_spans, num_tokens)
    span_ends = [span.end for span in spans]  # ascending, since spans are sorted and disjoint
    block_hashes = list(prev_hashes)
    record_bytes = records.record_bytes
    for block_index in range(len(block_hashes), num_full_blocks):
        block_start = block_index * block_size
        block_end = block_start + block_size
        parent = block_hashes[-1] if block_hashes else _ROOT_PARENT
        block_hashes.append(
            _hash_block(
                parent,
                records.num_position_rows,
                records.data[block_start * record_bytes : block_end * record_bytes],
                _image_keys(spans, span_ends, block_start, block_end),
                extra_key if block_index == 0 else None,
            )
        )
    return block_hashes


def prompt_block_hashes(
    request: EngineRequest, block_size: int, num_tokens: int | None = None
) -> list[BlockHash]:
    """The keys of the full blocks of `request`'s first `num_tokens` prompt tokens (all when None or
    more), as the engine's prefix cache looks them up: its token ids, its images' and video grids'
    spans, its M-RoPE positions. Every image must lie wholly inside or wholly past the first
    `num_tokens` tokens (ValueError otherwise)."""
    end = min(
        request.num_prompt_tokens, request.num_prompt_tokens if num_tokens is None else num_tokens
    )
    spans = [
        ImageSpan(im.content_hash, im.offset, im.num_tokens)
        for im in request.images
        if im.offset < end
    ]
    full = end // block_size * block_size if block_size > 0 else 0
    return hash_token_records(request.token_records(full), end, block_size, spans)


def _hash_block(
    parent_hash: bytes,
    num_position_rows: int,
    token_records: bytes,
    image_keys: Sequence[tuple[str, int]],
    extra_key: str | bytes | None,
) -> BlockHash:
    """The hash of one block given its parent's hash (b"" for block 0), its token records and its
    image keys.

    token_records: per token of the block, its id then its position on each of `num_position_rows`
    rotary axes (M-RoPE: t, h, w), little-endian int64s. image_keys: `(content_hash, block_start -
    image_start)` for each image overlapping the block, in prompt order; the offset is negative when
    the image starts inside the block.
    """
    extra = _encode_extra_key(extra_key)
    parts = [struct.pack("<Q", len(parent_hash)), parent_hash, struct.pack("<Q", len(extra)), extra,
             struct.pack("<QQ", num_position_rows, len(token_records)), token_records,
             struct.pack("<Q", len(image_keys))]
    for content_hash, offset_tokens in image_keys:
        encoded = content_hash.encode("utf-8")
        parts += (struct.pack("<Q", len(encoded)), encoded, struct.pack("<q", offset_tokens))
    return BlockHash(hashlib.blake2b(b"".join(parts), digest_size=_DIGEST_BYTES).digest())


def _token_records(
    token_ids: Sequence[int], positions: Sequence[Sequence[int]], num_tokens: int
) -> TokenRecords:
    """The first `num_tokens` tokens packed as `EngineRequest.token_records` packs a request's, from
    plain ints."""
    columns = [token_ids[:num_tokens], *(row[:num_tokens] for row in positions)]
    data = struct.pack(f"<{num_tokens * len(columns)}q", *chain.from_iterable(zip(*columns)))
    return TokenRecords(data, len(positions), num_tokens)


def _checked_spans(image_spans: Sequence[ImageSpan], num_tokens: int) -> list[ImageSpan]:
    """The spans sorted by start; ValueError if two overlap or one runs past the tokens."""
    spans = sorted(image_spans, key=lambda span: span.start)
    for prev, span in zip(spans, spans[1:]):
        if span.start < prev.end:
            raise ValueError(
                f"image spans [{prev.start}, {prev.end}) and [{span.start}, {span.end}) overlap"
            )
    if spans and spans[-1].end > num_tokens:
        raise ValueError(
            f"image span [{spans[-1].start}, {spans[-1].end}) exceeds the {num_tokens} tokens"
        )
    return spans


def _image_keys(
    spans: Sequence[ImageSpan], span_ends: Sequence[int], block_start: int, block_end: int
) -> list[tuple[str, int]]:
    """(content_hash, block_start - span.start) for every span overlapping [block_start,
    block_end)."""
    keys = []
    for span in spans[bisect.bisect_right(span_ends, block_start) :]:
        if span.start >= block_end:
            break
        keys.append((span.content_hash, block_start - span.start))
    return keys


def _encode_extra_key(extra_key: str | bytes | None) -> bytes:
    # A type tag keeps None, "" and b"" distinct.
    if extra_key is None:
        return b"n"
    if isinstance(extra_key, str):
        return b"s" + extra_key.encode("utf-8")
    return b"b" + bytes(extra_key)


