"""Qwen2-VL: a Qwen2 decoder with multimodal rotary positions (M-RoPE) plus the vision tower; the
family's config parsing, weight mapping and encoder units (``QWEN2_VL``, listed in
models/registry.py).

The model is stateless across steps: the KV cache tensors and the attention metadata come in with
every ``forward`` (the runner owns both). One forward serves a packed batch: prefill chunks and
decode tokens of many sequences back to back, ``[num_tokens, ...]`` rows, as ``AttentionMetadata``
describes. How a runner drives it (models/interfaces.py)::

    hidden = model(input_ids, positions, kv_caches, meta, images)   # positions: [3, num_tokens] from mrope.py
    logits = model.compute_logits(hidden[last_token_rows])          # [num_seqs, vocab] float32

Every linear layer is a ``Linear`` and the decoder's layers run through ``model.decode``: which
product method each layer takes and how the layers run (eager, or fused for decode steps) is chosen
when the model is built (loading/methods.py); nothing here asks which kernel or device computes it.

``images`` place vision-tower output rows (``ImageRows``) over the image-pad tokens of this step's
chunks; the tower runs once per image, unit by unit (``model.visual``), and a chunk that ends inside
an image gets the rows it covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from firsttoken.attention.base import AttentionBackend, AttentionMetadata
from firsttoken.models.model_config import (
    ConfigError,
    ConfigReader,
    ModelConfig,
    VisionConfig,
    decoder_sizes,
    default_mrope_section,
    eos_ids,
    image_processor_config,
    text_and_vision_dicts,
    vision_token_ids,
)
from firsttoken.models.decode import EAGER, DecoderLayerParts, DecoderLayout
from firsttoken.models.family import ModelFamily
from firsttoken.models.interfaces import DecodeMethod, ForwardOutput, ImageRows
from firsttoken.models.layers import (
    RMSNorm,
    SwiGLUMLP,
    apply_rotary_rolled,
    mrope_cos_sin,
    rolled_sin,
)
from firsttoken.models.qwen2_vl_checkpoint import CHECKPOINT_RECIPE
from firsttoken.models.linear import Linear
from firsttoken.models.qwen2_vl_vision import (
    IMAGE_PROCESSOR,
    Qwen2VisionTransformer,
    full_attention_units,
)
from firsttoken.models.weights import QKV_AND_GATE_UP, WeightMapping, flatten_conv3d


class Qwen2Attention(nn.Module):
    """q/k/v projections stacked in one ``qkv_proj`` = [q; k; v] (with bias when
    ``config.attention_bias``: Qwen2; none: Qwen3); o_proj without bias. ``config.qk_norm`` (Qwen3):
    RMSNorm over each head of q and k, before rotary."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn_backend = attn_backend

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        # [num_tokens, 1, head_dim]: layers.rolled_sin of the rotary sin table
        sin_rolled: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        # heads: [q; k; v]
        qkv = self.qkv_proj(x).view(num_tokens, qk_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_heads:]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = (
                self.q_norm(qkv[:, : self.num_heads]),
                self.k_norm(qkv[:, self.num_heads : qk_heads]),
            )
            q, k = apply_rotary_rolled(q, cos, sin_rolled), apply_rotary_rolled(k, cos, sin_rolled)
        # q's and k's heads side by side: one elementwise rotary for both (the same per-element
        # math)
        else:
            qk = apply_rotary_rolled(qkv[:, :qk_heads], cos, sin_rolled)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
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
        sin_rolled: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin_rolled, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2VLModel(nn.Module):
    """Parameter names: ``visual.*`` (see qwen2_vl_vision), ``embed_tokens``, ``layers.N.*``,
    ``norm``, ``lm_head`` (no weight of its own when the config ties it to ``embed_tokens``: it
    reads theirs). ``visual`` is Qwen2-VL's tower unless a family with the same decoder brings its
    own (Qwen2.5-VL's, Qwen3-VL's); DeepStack features (Qwen3-VL) join the image rows after the
    first decoder layers. ``decode`` runs the decoder layers (models/decode.py: eager, unless the
    loader chose another method for this model)."""

    decode: DecodeMethod = EAGER

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, visual: nn.Module | None = None
    ) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} unsupported (silu)")
        self.config = config
        self.attn_backend = attn_backend
        self.visual = Qwen2VisionTransformer(config.vision) if visual is None else visual
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2DecoderLayer(config, attn_backend) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # tied: it reads the embeddings
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, tied_to=tied)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [3, num_tokens] int64 (t, h, w)
        # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows] = (),
    ) -> torch.Tensor:
        """Final-norm hidden states [num_tokens, hidden]; writes this step's keys/values into
        kv_caches."""
        return self.forward_step(input_ids, positions, kv_caches, meta, images).hidden

    def forward_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows] = (),
        all_logits: bool = False,
    ) -> ForwardOutput:
        """``forward``'s arguments (shapes there) -> its hidden states and, with ``all_logits``
        (every row samples), the logits where the decode method computed them in the same call
        (models/interfaces.py)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV cache tensors for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        for rows in images:
            x[rows.start : rows.start + rows.embeddings.num_tokens] = rows.embeddings.main.to(
                x.dtype
            )
        c = self.config
        cos, sin = mrope_cos_sin(
            positions, c.head_dim, c.rope_theta, c.mrope_section, x.dtype, c.mrope_interleaved
        )
        return self.decode.run(self, x, cos, sin, kv_caches, meta, images, all_logits)

    def decoder_layers(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, head_dim]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        images: Sequence[ImageRows] = (),
    ) -> torch.Tensor:
        """The decoder layers and the final norm, one op at a time (``EAGER``, and any decode
        method's fallback)."""
        cos, sin_rolled = cos[:, None, :], rolled_sin(sin)[:, None, :]  # broadcast over heads
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin_rolled, kv_cache, meta)
            # DeepStack: an image's feature i is added to its rows' output of layer i
            for rows in images:
                if i < len(rows.embeddings.deepstack):
                    x[rows.start : rows.start + rows.embeddings.num_tokens] += (
                        rows.embeddings.deepstack[i].to(x.dtype)
                    )
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        return self.lm_head(hidden).float()


