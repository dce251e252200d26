"""Multimodal rotary positions (M-RoPE) for a Qwen2-VL prompt, identical to transformers' ``get_rope_index``.

Text token at prompt index i: (p, p, p) where p is the running position. An image of (t, h, w) patches takes
t * (h/m) * (w/m) pad tokens (m = spatial merge size) at positions (p + frame, p + row, p + col) in row-major
order, then the running position jumps by max(h, w) / m. After a prompt of ``L`` tokens the running position is
``L + delta`` (``delta`` <= 0 when images are present), and generated token i >= L sits at ``i + delta`` on all
three axes. Computed once per request; any chunk ``positions[:, a:b]`` is then correct on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from firsttoken.models.config import ModelConfig


@dataclass(frozen=True)
class MRopePositions:
    positions: torch.Tensor  # [3, prompt_len] int64 (t, h, w)
    delta: int  # decode token at index i >= prompt_len has position i + delta on every axis


def compute_mrope_positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[tuple[int, int, int]],
    config: ModelConfig,
) -> MRopePositions:
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
    merge = config.vision.spatial_merge_size
    is_image = (ids == config.image_token_id).tolist()
    pieces: list[torch.Tensor] = []
    pos = 0  # running position
    i = 0
    grids = iter(image_grid_thw)
    num_images = 0
    while i < len(is_image):
        if not is_image[i]:
            j = i
            while j < len(is_image) and not is_image[j]:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        grid = next(grids, None)
        if grid is None:
            raise ValueError(f"prompt has more images than the {len(image_grid_thw)} grids given")
        num_images += 1
        t, h, w = (int(x) for x in grid)
        gt, gh, gw = t, h // merge, w // merge
        n = gt * gh * gw
        if i + n > len(is_image) or not all(is_image[i : i + n]):
            raise ValueError(f"image {num_images - 1} with grid {tuple(grid)} needs {n} consecutive image-pad tokens")
        tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack((tt, hh, ww)).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        i += n
    if num_images != len(image_grid_thw):
        raise ValueError(f"prompt has {num_images} images but {len(image_grid_thw)} grids were given")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return MRopePositions(positions=positions.contiguous(), delta=delta)


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] int64 positions of tokens start .. start + count - 1 past the prompt (same on every axis)."""
    return (torch.arange(start, start + count, dtype=torch.int64) + delta).expand(3, -1).contiguous()
