"""The contract between a model family and the engine: what the runner may call, and the values that
cross.

A family's model is an ``nn.Module`` with

    model.visual.start_encode(pixel_values, grid_thw) -> EncodeState      # patch embedding, tables
    model.visual.run_units(state, num_units)                               # the next units, in order
    model.visual.finish_encode(state) -> ImageEmbeddings                   # merger(s), order restored
    model(input_ids, positions, kv_caches, meta, images) -> hidden         # [num_tokens, hidden], writes KV
    model.compute_logits(hidden) -> logits                                 # [n, vocab] float32
    model.forward_step(input_ids, positions, kv_caches, meta, images, all_logits) -> ForwardOutput
    model.decode.takes(num_rows)                                           # a pure-decode step fused? (threads)

``forward_step`` is the forward the runner calls: with ``all_logits`` (every row of the step
samples) a decode method that computes the logits in the same call returns them
(``ForwardOutput.logits``), else the runner calls ``compute_logits`` on the rows that sample.
``forward`` is ``forward_step(...).hidden``.

An image's vision work is a fixed sequence of ``EncoderUnit``s (the family's
``encoder_units(vision, grid)``, a pure function of the config and the patch grid, so the scheduler
and the input processor know it without the model). The scheduler may put any number of consecutive
units of an image in one step; the runner keeps the ``EncodeState`` in between. ``ImageEmbeddings``
holds everything a prefill chunk needs of an image: the main rows that replace its pad tokens and,
for DeepStack models, one more tensor per fed decoder layer. A chunk that covers image rows [lo, hi)
receives ``embeddings.rows(lo, hi)`` placed at its packed-batch rows (``ImageRows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.types import EncoderUnit


@dataclass(frozen=True)
class ImageEmbeddings:
    """An image's vision-tower output: ``main`` replaces its pad tokens' embeddings;
    ``deepstack[i]`` is added to the hidden states at its rows after decoder layer i (Qwen3-VL).
    Every tensor is [num_tokens, hidden]."""

    main: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.main.shape[0])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.main, *self.deepstack))

    def rows(self, lo: int, hi: int) -> "ImageEmbeddings":
        return ImageEmbeddings(self.main[lo:hi], tuple(t[lo:hi] for t in self.deepstack))


@dataclass(frozen=True)
class ForwardOutput:
    """A forward's final-norm hidden states [num_tokens, hidden] and, where the step's decode method
    computed them in the same call (asked for every row's), the logits [num_tokens, vocab] float32,
    else None."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class ImageRows:
    """Image embedding rows for packed-batch rows [start, start + embeddings.num_tokens)."""

    start: int
    embeddings: ImageEmbeddings


class EncodeState:
    """An image part-way through a vision tower (models/vision_tower.py's ``TowerState`` holds the
    tensors)."""

    units: tuple[EncoderUnit, ...]  # the image's units, in order (the family's encoder_units)
    units_done: int

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def done(self) -> bool:
        return self.units_done >= self.num_units


class VisionEncoder(Protocol):
    def start_encode(
        self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]
    ) -> EncodeState: ...

    def run_units(self, state: EncodeState, num_units: int) -> None: ...

    def finish_encode(self, state: EncodeState) -> ImageEmbeddings: ...


class DecoderModel(Protocol):
    """What a decode method may call on its model: the eager layers (a step it does not take)."""

    def decoder_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows],
    ) -> torch.Tensor: ...


class DecodeMethod(Protocol):
    name: str

    def takes(self, num_rows: int) -> bool:
        """Would a pure-decode step of this many rows run as one fused call (the runner sets its
        threads by it)?"""
        ...

    def process_weights(self, model: torch.nn.Module) -> None:
        """Once, after the model's weights are loaded and its linear layers' methods have processed
        theirs."""
        ...

    def run(self, model: DecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata, images: Sequence[ImageRows],
            all_logits: bool) -> ForwardOutput:
        """x [num_tokens, hidden]: the step's embeddings (image rows placed); cos, sin [num_tokens,
        head_dim] in x's dtype. ``all_logits``: every row samples, so logits computed in the same
        call may come back."""
        ...


class MultimodalModel(Protocol):
    visual: VisionEncoder
    decode: DecodeMethod  # how its decoder layers run (models/decode.py), chosen when it was built

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [3, num_tokens] int64 (t, h, w)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows] = (),
    ) -> torch.Tensor: ...

    def forward_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows] = (),
        all_logits: bool = False,
    ) -> ForwardOutput:
        """``forward``'s arguments; with ``all_logits`` the logits too where the decode method
        computed them."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