def decoder_layout(config: ModelConfig) -> DecoderLayout:
    """``Qwen2VLModel``'s decoder (any family built on it) as decode methods that read its weights
    see it."""
    layers = tuple(
        DecoderLayerParts(
            input_norm=f"layers.{i}.input_layernorm",
            qkv_proj=f"layers.{i}.self_attn.qkv_proj",
            o_proj=f"layers.{i}.self_attn.o_proj",
            post_norm=f"layers.{i}.post_attention_layernorm",
            gate_up_proj=f"layers.{i}.mlp.gate_up_proj",
            down_proj=f"layers.{i}.mlp.down_proj",
            q_norm=f"layers.{i}.self_attn.q_norm" if config.qk_norm else None,
            k_norm=f"layers.{i}.self_attn.k_norm" if config.qk_norm else None,
        )
        for i in range(config.num_hidden_layers)
    )
    return DecoderLayout(
        layers,
        final_norm="norm",
        lm_head="lm_head",
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=config.attention_bias,
        tied_lm_head=config.tie_word_embeddings,
        rotary="half-split",
    )


def parse_config(d: dict[str, Any], preprocessor: dict[str, Any] | None) -> ModelConfig:
    """Qwen2-VL's config.json in either layout: "original" (the release: flat text fields,
    ``rope_scaling``, ``vision_config.embed_dim``/``in_chans``) or "transformers" (nested
    ``text_config``, ``rope_parameters``)."""
    text, v, layout = text_and_vision_dicts(d)
    t = ConfigReader(text, "config.json")
    vr = ConfigReader(v, "config.json vision_config")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    hidden = int(t.require("hidden_size"))
    num_heads = int(t.require("num_attention_heads"))
    head_dim = hidden // num_heads
    embed_dim = int(vr.get("embed_dim", 1280))
    vision = VisionConfig(
        depth=int(vr.get("depth", 32)),
        embed_dim=embed_dim,
        num_heads=int(vr.get("num_heads", 16)),
        intermediate_size=int(embed_dim * float(vr.get("mlp_ratio", 4))),
        out_hidden_size=int(vr.get("hidden_size", hidden)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        spatial_merge_size=int(vr.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vr.get("temporal_patch_size", 2)),
        hidden_act=str(vr.get("hidden_act", "quick_gelu")),
    )
    if hidden % num_heads:
        raise ConfigError("config.json: hidden_size must be divisible by num_attention_heads")
    return ModelConfig(
        family=QWEN2_VL_NAME,
        **decoder_sizes(t, hidden, num_heads),
        head_dim=head_dim,
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))),
        mrope_section=tuple(rope.get("mrope_section") or default_mrope_section(head_dim)),
        tie_word_embeddings=bool(
            d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        **vision_token_ids(d),
        vision=vision,
        image_processor=image_processor_config(preprocessor, IMAGE_PROCESSOR),
        hidden_act=str(t.get("hidden_act", "silu")),
        eos_token_ids=eos_ids(text.get("eos_token_id", d.get("eos_token_id"))),
        layout=layout,
    )


QWEN2_VL_NAME = "qwen2-vl"

# Checkpoint names (first match wins): the release and transformers 5.24's save_pretrained write
# model.embed_tokens / model.layers.N / model.norm / lm_head / visual.*; transformers 4.5x wrote
# model.language_model.* / model.visual.*.
QWEN_VL_WEIGHTS = WeightMapping(
    prefixes=(
        ("model.language_model.", ""),
        ("model.visual.", "visual."),
        ("visual.", "visual."),
        ("model.", ""),
        ("lm_head.", "lm_head."),
    ),
    stacked=QKV_AND_GATE_UP,
    reshape=(("visual.patch_embed.proj.weight", flatten_conv3d),),
)

QWEN2_VL = ModelFamily(
    name=QWEN2_VL_NAME,
    architectures=("Qwen2VLForConditionalGeneration",),
    model_types=("qwen2_vl",),
    parse_config=parse_config,
    build=lambda config, backend: Qwen2VLModel(config, backend),
    weights=QWEN_VL_WEIGHTS,
    encoder_units=full_attention_units,
    checkpoint=CHECKPOINT_RECIPE,
    decoder_layout=decoder_layout,
)
