"""How a model's decoder layers run: its ``DecodeMethod`` (the protocol in models/interfaces.py),
chosen once when the model is built, like a linear layer's method (models/linear.py).

A model that takes a decode method holds it as ``model.decode`` and, in its forward, hands it the
step's embeddings and rotary tables; the method returns the final-norm hidden states
(``ForwardOutput``). ``EAGER`` runs the model's own ``decoder_layers`` (one op at a time: every
step, any device). A faster method (the fused decode layers of loading/fused_decode.py: a
pure-decode step's layers in one C call) takes the steps it applies to and hands the rest to the
same ``decoder_layers``; model code calls the method and knows nothing else.

What such a method may read of the model is what its family declares: a ``DecoderLayout``
(``ModelFamily .decoder_layout``: which submodules are each layer's projections and norms, the final
norm, the lm_head, the shapes and the rotary layout), never names it discovers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.models.interfaces import DecoderModel, ForwardOutput, ImageRows


@dataclass(frozen=True)
class DecoderLayerParts:
    """One pre-norm decoder layer's parts, by their names in the model: x +
    o(attn(rotary(qkv(norm(x))))), then x + down(silu(gate) * up) of gate_up(post_norm(x))."""

    input_norm: str  # RMSNorm before attention
    qkv_proj: str  # Linear: hidden -> [q; k; v] heads (bias: DecoderLayout.qkv_bias)
    o_proj: str  # Linear: num_heads * head_dim -> hidden, no bias
    post_norm: str  # RMSNorm before the MLP
    gate_up_proj: str  # Linear: hidden -> [gate; up], intermediate_size each, no bias
    down_proj: str  # Linear: intermediate_size -> hidden, no bias
    q_norm: str | None = None  # RMSNorm over each q head, before rotary (Qwen3)
    k_norm: str | None = None  # the same over each k head


@dataclass(frozen=True)
class DecoderLayout:
    """A decoder as a family declares it to the decode methods that read its weights directly."""

    layers: tuple[DecoderLayerParts, ...]
    final_norm: str  # RMSNorm after the last layer
    lm_head: str  # Linear: hidden -> vocab_size, no bias (tied: it reads the embeddings)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    tied_lm_head: bool
    # rotate_half's layout; the model's cos/sin tables per row
    rotary: Literal["half-split"] = "half-split"

    def projections(self) -> Iterator[tuple[str, int, int, bool]]:
        """(name, in_features, out_features, bias) of every decoder layer's projections."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for p in self.layers:
            yield p.qkv_proj, self.hidden_size, q + 2 * kv, self.qkv_bias
            yield p.o_proj, q, self.hidden_size, False
            yield p.gate_up_proj, self.hidden_size, 2 * self.intermediate_size, False
            yield p.down_proj, self.intermediate_size, self.hidden_size, False


class EagerDecode:
    """The model's own layers, one op at a time."""

    name = "eager"

    def takes(self, num_rows: int) -> bool:
        return False

    def process_weights(self, model: torch.nn.Module) -> None:
        pass

    def run(self, model: DecoderModel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata, images: Sequence[ImageRows],
            all_logits: bool) -> ForwardOutput:
        return ForwardOutput(model.decoder_layers(x, cos, sin, kv_caches, meta, images))


EAGER = EagerDecode()
