"""Qwen2-VL: a Qwen2 decoder with multimodal rotary positions (M-RoPE) plus the vision tower.

The model is stateless across steps: the KV cache tensors and the attention metadata come in with every
``forward`` (the runner owns both). One forward serves a packed batch: prefill chunks and decode tokens of many
sequences back to back, ``[num_tokens, ...]`` rows, as ``AttentionMetadata`` describes.

How a runner drives it for one step::

    embeds = model.embed_tokens(input_ids)                    # [num_tokens, hidden]
    embeds = merge_image_embeds(embeds, input_ids, image_rows, config.image_token_id)
    hidden = model(embeds, positions, kv_caches, meta)        # positions: [3, num_tokens] from mrope.py
    logits = model.compute_logits(hidden[last_token_rows])    # [num_seqs, vocab] float32

``image_rows`` are the vision-tower outputs for exactly the image-pad tokens inside this step's chunk(s), in
order; the tower runs once per image (``model.visual``) and ``image_rows_in_span`` tells which of its rows a
chunk covers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.attention.base import AttentionBackend, AttentionMetadata
from firsttoken.config import ModelConfig
from firsttoken.models.layers import RMSNorm, SwiGLUMLP, apply_rotary, mrope_cos_sin
from firsttoken.models.qwen2_vl_vision import Qwen2VisionTransformer


class Qwen2Attention(nn.Module):
    """q/k/v projections (with bias) stacked in one ``qkv_proj`` = [q; k; v]; o_proj without bias."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attn_backend = attn_backend

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2VLModel(nn.Module):
    """Parameter names: ``visual.*`` (see qwen2_vl_vision), ``embed_tokens``, ``layers.N.*``, ``norm``,
    ``lm_head`` (absent when the config ties it to ``embed_tokens``)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} unsupported (silu)")
        self.config = config
        self.attn_backend = attn_backend
        self.visual = Qwen2VisionTransformer(config.vision)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2DecoderLayer(config, attn_backend) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [3, num_tokens] int64 (t, h, w)
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden]; writes this step's keys/values into kv_caches."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV cache tensors for {len(self.layers)} layers")
        cos, sin = mrope_cos_sin(
            positions, self.config.head_dim, self.config.rope_theta, self.config.mrope_section, inputs_embeds.dtype
        )
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        x = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


def merge_image_embeds(
    inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
    input_ids: torch.Tensor,  # [num_tokens]
    image_embeds: torch.Tensor,  # [num image-pad tokens among input_ids, hidden]
    image_token_id: int,
) -> torch.Tensor:
    """inputs_embeds with the image-pad rows replaced, in order, by image_embeds (written in place)."""
    mask = input_ids == image_token_id
    num_pads = int(mask.sum())
    if num_pads != image_embeds.shape[0]:
        raise ValueError(f"{num_pads} image-pad tokens but {image_embeds.shape[0]} image embedding rows")
    if num_pads:
        inputs_embeds[mask] = image_embeds.to(inputs_embeds.dtype)
    return inputs_embeds


def image_rows_in_span(input_ids: Sequence[int] | torch.Tensor, start: int, end: int, image_token_id: int) -> slice:
    """Which rows of a prompt's concatenated image embeddings cover the image-pad tokens in
    ``input_ids[start:end]`` (input_ids is the whole prompt)."""
    ids = torch.as_tensor(input_ids)
    before = int((ids[:start] == image_token_id).sum())
    inside = int((ids[start:end] == image_token_id).sum())
    return slice(before, before + inside)
