"""InternVL3.5's vision side: InternViT over 448x448 tiles -> CLS dropped -> pixel shuffle (each 2x2
patch window -> one token) -> projector (LayerNorm -> Linear -> GELU -> Linear) to the LM's width;
transformers' ``InternVLModel.get_image_features`` (models/internvl/modeling_internvl.py, 5.24).

An image of N tiles (the crops row-major, the thumbnail last: models/internvl_tiles.py) is the grid
(t, h, w) = (N, S, S), S = image_size / patch_size (32) patches a side, so its visual tokens are
t * h * w / merge^2 = N * (S / 2)^2 = 256 N. Pixels come as tiles [N, C, 448, 448] float32, or as
patch rows [N * S * S, C * P * P] (tile-major, patches row-major in a tile, each row (c, y, x)
flattened: ``tiles_to_patch_rows``).

The tower's rows are R = S * S + 1 per tile, the tile's CLS row first, tiles back to back; every
block attends within each tile. What transformers does, step by step:

    embed    conv patch embedding (with bias); [CLS; patches] + position_embeddings [1, R, E],
             added as is (a tile is always image_size: transformers' bicubic interpolation never
             runs, and other grids are refused)
    block    h = lambda_1 * attn(norm1(x)) + x;  out = lambda_2 * mlp(norm2(h)) + h
             norm: LayerNorm or RMSNorm (norm_type, eps layer_norm_eps); attn: q/k/v projections
             (bias: attention_bias), optional RMSNorm (eps 1e-6) over the whole q and the whole k
             (use_qk_norm), softmax(q k^T * head_dim^-0.5) v, an output projection with bias;
             mlp: fc2(act(fc1(x)))
    feature  vision_feature_layer -1: the last block's output through ``layernorm`` (a LayerNorm,
             eps layer_norm_eps, only when use_mean_pooling is False, else identity); k >= 0: the
             output of block k - 1 (k = 0: the embeddings), negative k counting from depth + 1
    shuffle  CLS dropped ("default" strategy); per tile, patch (r, c) of the S x S grid goes to
             token (r // 2) * (S / 2) + c // 2, channels [(2i, 2j), (2i, 2j+1), (2i+1, 2j),
             (2i+1, 2j+1)] concatenated: transformers' pixel_shuffle (the original's ps_version
             "v2"; "v1" lacks the last transpose and is refused)
    project  LayerNorm(4E, eps 1e-5: torch's default) -> Linear(4E, LM) -> act -> Linear(LM, LM)

Encoder units: tiles never attend to each other, so a unit is a group of tiles through a range of
blocks (``TileUnit``), run as one batch of those tiles' rows; groups tile-major, their block
ranges in order. A unit's arithmetic is fixed by the units alone (never by how many of them a
step runs), so any split of an encode across steps, and ``forward``, give bit-identical tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from firsttoken.models.interfaces import ImageEmbeddings
from firsttoken.models.layers import RMSNorm, quick_gelu
from firsttoken.models.linear import Linear
from firsttoken.models.model_config import ConfigError, ConfigReader, VisionConfig
from firsttoken.models.qwen2_vl_vision import PatchEmbed, VisionMLP
from firsttoken.models.vision_tower import (
    Grid,
    ImageSegments,
    TowerState,
    VisionTower,
    check_patches,
)
from firsttoken.models.weights import Stacked, WeightMapping
from firsttoken.types import EncoderUnit

QK_NORM_EPS = 1e-6  # transformers builds q_norm / k_norm with RMSNorm's default, not layer_norm_eps
PROJECTOR_LN_EPS = 1e-5  # nn.LayerNorm's default: the projector's LayerNorm is built without eps
# FLOPs one unit may do: about the heaviest unit of Qwen2-VL's tower (1280 wide, MLP 5120), a
# full-attention block over the 2896-patch image vision_units.MAX_UNIT_PAIRS is sized for. One
# tile through one block is the least a unit does, whatever it costs (InternViT-6B: 2.65e11).
MAX_UNIT_FLOPS = 157 * 10**9

ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # transformers' ACT2FN["gelu"]: the exact (erf) GELU
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
}
NORM_TYPES = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class InternVisionConfig(VisionConfig):
    """``VisionConfig`` plus what InternViT and its projector need. ``temporal_patch_size`` is 1
    (a patch row is C * P * P pixels), ``spatial_merge_size`` is 1 / downsample_ratio and
    ``out_hidden_size`` the LM's hidden size."""

    image_size: int = 448  # pixels per tile side
    norm_type: str = "layer_norm"  # the blocks' norms: "layer_norm" | "rms_norm"
    norm_eps: float = 1e-6
    qk_norm: bool = False  # RMSNorm over the whole q and the whole k projections
    qkv_bias: bool = False
    absolute_positions: bool = True  # a learned [R, E] table added after the CLS row is prepended
    post_norm: bool = False  # a LayerNorm after the last block (use_mean_pooling False)
    feature_layer: int = -1  # vision_feature_layer
    projector_act: str = "gelu"
    # not in config.json: how much work an encoder unit may hold (``unit_shape``)
    max_unit_flops: int = MAX_UNIT_FLOPS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.norm_type not in NORM_TYPES:
            raise ConfigError(
                f"vision_config.norm_type {self.norm_type!r} unsupported ({', '.join(NORM_TYPES)})"
            )
        for field, act in (("hidden_act", self.hidden_act), ("projector_act", self.projector_act)):
            if act not in ACTIVATIONS:
                raise ConfigError(f"{field} {act!r} unsupported ({', '.join(ACTIVATIONS)})")
        if self.image_size % self.patch_size or self.tile_side % self.spatial_merge_size:
            raise ConfigError(
                f"image_size {self.image_size} must be whole patches of {self.patch_size} px and"
                f" whole merge windows of {self.spatial_merge_size}"
            )
        if not -(self.depth + 1) <= self.feature_layer <= self.depth:
            raise ConfigError(f"vision_feature_layer {self.feature_layer} outside the tower")

    @property
    def tile_side(self) -> int:
        """Patches per tile side (32)."""
        return self.image_size // self.patch_size

    @property
    def rows_per_tile(self) -> int:
        """The tower's rows per tile: the CLS row and S * S patches."""
        return self.tile_side**2 + 1

    @property
    def blocks_used(self) -> int:
        """Blocks the feature goes through (all of them for vision_feature_layer -1)."""
        return self.depth if self.feature_layer == -1 else self.feature_layer % (self.depth + 1)

    @property
    def uses_post_norm(self) -> bool:
        return self.post_norm and self.feature_layer == -1


