"""Content keys for KV blocks: what a block of the prefix cache is looked up by.

Contract: `compute_block_hashes` turns a token sequence into one `BlockHash` per FULL block of `block_size`
tokens (a trailing partial block has no hash and is never cached). Hashes are chained: block i's key contains
block i-1's hash, so equal hashes mean equal whole prefixes, not just equal blocks. A block's key holds its
token ids and, for every image whose tokens overlap the block, `(image content_hash, block_start - image_start)`:
image placeholder token ids are the same for every picture, so the ids alone would let two different images
share KV. The optional `extra_key` (model id, LoRA id, cache salt) enters the first block and so, through the
chain, every block. Hashes are blake2b digests of a length-prefixed little-endian encoding, so they are equal
across processes, machines and `PYTHONHASHSEED` values. Pure Python, no tensors.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

# A 16-byte blake2b digest. Equal BlockHash <=> equal (extra_key, tokens, images) for the whole prefix
# ending at that block, up to a 2**-128 collision chance.
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
    extra_key: str | bytes | None = None,
    prev_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """One chained hash per full block of `token_ids`.

    `prev_hashes` are hashes already computed for the leading blocks of this same sequence (for instance
    before decode tokens were appended); they are kept as they are and only later full blocks are hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    if len(prev_hashes) > num_full_blocks:
        raise ValueError(f"prev_hashes has {len(prev_hashes)} hashes but token_ids only {num_full_blocks} full blocks")
    spans = _checked_spans(image_spans, len(token_ids))
    span_ends = [span.end for span in spans]  # ascending, since spans are sorted and disjoint
    block_hashes = list(prev_hashes)
    for block_index in range(len(block_hashes), num_full_blocks):
        block_start = block_index * block_size
        block_end = block_start + block_size
        parent = block_hashes[-1] if block_hashes else _ROOT_PARENT
        block_hashes.append(
            hash_block(
                parent,
                token_ids[block_start:block_end],
                _image_keys(spans, span_ends, block_start, block_end),
                extra_key if block_index == 0 else None,
            )
        )
    return block_hashes


def hash_block(
    parent_hash: bytes,
    block_token_ids: Sequence[int],
    image_keys: Sequence[tuple[str, int]] = (),
    extra_key: str | bytes | None = None,
) -> BlockHash:
    """The hash of one block given its parent's hash (b"" for block 0), its tokens and its image keys.

    image_keys: `(content_hash, block_start - image_start)` for each image overlapping the block, in
    prompt order; the offset is negative when the image starts inside the block.
    """
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    _put_bytes(hasher, parent_hash)
    _put_bytes(hasher, _encode_extra_key(extra_key))
    hasher.update(struct.pack(f"<Q{len(block_token_ids)}q", len(block_token_ids), *block_token_ids))
    hasher.update(struct.pack("<Q", len(image_keys)))
    for content_hash, offset_tokens in image_keys:
        _put_bytes(hasher, content_hash.encode("utf-8"))
        hasher.update(struct.pack("<q", offset_tokens))
    return BlockHash(hasher.digest())


def _checked_spans(image_spans: Sequence[ImageSpan], num_tokens: int) -> list[ImageSpan]:
    """The spans sorted by start; ValueError if two overlap or one runs past the tokens."""
    spans = sorted(image_spans, key=lambda span: span.start)
    for prev, span in zip(spans, spans[1:]):
        if span.start < prev.end:
            raise ValueError(f"image spans [{prev.start}, {prev.end}) and [{span.start}, {span.end}) overlap")
    if spans and spans[-1].end > num_tokens:
        raise ValueError(f"image span [{spans[-1].start}, {spans[-1].end}) exceeds the {num_tokens} tokens")
    return spans


def _image_keys(
    spans: Sequence[ImageSpan], span_ends: Sequence[int], block_start: int, block_end: int
) -> list[tuple[str, int]]:
    """(content_hash, block_start - span.start) for every span overlapping [block_start, block_end)."""
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


def _put_bytes(hasher: "hashlib._Hash", data: bytes) -> None:
    hasher.update(struct.pack("<Q", len(data)))
    hasher.update(data)