def _square(value: Any, name: str) -> int:
    """An int, or a [h, w] pair with h == w (InternVLVisionConfig stores both as pairs)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConfigError(f"config.json vision_config.{name} {value} must be square")
        value = value[0]
    return int(value)


def _merge_size(downsample_ratio: float) -> int:
    merge = round(1 / downsample_ratio)
    if merge < 1 or abs(merge * downsample_ratio - 1) > 1e-6:
        raise ConfigError(f"downsample_ratio {downsample_ratio} is not 1 / an integer")
    return merge


def parse_vision_config(d: dict[str, Any]) -> InternVisionConfig:
    """The vision side of an InternVLConfig config.json (transformers' layout: ``vision_config``
    and ``text_config`` nested). Absent fields take InternVLVisionConfig's / InternVLConfig's
    defaults, as transformers would load them; the LM's hidden size is required."""
    top = ConfigReader(d, "config.json")
    v = ConfigReader(top.get("vision_config", {}), "config.json vision_config")
    text = ConfigReader(top.require("text_config", "the language model"), "config.json text_config")
    strategy = top.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ConfigError(f"vision_feature_select_strategy {strategy!r} unsupported (default)")
    if top.get("ps_version", "v2") != "v2":
        raise ConfigError(f"ps_version {d['ps_version']!r} unsupported (v2)")
    layer = top.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ConfigError(f"vision_feature_layer {layer!r} unsupported (one layer index)")
    return InternVisionConfig(
        depth=int(v.get("num_hidden_layers", 24)),
        embed_dim=int(v.get("hidden_size", 1024)),
        num_heads=int(v.get("num_attention_heads", 16)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        out_hidden_size=int(text.require("hidden_size")),
        in_channels=int(v.get("num_channels", 3)),
        patch_size=_square(v.get("patch_size", 14), "patch_size"),
        spatial_merge_size=_merge_size(float(top.get("downsample_ratio", 0.5))),
        temporal_patch_size=1,
        hidden_act=str(v.get("hidden_act", "gelu")),
        image_size=_square(v.get("image_size", 448), "image_size"),
        norm_type=str(v.get("norm_type", "layer_norm")),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        qk_norm=bool(v.get("use_qk_norm", False)),
        qkv_bias=bool(v.get("attention_bias", False)),
        absolute_positions=bool(v.get("use_absolute_position_embeddings", True)),
        post_norm=not bool(v.get("use_mean_pooling", True)),
        feature_layer=int(layer),
        projector_act=str(top.get("projector_hidden_act", "gelu")),
    )


# ---------------------------------------------------------------- encoder units


@dataclass(frozen=True)
class TileUnit(EncoderUnit):
    """Tiles whose rows are ``rows`` [lo, hi) of the tower (whole tiles) through blocks [block,
    block + num_blocks). ``num_patches``, ``attention_pairs`` and ``cost_tokens`` add up over its
    blocks, as the same blocks in units of one block each would."""

    num_blocks: int = 1


def tile_block_flops(vision: VisionConfig, rows_per_tile: int) -> int:
    """Multiply-adds x 2 of one block over one tile: per row q/k/v 3E^2, proj E^2, fc1 and fc2 EI
    each; attention 2 x R^2 x E (scores and weighted values)."""
    e, i = vision.embed_dim, vision.intermediate_size
    return rows_per_tile * 2 * (4 * e * e + 2 * e * i) + 2 * 2 * rows_per_tile**2 * e


def _blocks_used(vision: VisionConfig) -> int:
    return vision.blocks_used if isinstance(vision, InternVisionConfig) else vision.depth


def unit_shape(vision: VisionConfig, grid: Grid) -> tuple[int, int]:
    """(tiles, blocks) per unit: as many tile-blocks as ``max_unit_flops`` holds (at least one),
    tiles first (a wider batch for the same work), then blocks."""
    n, h, w = grid
    cap = vision.max_unit_flops if isinstance(vision, InternVisionConfig) else MAX_UNIT_FLOPS
    fit = max(1, cap // tile_block_flops(vision, h * w + 1))
    tiles = min(n, fit)
    return tiles, max(1, min(_blocks_used(vision), fit // tiles))


def even_spans(total: int, most: int) -> list[tuple[int, int]]:
    """[lo, hi) spans covering range(total) in the fewest spans of at most ``most``, as even as
    ceil allows; none for ``total`` 0 (vision_feature_layer 0: the embeddings, no block)."""
    if total == 0:
        return []
    size = math.ceil(total / math.ceil(total / most))
    return [(lo, min(lo + size, total)) for lo in range(0, total, size)]


def tile_units(vision: VisionConfig, grid: Grid) -> tuple[TileUnit, ...]:
    """An image's units: groups of tiles (tile-major) x ranges of blocks (``unit_shape``). Each
    costs its tiles' visual tokens per block (a Qwen block costs its image's visual tokens)."""
    n, h, w = grid
    rows = h * w + 1
    tokens = h * w // vision.spatial_merge_size**2
    tiles, blocks = unit_shape(vision, grid)
    units = []
    for t0, t1 in even_spans(n, tiles):
        for b0, b1 in even_spans(_blocks_used(vision), blocks):
            k, num_blocks = t1 - t0, b1 - b0
            units.append(TileUnit(k * rows * num_blocks, k * rows * rows * num_blocks,
                                  k * tokens * num_blocks, b0, (t0 * rows, t1 * rows), num_blocks))
    return tuple(units)


# ---------------------------------------------------------------- modules


def _norm(config: InternVisionConfig) -> nn.Module:
    if config.norm_type == "rms_norm":
        return RMSNorm(config.embed_dim, config.norm_eps)
    return nn.LayerNorm(config.embed_dim, eps=config.norm_eps)


class TileAttention(nn.Module):
    """Full attention within each tile: [tiles * R, E] rows -> the same, no mask (tiles are the
    batch)."""

    def __init__(self, config: InternVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.scale = self.head_dim**-0.5  # transformers' scaling, passed to SDPA as it does
        self.qkv = Linear(config.embed_dim, 3 * config.embed_dim, bias=config.qkv_bias)
        self.q_norm = RMSNorm(config.embed_dim, QK_NORM_EPS) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config.embed_dim, QK_NORM_EPS) if config.qk_norm else nn.Identity()
        self.proj = Linear(config.embed_dim, config.embed_dim, bias=True)

    def forward(self, x: torch.Tensor, rows_per_tile: int) -> torch.Tensor:
        n, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [tiles, heads, R, head_dim]
            return t.reshape(-1, rows_per_tile, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(n, width))


class InternVisionBlock(nn.Module):
    """transformers' InternVLVisionLayer: pre-norm attention and MLP, each scaled per channel
    (layer scale ``lambda_1`` / ``lambda_2``) before its residual add."""

    def __init__(self, config: InternVisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(config), _norm(config)
        self.attn = TileAttention(config)
        self.mlp = VisionMLP(config, ACTIVATIONS)
        self.lambda_1 = nn.Parameter(torch.ones(config.embed_dim))
        self.lambda_2 = nn.Parameter(torch.ones(config.embed_dim))

    def forward(self, x: torch.Tensor, rows_per_tile: int) -> torch.Tensor:
        # the reference's operand order: scale * branch + residual
        h = self.lambda_1 * self.attn(self.norm1(x), rows_per_tile) + x
        return self.lambda_2 * self.mlp(self.norm2(h)) + h


def pixel_shuffle(patches: torch.Tensor, side: int, merge: int) -> torch.Tensor:
    """[tiles, side * side, E] (patches row-major) -> [tiles * (side / merge)^2, merge^2 * E]:
    transformers' pixel_shuffle(scale_factor = 1 / merge) then its reshape. Token (i, j) row-major
    holds patches (merge i + di, merge j + dj) for di, then dj, in 0..merge-1."""
    tiles, _, width = patches.shape
    g = side // merge
    windows = patches.reshape(tiles, g, merge, g, merge, width).permute(0, 1, 3, 2, 4, 5)
    return windows.reshape(tiles * g * g, merge * merge * width)


class TileMerger(nn.Module):
    """The tower's rows -> LM-width tokens: the optional post-norm, CLS rows dropped, pixel
    shuffle, then transformers' InternVLMultiModalProjector (``layer_norm``, ``linear_1``,
    ``linear_2``)."""

    def __init__(self, config: InternVisionConfig) -> None:
        super().__init__()
        self.side, self.merge = config.tile_side, config.spatial_merge_size
        self.rows_per_tile = config.rows_per_tile
        self.post_norm = (
            nn.LayerNorm(config.embed_dim, eps=config.norm_eps)
            if config.post_norm else nn.Identity()
        )
        self.apply_post_norm = config.uses_post_norm
        merged = config.embed_dim * self.merge**2
        self.layer_norm = nn.LayerNorm(merged, eps=PROJECTOR_LN_EPS)
        self.linear_1 = Linear(merged, config.out_hidden_size)
        self.act = ACTIVATIONS[config.projector_act]
        self.linear_2 = Linear(config.out_hidden_size, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tiles * R, E] -> [tiles * (S / merge)^2, out_hidden_size]."""
        patches = hidden.view(-1, self.rows_per_tile, hidden.shape[-1])[:, 1:]
        if self.apply_post_norm:  # per row: the CLS row dropped first changes nothing
            patches = self.post_norm(patches)
        tokens = pixel_shuffle(patches, self.side, self.merge)
        return self.linear_2(self.act(self.linear_1(self.layer_norm(tokens))))


def tiles_to_patch_rows(tiles: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[N, C, H, W] -> [N * (H / P) * (W / P), C * P * P]: tile-major, patches row-major, each
    patch (c, y, x) flattened (the conv weight's [E, C, P, P] order)."""
    n, c, h, w = tiles.shape
    p = patch_size
    patches = tiles.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(n * (h // p) * (w // p), c * p * p)


class InternVisionTransformer(VisionTower):
    """InternViT + pixel shuffle + projector on the ``VisionTower`` protocol: ``start_encode``
    embeds the tiles (the state's rows [N * R, E]), ``run_units`` runs ``TileUnit``s,
    ``finish_encode`` (the base's) runs ``merger`` (``TileMerger``). No rotary: the state's cos
    and sin are empty; the layout is the identity with one attention segment per tile."""

    encoder_units = staticmethod(tile_units)
    config: InternVisionConfig

    def __init__(self, config: InternVisionConfig) -> None:
        super().__init__(config)
        self.patch_embed = PatchEmbed(config, bias=True)  # Conv2d held as a Linear
        self.cls_token = nn.Parameter(torch.zeros(config.embed_dim))
        self.pos_embed = (
            nn.Parameter(torch.zeros(config.rows_per_tile, config.embed_dim))
            if config.absolute_positions else None
        )
        self.blocks = nn.ModuleList([InternVisionBlock(config) for _ in range(config.depth)])
        self.merger = TileMerger(config)

    def run_units(self, state: TowerState, num_units: int) -> None:  # type: ignore[override]
        """Each unit's tiles through its blocks, as one batch; a plain ``EncoderUnit`` (rows None)
        is one block over every tile."""
        stop = min(state.units_done + num_units, len(state.units))
        for unit in state.units[state.units_done : stop]:
            lo, hi = unit.rows if unit.rows is not None else (0, state.hidden.shape[0])
            x = state.hidden[lo:hi]
            for b in range(unit.block, unit.block + getattr(unit, "num_blocks", 1)):
                x = self.blocks[b](x, self.config.rows_per_tile)
            state.hidden[lo:hi] = x
        state.units_done = stop

    def forward(
        self,
        pixel_values: torch.Tensor,  # tiles [N, C, H, W] or patch rows [N * S * S, C * P * P]
        grid_thw: Sequence[Grid],  # per image (tiles, S, S)
    ) -> ImageEmbeddings:
        """Several images, each encoded by its own units (so bit-identical to its encode split
        anywhere across steps): [sum of 256 N, out_hidden_size], images back to back."""
        rows = self._patch_rows(pixel_values)
        mains, start = [], 0
        for grid, count in zip(grid_thw, check_patches(rows, grid_thw)):
            state = self.start_encode(rows[start : start + count], grid)
            self.run_units(state, state.num_units)
            mains.append(self.finish_encode(state).main)
            start += count
        return ImageEmbeddings(torch.cat(mains))

    def embed(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Patch rows -> [N * R, E]: per tile the CLS row then its patches, plus the position
        table."""
        width = self.config.embed_dim
        patches = self.patch_embed(pixel_values).view(-1, self.config.tile_side**2, width)
        cls = self.cls_token.to(patches.dtype).expand(patches.shape[0], 1, width)
        hidden = torch.cat((cls, patches), dim=1)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed
        return hidden.reshape(-1, width)

    def _patch_rows(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4:
            return pixel_values
        side = self.config.image_size
        if pixel_values.shape[-2:] != (side, side):
            raise ValueError(f"tiles must be {side}x{side}, got {tuple(pixel_values.shape)}")
        return tiles_to_patch_rows(pixel_values, self.config.patch_size)

    def _start(
        self, pixel_values: torch.Tensor, grids: Sequence[Grid], units: tuple[EncoderUnit, ...]
    ) -> TowerState:
        rows = self._patch_rows(pixel_values)
        side = self.config.tile_side
        for grid in grids:
            if grid[1:] != (side, side):
                raise ValueError(f"grid {tuple(grid)}: InternViT tiles are {side}x{side} patches")
        check_patches(rows, grids)
        hidden = self.embed(rows, grids)
        empty = hidden.new_empty(0)
        tiles = sum(t for t, _, _ in grids)
        layout = ImageSegments([self.config.rows_per_tile] * tiles)
        return TowerState(hidden, empty, empty, layout, units)


# ---------------------------------------------------------------- checkpoint names


def _flatten_conv2d(weight: torch.Tensor) -> torch.Tensor:
    """Conv2d [E, C, P, P] (kernel == stride) -> Linear [E, C*P*P]."""
    return weight.reshape(weight.shape[0], -1)


def _position_table(table: torch.Tensor) -> torch.Tensor:
    """[1, R, E] -> [R, E]."""
    return table.reshape(table.shape[-2], table.shape[-1])


def _cls_row(token: torch.Tensor) -> torch.Tensor:
    """[1, 1, E] -> [E]."""
    return token.reshape(-1)


_BLOCK = r"^(visual\.blocks\.\d+\.)"
# transformers' InternVL checkpoint (InternVLForConditionalGeneration: "model." first; the
# released -HF files and InternVLModel: without) -> this module under "visual." (the family's
# mapping adds the language model's prefixes)
INTERNVL_VISION_WEIGHTS = WeightMapping(
    prefixes=(
        ("model.vision_tower.", "visual."),
        ("vision_tower.", "visual."),
        ("model.multi_modal_projector.", "visual.merger."),
        ("multi_modal_projector.", "visual.merger."),
    ),
    stacked=tuple(Stacked(f"attn.{p}_proj", "attn.qkv", i, 3) for i, p in enumerate("qkv")),
    reshape=(
        ("visual.patch_embed.proj.weight", _flatten_conv2d),
        ("visual.pos_embed", _position_table),
        ("visual.cls_token", _cls_row),
    ),
    skip_suffixes=("embeddings.mask_token",),  # masked image modelling only
    renames=(
        (r"^visual\.embeddings\.patch_embeddings\.projection\.", "visual.patch_embed.proj."),
        (r"^visual\.embeddings\.position_embeddings$", "visual.pos_embed"),
        (r"^visual\.embeddings\.cls_token$", "visual.cls_token"),
        (r"^visual\.layernorm\.", "visual.merger.post_norm."),
        (r"^visual\.encoder\.layer\.(\d+)\.", r"visual.blocks.\1."),
        (_BLOCK + r"attention\.projection_layer\.", r"\1attn.proj."),
        (_BLOCK + r"attention\.", r"\1attn."),  # q_proj / k_proj / v_proj, q_norm / k_norm
        (_BLOCK + r"layernorm_before\.", r"\1norm1."),
        (_BLOCK + r"layernorm_after\.", r"\1norm2."),
    ),
)
